"""vLLM as the data engine: greedy (or sampled) answers to many prompts at once, and with them the hidden states
of every token it ran, in this project's convention (`target_hidden_states`), for `eagle-prep distil` and
`capture --engine vllm`.

vLLM's `extract_hidden_states` speculative method captures the aux layers' inputs and the last layer's output
while it generates; a KV connector (engines/vllm_hidden_states.py) writes them to a file per request. vLLM takes
over the process it runs in, so the engine lives in a child process: `generate_batch` starts one per call,
`HiddenStatesServer` keeps one up between batches.

    with HiddenStatesServer("smollm2-135m", (2, 15, 27)) as engine:
        samples = engine.answer(prompts, max_new_tokens=192, stop_ids={2})
"""

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_train.target import load_target_config
from engines.vllm_child import (
    VLLM_KEY,
    ChildServer,
    VllmError,
    child_env,
    exit_child,
    installed_version,
    missing,
    run_child,
)

BATCH_CHILD = "import sys; from engines.vllm_data import serve_batch; serve_batch(*sys.argv[1:])"
HIDDEN_STATES_CHILD = (
    "import sys; from engines.vllm_data import serve_hidden_states; serve_hidden_states(*sys.argv[1:])"
)
# GiB of CPU KV cache for distil: each of a shard's sequences holds its KV and its captured hidden states there,
# and too small a cache makes vLLM preempt and recompute (5x slower at 128 sequences of ~400 tokens)
DISTIL_CPU_KV_CACHE_GIB = 6
HIDDEN_STATES_CONNECTOR = ("engines.vllm_hidden_states", "SafetensorsHiddenStatesConnector")


@dataclass
class BatchRun:
    """Greedy answers to a list of prompts from one engine; with hidden states, `samples` holds per prompt
    `input_ids` [T] (prompt + answer), `aux_hidden` [T - 1, 3H] and `final_hidden` [T - 1, H]: the last token
    is sampled, never run, so it has no hidden state (training never reads it: methods/eagle3/ttt.py,
    methods/peagle/batch.py)."""

    version: str
    init_seconds: float
    generate_seconds: float  # generate, and with hidden states until every file is written
    output_ids: list[list[int]]
    samples: list[dict] | None


def generate_batch(
    target: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    aux_layer_ids=None,
    max_num_seqs: int = 128,
    dtype: str | None = None,
    sampling: dict | None = None,
) -> BatchRun:
    """Greedy answers to token-id `prompts`, all submitted at once (continuous batching); with `aux_layer_ids`
    also the hidden states of every token that ran, in this project's convention (`target_hidden_states`):
    aux = the inputs of those decoder layers, final = the last layer's output after the final norm. vLLM's
    `extract_hidden_states` method captures them from the forwards that generate the answer; a prefill-only
    pass over given sequences is `max_new_tokens=1`. `dtype` ("float32", "bfloat16") overrides `data_engine_options`.
    `sampling` (without hidden states): `vllm.SamplingParams` fields instead of greedy decoding, e.g.
    {"temperature": 1.0, "top_p": 0.95, "stop_token_ids": [2]} (answers keep the stop id they end with)."""
    options = {"max_num_seqs": max_num_seqs, **({"dtype": dtype} if dtype else {})}
    if aux_layer_ids is not None:
        if sampling:
            raise ValueError("hidden states come with greedy answers only: leave out sampling")
        with HiddenStatesServer(target, aux_layer_ids, options) as engine:
            t = time.perf_counter()
            samples = engine.answer(prompts, max_new_tokens)
            seconds = time.perf_counter() - t
        output_ids = [s["input_ids"][len(p) :].tolist() for s, p in zip(samples, prompts)]
        return BatchRun(installed_version(), engine.init_seconds, seconds, output_ids, samples)
    reason = missing()
    if reason:
        raise VllmError(reason)
    request = {
        "target": target,
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "engine_options": options,
        "sampling": sampling or {"temperature": 0.0},
    }
    with tempfile.TemporaryDirectory() as tmp:
        result = run_child(BATCH_CHILD, request, Path(tmp))
    return BatchRun(result["version"], result["init_seconds"], result["generate_seconds"], result["output_ids"], None)


