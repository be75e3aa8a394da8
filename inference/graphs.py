"""CUDA-graph capture of fixed-shape steps (the verification forward, the draft steps).

A `GraphedStep` wraps a function of tensors: the first call for a given set of input shapes
warms it up on a side stream and captures a graph; later calls copy the inputs into the
graph's static buffers and replay it. Non-tensor arguments (a KV cache module) must stay the
same objects across calls. All graphs share one memory pool; `reset` drops them (caches
reallocated). Outputs are cloned so that one graph's replay cannot overwrite another's result.
"""

import torch


class GraphedStep:
    def __init__(self, fn):
        self.fn = fn
        self.graphs = {}
        self.pool = None

    def reset(self):
        # The pool dies with its last graph: capturing into the old handle afterwards trips the
        # caching allocator's `use_count > 0` assert (seen on the H100), so start a new pool.
        self.graphs.clear()
        self.pool = None

    @staticmethod
    def key(args):
        return tuple((tuple(a.shape), a.dtype) if torch.is_tensor(a) else id(a) for a in args)

    def capture(self, args):
        static = [a.clone() if torch.is_tensor(a) else a for a in args]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.fn(*static)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(*static)
        return graph, static, out

    def __call__(self, *args):
        key = self.key(args)
        if key not in self.graphs:
            self.graphs[key] = self.capture(args)
        graph, static, out = self.graphs[key]
        for s, a in zip(static, args):
            if torch.is_tensor(a):
                s.copy_(a)
        graph.replay()
        return tuple(o.clone() for o in out)
