"""SGLang: what its EAGLE-3 loader does to an export directory (checked by rule only; it does not run here).

python/sglang/srt/models/llama_eagle3.py LlamaForCausalLMEagle3: the eagle3 layout only, q/k/v and
gate/up fused, d2t turned into target ids (hot_token_id), the draft's embedding always replaced by
the target's, aux layers from the nested eagle_config key plus one.
"""

import re

from engines.engine import Engine
from engines.rules import LLAMA_EAGLE3_TOP, stack


class SGLang(Engine):
    name = "sglang"
    title = "SGLang"
    layouts = ("eagle3", "draft_model")
    top = {**LLAMA_EAGLE3_TOP, "d2t": "hot_token_id"}
    without_d2t = "no hot-token map, so draft ids are used as target ids"
    float_d2t_effect = ", and SGLang indexes with floats"

    def rename(self, tensor: str, n_layers: int, params: set) -> str | None:
        """LlamaForCausalLMEagle3.load_weights: a name that is not a parameter (after trying a
        "model." prefix) is skipped without a word."""
        if "d2t" in tensor:
            return "hot_token_id"
        if "t2d" in tensor:
            return None
        fused, _ = stack(tensor)
        return tensor if fused in params else "model." + tensor

    def layer_prefix(self, i: int, n: int) -> str:
        return "model.midlayer." if i == 0 else f"model.additional_layers.{i - 1}."

    def engine_param(self, head_name: str, n_layers: int):
        m = re.match(r"^layers\.(\d+)\.input_layernorm", head_name)
        if m and int(m.group(1)) > 0:
            return None  # its extra layers normalise with hidden_norm and have no input_layernorm
        return super().engine_param(head_name, n_layers)

    def captured_aux(self, config: dict, n_layers: int | None) -> tuple[int, ...] | None:
        """The nested key only, each id + 1."""
        nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return tuple(i + 1 for i in nested) if nested else super().captured_aux(config, n_layers)

    def aux_fix(self, intended: tuple[int, ...]) -> str:
        return (
            'write "eagle_config": {"eagle_aux_hidden_state_layer_ids": '
            f"{[i - 1 for i in intended]}}} in config.json (SGLang adds one)"
        )

    def config_keys_read(self, config: dict) -> set:
        return {"eagle_config"}

    def no_draft_vocab_size(self, report, cfg) -> None:
        report.add(
            "error",
            "no draft_vocab_size: SGLang then fails to build the head or, with it null, loads "
            "the target's lm_head over the draft's (load_lm_head_from_target); write "
            "draft_vocab_size even when it equals vocab_size",
        )

    def file_embedding_replaced(self, report, parallel: bool) -> None:
        report.add(
            "error" if parallel else "info",
            "SGLang replaces the draft's embed_tokens with the "
            "target's (set_embed)" + (": the trained mask-token row is lost" if parallel else ""),
        )

    def short_context_effect(self, draft_context: int) -> str:
        return (
            "SGLang refuses the longer context unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, "
            "then indexes past the draft's RoPE cache"
        )