def data_engine_options() -> dict:
    """How vLLM runs when it makes data: in the data engines' dtype (`eagle_train.bf16.data_engine_dtype`: bf16
    where the machine multiplies it fast, elsewhere fp32, exact against HF in fp32); `dtype` in the engine options
    overrides it. Eager on a CPU; no prefix caching (a shared block's captured states are untested)."""
    from eagle_train.bf16 import data_engine_dtype

    return {
        "dtype": data_engine_dtype(),
        "enforce_eager": not torch.cuda.is_available(),
        "enable_prefix_caching": False,
        "seed": 0,
    }


def final_norm(model):
    """The model's final norm, from each worker (`LLM.apply_model` pickles the function to them under TP/PP)."""
    return model.model.norm


class HiddenStatesEngine:
    """One vLLM engine that answers greedily and keeps, for every token it runs (prompt and answer), the inputs
    of the aux layers and the last layer's output (id = num_hidden_layers, before the final norm; the engine's
    own norm is applied here): this project's convention (`target_hidden_states`). Runs in a child process.

    `engine_options` pass through to `vllm.LLM` (dtype, tensor_parallel_size, pipeline_parallel_size,
    max_num_seqs, gpu_memory_utilization, ...)."""

    def __init__(self, target: str, aux_layer_ids, directory: Path, **engine_options):
        from vllm import LLM

        from eagle_train.target import resolve_target

        self.aux = list(aux_layer_ids)
        self.n_layers = load_target_config(target).num_hidden_layers
        self.captured = sorted({*self.aux, self.n_layers})  # vLLM keeps the layers in ascending order, each once
        self.directory = directory
        module, connector = HIDDEN_STATES_CONNECTOR
        options = {**data_engine_options(), **engine_options}
        self.llm = LLM(
            model=resolve_target(target),
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {VLLM_KEY: self.captured}},
            },
            kv_transfer_config={
                "kv_connector": connector,
                "kv_connector_module_path": module,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(directory)},
            },
            **options,
        )
        self.norm = self.llm.apply_model(final_norm)[-1]  # the last pipeline stage's (each worker's under TP)

    def answer(self, prompts: list[list[int]], max_new_tokens: int, stop_ids=None) -> list[dict]:
        """Per prompt `input_ids` [T] (prompt + answer, up to and with a stop id), `aux_hidden` [T - 1, 3H] and
        `final_hidden` [T - 1, H] in float32: the last token is sampled, never run, so it has none."""
        from safetensors.torch import load_file
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_new_tokens,
            stop_token_ids=sorted(stop_ids) if stop_ids else None,
            extra_args={"kv_transfer_params": {"include_output_tokens": True}},
        )
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        files = [Path(o.kv_transfer_params["hidden_states_path"]) for o in outputs]
        for _ in range(1000):  # an offline engine steps only when asked: the last requests' files are written then
            if all(f.is_file() for f in files):
                break
            self.llm.llm_engine.step()
        else:
            raise VllmError(f"vLLM wrote {sum(f.is_file() for f in files)} of {len(files)} hidden-state files")
        samples = []
        for i, (o, f) in enumerate(zip(outputs, files)):
            written = load_file(f)
            f.unlink()
            ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            if written["token_ids"].tolist() != ids[:-1]:
                raise VllmError(f"the hidden-state file of prompt {i} holds other tokens than its prompt + answer")
            hidden = written["hidden_states"]
            with torch.no_grad():
                final = self.norm(hidden[:, self.captured.index(self.n_layers)].contiguous())
            samples.append(
                {
                    "input_ids": torch.tensor(ids, dtype=torch.int64),
                    "aux_hidden": torch.cat([hidden[:, self.captured.index(a)] for a in self.aux], dim=-1),
                    "final_hidden": final.float(),
                }
            )
        return samples


