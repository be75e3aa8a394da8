"""The draft model: a transformers causal LM of the target's architecture with fewer layers, under the interface the
trainer, the loader and the runtime read of every head (`config`, the vocab map `d2t`/`t2d`, `saved_state_dict`).

It needs no target states: it reads the tokens alone, over the whole vocabulary (`d2t` is zero: a draft id is its
target id). Its weights are the causal LM's own, under `lm.` (`lm.model.layers.0.self_attn.q_proj.weight`), so an HF
model directory is its state without the prefix. Built from the target (`from_target`), its embedding, the chosen
decoder layers, the final norm and the lm_head are copies of the target's, tied as the target ties them.
"""

import torch
from torch import nn

from eagle_train.architectures import config_from_dict, text_config
from eagle_train.draft_config import DraftConfig
from eagle_train.export.layouts import DRAFT_MODEL_PREFIX
from eagle_train.head import DraftHead
from eagle_train.hidden_states import TargetLogits
from eagle_train.target import read_target_weights


def fewer_layers(target_config, layers: list[int]):
    """The target's text config for a stack of its decoder layers `layers` (in that order): the layer count and each
    per-layer list (`layer_types`) follow them."""
    cfg = config_from_dict(text_config(target_config).to_dict())
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    cfg.use_cache = True
    return cfg


class DraftModel(nn.Module):
    owns_embedding = True  # saved with the model, never the target's
    embedding_attached = True
    borrows_lm_head = False

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        from transformers import AutoModelForCausalLM

        if not cfg.model_config:
            raise ValueError("a draft_model config must carry the draft's transformers config (model_config)")
        self.config = cfg
        self.lm = AutoModelForCausalLM.from_config(
            config_from_dict(cfg.model_config), attn_implementation="sdpa", dtype=torch.float32
        )
        self.register_buffer("d2t", torch.zeros(cfg.vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    @classmethod
    def from_target(cls, target_config, layers: list[int], target: str = "", weights_from: str | None = None):
        """A draft of the target's decoder layers `layers`; with `weights_from` (the target's name or path) its
        embedding, those layers, final norm and lm_head are read from the target's files, else it starts at random
        (transformers' own initialisation)."""
        model_config = fewer_layers(target_config, layers)
        cfg = DraftConfig.from_target_config(
            target_config,
            draft_vocab_size=text_config(target_config).vocab_size,
            num_hidden_layers=len(layers),
            method="draft_model",
            target=target,
            model_config=model_config.to_dict(),
        )
        model = cls(cfg)
        cfg.model_config["architectures"] = [type(model.lm).__name__]  # what from_pretrained and the engines build
        if weights_from is not None:
            model.copy_target_layers(weights_from, layers)
        return model

    def copy_target_layers(self, target: str, layers: list[int]) -> None:
        """Set every weight to the target's: draft layer j is target layer layers[j]; the rest keep their names."""
        names = [name for name, _ in self.lm.named_parameters()]  # a tied lm_head is listed once, as the embedding

        def target_name(name: str) -> str:
            parts = name.split(".")
            if parts[:2] == ["model", "layers"]:
                parts[2] = str(layers[int(parts[2])])
            return ".".join(parts)

        def pick(target_model):
            params = dict(target_model.named_parameters())
            return [params[target_name(name)] for name in names]

        state = dict(zip(names, read_target_weights(target, pick)))
        with torch.no_grad():
            for name, param in self.lm.named_parameters():
                param.copy_(state[name].to(param.dtype))

    @property
    def tied(self) -> bool:
        return self.lm.get_output_embeddings().weight is self.lm.get_input_embeddings().weight

    def saved_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor but a tied lm_head (the embedding holds it)."""
        tied = f"{DRAFT_MODEL_PREFIX}lm_head.weight" if self.tied else None
        return {k: v for k, v in self.state_dict().items() if k != tied}

    save_pretrained = DraftHead.save_pretrained  # config.json and the saved tensors, as every head's

    def use_target_weights(self, target_model) -> None:
        """Nothing: a draft model holds all its weights."""

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final (post-norm) hidden states [B, T, H] of `input_ids` [B, T], each position reading those before."""
        return self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Its logits from its final hidden states, by its architecture's rule (scale, soft cap)."""
        return TargetLogits.of(self.lm)(hidden)
