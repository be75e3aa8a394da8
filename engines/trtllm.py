"""TensorRT-LLM: what its EAGLE-3 loader does to an export directory (checked by rule only; it does not
run here).

tensorrt_llm/_torch/models/modeling_speculative.py Eagle3ForCausalLM: the eagle3 layout only, layers
renamed to midlayer, d2t kept as int32 (and only for a reduced vocabulary), aux layers from its own
eagle3_layers_to_capture option, never config.json.
"""

import re

from engines.engine import Engine
from engines.rules import LLAMA_EAGLE3_TOP


class TensorRTLLM(Engine):
    name = "trtllm"
    title = "TensorRT-LLM"
    layouts = ("eagle3", "draft_model")
    top = {**LLAMA_EAGLE3_TOP, "d2t": "model.d2t"}
    d2t_only_when_reduced = True
    without_d2t = "an uninitialised int32 buffer"

    def rename(self, tensor: str, n_layers: int, params: set) -> str | None:
        """Eagle3ForCausalLM.load_weights (t2d has no module to load into)."""
        if tensor == "t2d":
            return None
        if n_layers == 1:
            tensor = re.sub(r"^layers\.0\.", "midlayer.", tensor)
        else:
            tensor = re.sub(r"^layers\.(\d+)\.", r"midlayer.\1.", tensor)
        return tensor if "lm_head" in tensor else "model." + tensor

    def layer_prefix(self, i: int, n: int) -> str:
        return "model.midlayer." if n == 1 else f"model.midlayer.{i}."

    def aux_fix(self, intended: tuple[int, ...]) -> str:
        return (
            "pass speculative_config eagle3_layers_to_capture: "
            f"{sorted(i - 1 for i in intended)} (TensorRT-LLM does not read config.json for this)"
        )

    def config_keys_read(self, config: dict) -> set:
        return {"eagle_config"}

    def short_context_effect(self, draft_context: int) -> str:
        return "TensorRT-LLM sizes the draft's RoPE table for it"