def serve_batch(request_path, result_path) -> None:
    """The child of `generate_batch` without hidden states (`BATCH_CHILD`): plain answers, greedy unless the request
    samples, written to `result_path`."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_train.target import resolve_target

    request = json.loads(Path(request_path).read_text())
    t0 = time.perf_counter()
    llm = LLM(model=resolve_target(request["target"]), **{**data_engine_options(), **request["engine_options"]})
    init_seconds = time.perf_counter() - t0
    t = time.perf_counter()
    params = SamplingParams(max_tokens=request["max_new_tokens"], **request["sampling"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    output_ids = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    result = {
        "version": vllm.__version__,
        "init_seconds": init_seconds,
        "generate_seconds": time.perf_counter() - t,
        "output_ids": output_ids,
    }
    Path(result_path).write_text(json.dumps(result))
    exit_child(llm)


class HiddenStatesServer:
    """A `HiddenStatesEngine` in a child process that stays up between batches, so a caller that plans its
    batches as it goes (multi-turn answers, shards) pays vLLM's start once. `answer` returns what the engine's
    `answer` does (float32, read from the files the child writes). `engine_options` go to `vllm.LLM`, but
    `cpu_kv_cache_gib`, which sizes the KV cache on a CPU (default: $VLLM_CPU_KVCACHE_SPACE, else
    `DISTIL_CPU_KV_CACHE_GIB`).

        with HiddenStatesServer("smollm2-135m", (2, 15, 27)) as engine:
            samples = engine.answer(prompts, max_new_tokens=192, stop_ids={2})
    """

    def __init__(self, target: str, aux_layer_ids, engine_options: dict | None = None):
        reason = missing()
        if reason:
            raise VllmError(reason)
        engine_options = dict(engine_options or {})
        cache_gib = engine_options.pop("cpu_kv_cache_gib", None)
        cache_gib = cache_gib or os.environ.get("VLLM_CPU_KVCACHE_SPACE", DISTIL_CPU_KV_CACHE_GIB)
        self.files = tempfile.TemporaryDirectory()  # where the child writes the samples
        request = {
            "target": target,
            "aux_layer_ids": list(aux_layer_ids),
            "engine_options": engine_options,
            "directory": self.files.name,
        }
        try:
            self.server = ChildServer(
                HIDDEN_STATES_CHILD, request, {**child_env(), "VLLM_CPU_KVCACHE_SPACE": str(cache_gib)}
            )
        except VllmError:
            self.files.cleanup()
            raise
        self.init_seconds = self.server.started["init_seconds"]

    def answer(self, prompts: list[list[int]], max_new_tokens: int, stop_ids=None) -> list[dict]:
        from safetensors.torch import load_file

        reply = self.server.ask(
            {"prompts": prompts, "max_new_tokens": max_new_tokens, "stop_ids": sorted(stop_ids or ())}
        )
        samples = []
        for name in reply["files"]:
            samples.append(load_file(name))
            Path(name).unlink()
        return samples

    def close(self) -> None:
        self.server.close()
        self.files.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve_hidden_states(request_path) -> None:
    """The child of `HiddenStatesServer`: start the engine, then answer one JSON request per stdin line, each
    sample in a safetensors file of its own, and name the files in one JSON line on stdout."""
    from safetensors.torch import save_file

    request = json.loads(Path(request_path).read_text())
    directory = Path(request["directory"])
    t0 = time.perf_counter()
    engine = HiddenStatesEngine(
        request["target"], request["aux_layer_ids"], directory / "requests", **request["engine_options"]
    )
    print(json.dumps({"init_seconds": time.perf_counter() - t0}), flush=True)
    for n, line in enumerate(sys.stdin):
        asked = json.loads(line)
        samples = engine.answer(asked["prompts"], asked["max_new_tokens"], asked["stop_ids"])
        files = []
        for i, sample in enumerate(samples):
            files.append(str(directory / f"answer-{n}-{i}.safetensors"))
            save_file(sample, files[-1])
        print(json.dumps({"files": files}), flush=True)
    exit_child(engine.llm)
