"""A vLLM KV connector that writes each finished request's extracted hidden states to a safetensors file, on
any device, synchronously.

vLLM's `extract_hidden_states` speculative method keeps the requested layers' hidden states of every token it
runs in a cache-only KV layer; a KV connector takes them out when the request finishes. vLLM's own
(`ExampleHiddenStatesConnector`) copies them on a CUDA stream and records CUDA events, so on a CPU it never
writes, and its clients wait forever on the file's lock. This one keeps its scheduler side (which requests,
which blocks, which file, `include_output_tokens`) and replaces the worker side: gather the request's slots
from the cache, write `hidden_states` [tokens, layers, hidden] (the layers sorted by id, as vLLM captures
them) and `token_ids` to a temporary file, and rename it into place, so that a file that exists is whole.

vLLM imports a connector class by module path (`kv_connector_module_path`) in its worker process, and the
class must subclass vLLM's own at import time, so it lives in a module of its own that imports vLLM at the
top: engines/vllm_data.py, which must import without vLLM, names it by path.
"""

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)


class SafetensorsHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._written: set[str] = set()

    def wait_for_save(self) -> None:
        """No lock files: a file appears, by rename, only once it is whole."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Write the requests the scheduler finished (this step's metadata) and report them done, which frees
        their blocks."""
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
                for pending in metadata.pending_saves:
                    self._write(pending)
        done, self._written = self._written, set()
        return done or None, None

    def _write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        n = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).cpu().contiguous()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        partial = pending.filename + ".partial"
        save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, partial)
        os.replace(partial, pending.filename)
        self._written.add(pending.req_id)
