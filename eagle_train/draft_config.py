"""The draft head's configuration, derived from the target's Hugging Face config.

This is the toolkit's own config (what training checkpoints store, flat in a head's config.json); the
engine-facing config.json layouts are written by `eagle_train.export`. Its fields are the common ones below and
each method's own, which its folder's `config.py` declares and its row names (`Method.head_keys`): `DraftConfig`
composes them (`methods.with_method_keys`), so this module names none of them.
"""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from eagle_train import methods
from eagle_train.architectures import check_supported, text_config
from eagle_train.files import write_json
from eagle_train.hidden_states import default_aux_layer_ids
from eagle_train.layers import ROPE_TYPES
from eagle_train.vocab_map import DRAFT_VOCAB_SIZE, check_draft_vocab_size


def target_rope(cfg) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a target config of transformers 4.x (rope_theta/rope_scaling)
    or 5.x (rope_parameters, also per layer type). Scaling is None for plain RoPE."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (Gemma 3): the full-attention layers' RoPE
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(cfg, "rope_theta", 10000.0))
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return theta, scaling


def head_rope(cfg) -> tuple[float, dict | None]:
    """The RoPE eagle-train gives a head of this target: the target's where `eagle_train.layers` implements
    its type, else plain RoPE at the target's base. The head's positions are its own (its attention reads
    only its own keys), and every export states them, so the engines rotate as the head was trained."""
    theta, scaling = target_rope(cfg)
    return theta, scaling if (scaling or {}).get("rope_type") in (None, *ROPE_TYPES) else None


HEAD_FORMAT = "eagle-train-draft"  # config.json's "format" in a head directory of ours (eagle_train.checkpoint)
# the fields below a head trained elsewhere may set; an export layout states them or refuses the head
VARIANTS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output", "qk_norm", "sliding_window")


@dataclass
class CommonDraftConfig:
    """The keys every head has and what a head's config does (size itself for a target, check it fits one, save);
    `DraftConfig` adds each method's own."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, ...]  # three for the heads trained here; a z-lab DFlash head may read more
    num_hidden_layers: int = 1
    method: str = "eagle3"  # a row of eagle_train.methods.METHODS: its head class, family and training
    target: str = ""  # name or path the head was built for
    target_architectures: list[str] = field(default_factory=list)
    mask_token_id: int | None = None  # P-EAGLE, DFlash, DSpark
    # EAGLE-3 and P-EAGLE variants heads trained elsewhere carry (speculators' flags; eagle-train trains none of them)
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`) over the concatenated aux states before fc
    fc_norm: bool = False  # an RMSNorm per aux layer (`fc_norm.{i}`) before fc
    norm_before_residual: bool = False  # the fused layer's residual is hidden_norm(hidden), not hidden
    norm_output: bool = False  # the layer's output passes the final norm before it is fed back and read by lm_head
    qk_norm: bool = False  # Qwen3 attention: each head's query and key pass an RMSNorm (q_norm, k_norm)
    sliding_window: int | None = None  # the layer attends to the last sliding_window positions only

    def __post_init__(self):
        self.aux_layer_ids = tuple(self.aux_layer_ids)
        check_draft_vocab_size(self.draft_vocab_size, self.vocab_size)

    @classmethod
    def from_target_config(
        cls,
        cfg,
        *,
        draft_vocab_size: int = DRAFT_VOCAB_SIZE,
        aux_layer_ids=None,
        num_hidden_layers: int = 1,
        method: str = "eagle3",
        target: str = "",
        **extra,
    ):
        """A Llama decoder layer sized like one layer of the target (a type `eagle_train.architectures` trains),
        whatever the target's own layers are: the engines build every EAGLE-3 head as a Llama layer. Its RoPE
        is `head_rope`'s."""
        cfg = text_config(cfg)
        check_supported(cfg, "training")
        n = cfg.num_hidden_layers
        theta, scaling = head_rope(cfg)
        eps = next(
            (getattr(cfg, k) for k in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon") if hasattr(cfg, k)), None
        )
        return cls(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            intermediate_size=getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=eps or 1e-6,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.max_position_embeddings,
            target_hidden_size=cfg.hidden_size,
            target_num_layers=n,
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(n),
            num_hidden_layers=num_hidden_layers,
            method=method,
            target=target,
            target_architectures=list(getattr(cfg, "architectures", None) or []),
            **extra,
        )

    @property
    def num_aux(self) -> int:
        """How many target layers the head reads (fc's input is that many times the target's hidden size)."""
        return len(self.aux_layer_ids)

    def variants(self) -> list[str]:
        """The VARIANTS this head has set."""
        return [name for name in VARIANTS if getattr(self, name)]

    def fit_problems(self, target_config) -> list[str]:
        """What keeps this head from reading `target_config`'s hidden states and vocabulary (none: it fits)."""
        cfg = text_config(target_config)
        n = cfg.num_hidden_layers
        problems = []
        if self.vocab_size != cfg.vocab_size:
            problems.append(f"vocabulary {self.vocab_size} != target's {cfg.vocab_size}")
        if self.target_hidden_size != cfg.hidden_size:
            problems.append(f"hidden size {self.target_hidden_size} != target's {cfg.hidden_size}")
        if any(not 0 <= i < n for i in self.aux_layer_ids):
            problems.append(f"aux layer ids {list(self.aux_layer_ids)} do not exist in a {n}-layer target")
        elif self.target_num_layers != n:
            problems.append(f"trained on a {self.target_num_layers}-layer target, this one has {n}")
        return problems

    def check_fits(self, target_config) -> None:
        """Refuse, in one line and before any compute, a head built for another target."""
        problems = self.fit_problems(target_config)
        if problems:
            built = f" (built for {self.target!r})" if self.target else ""
            raise ValueError(
                f"the draft head does not fit this target{built}: {'; '.join(problems)}. "
                "Use the target the head was built for, or train a head for this target."
            )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names - {"format"}
        if unknown:
            raise ValueError(f"unknown draft config keys {sorted(unknown)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def save(self, directory) -> None:
        write_json(Path(directory) / "config.json", {"format": HEAD_FORMAT, **self.to_dict()})


DraftConfig = methods.with_method_keys("DraftConfig", CommonDraftConfig, lambda method: method.head_keys)
