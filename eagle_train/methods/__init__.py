"""The methods: one row per method, read by every stage instead of testing a method's name.

`eagle_train.trainer.train(cfg, build_head, objective)` is the loop every method shares; a row names what
differs: the head builder, the objective built from the `TrainConfig` alone, its own keys (its folder's `config.py`:
the keys it adds to `TrainConfig` and to a head's `DraftConfig`, which `with_method_keys` composes with the common
ones) and their checks (after `train_config.validate`'s common ones); and, for the stages after training, its title,
its drafting family (`FAMILIES`: each names the runtime's drafter of its heads), how many drafts one forward gives by
default, and its names outside: its export layouts, llama.cpp's spec type, vLLM's speculative method, speculators'
model type. No code outside `eagle_train/methods/` tests a method's name or names a method's key: it reads the row.
A new method is a new row (and its folder).
"""

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass


def imported(ref: str | None):
    """`module:name`, imported when asked for (None for a row's field left None): this module imports none of the
    methods' modules (they, the head loader, the export and the runtime all read the rows)."""
    if ref is None:
        return None
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Family:
    """How a head drafts, which decides the runtime's drafter and the engines' speculative method."""

    description: str
    drafter_at: str  # "module:Class" of the runtime: (head, TreeShape, Sampler, graphed) -> its drafter
    noun: str = "head"  # what tables and verdicts call one of its drafters

    @property
    def drafter(self):
        return imported(self.drafter_at)


FAMILIES = {
    "chain": Family("K sequential draft steps a round, or a tree", "inference.drafting:Drafter"),
    "parallel": Family("all K drafts from one forward", "inference.parallel_drafting:ParallelDrafter"),
    "block": Family(
        "a block of drafts from one forward, the target's layers as keys and values",
        "inference.block_drafting:BlockDrafter",
    ),
    "model": Family(
        "K sequential steps of a standalone causal LM over its own cache, the tokens alone",
        "inference.model_drafting:ModelDrafter",
        noun="draft model",
    ),
}


@dataclass(frozen=True)
class Method:
    title: str  # as tables and messages name it
    family: str  # one of FAMILIES
    head_at: str  # "module:Class", the head (a DraftHead)
    build_head_at: str  # "module:function": (cfg, target_model, vocab_map) -> head
    objective_at: str  # (cfg) -> objective(model, batch, backward) -> metrics
    # (cfg, target_config) -> None, raising ValueError naming the fix: its keys' checks (its config.py) and any other
    # before compute
    check_at: str | None = None
    drafts_at: str | None = None  # (DraftConfig) -> drafts one forward gives; None: the user's K
    train_keys_at: str | None = None  # "module:Class", its own TrainConfig keys (a kw_only dataclass)
    head_keys_at: str | None = None  # "module:Class", its own DraftConfig keys (a kw_only dataclass)
    # (cfg) -> whether a new head drafts over the target's whole vocabulary (the data's t2d), not the vocab map's
    # draft vocabulary (d2t); None: never
    whole_vocabulary_at: str | None = None
    layouts: tuple[str, ...] = ()  # the export layouts (eagle_train.export.layouts.LAYOUTS) that can hold its heads
    # its names outside, each None where that engine or library has no form of it
    gguf_spec_type: str | None = None  # llama.cpp's --spec-type for its heads; None: eagle-export --format gguf refuses
    vllm_method: str | None = None  # vLLM's speculative_config["method"] for its heads
    speculators_type: str | None = None  # speculators' speculators_model_type (and algorithm) for its heads
    head_options: tuple[str, ...] = ()  # the options of its head class it switches on (DSpark: BlockHead's)
    summary: str = ""  # one line for --help

    @property
    def layout(self) -> str | None:
        """Its own layout, the first of `layouts`: what its heads are exported in where no layout is asked for."""
        return self.layouts[0] if self.layouts else None

    @property
    def head_class(self):
        return imported(self.head_at)

    @property
    def drafts(self) -> Callable | None:
        return imported(self.drafts_at)

    @property
    def build_head(self) -> Callable:
        return imported(self.build_head_at)

    @property
    def objective(self) -> Callable:
        return imported(self.objective_at)

    @property
    def check(self) -> Callable | None:
        return imported(self.check_at)

    @property
    def train_keys(self) -> type | None:
        return imported(self.train_keys_at)

    @property
    def head_keys(self) -> type | None:
        return imported(self.head_keys_at)

    @property
    def whole_vocabulary(self) -> Callable | None:
        return imported(self.whole_vocabulary_at)


DFLASH = Method(
    "DFlash",
    "block",
    "eagle_train.methods.block.head:BlockHead",
    "eagle_train.methods.block.train:build_block_head",
    "eagle_train.methods.block.train:block_objective",
    "eagle_train.methods.block.config:validate_block",
    "eagle_train.methods.block.head:num_drafts",
    train_keys_at="eagle_train.methods.block.config:TrainKeys",
    head_keys_at="eagle_train.methods.block.config:HeadKeys",
    whole_vocabulary_at="eagle_train.methods.block.config:whole_vocabulary",
    layouts=("dflash", "speculators"),
    gguf_spec_type="draft-dflash",
    vllm_method="dflash",
    speculators_type="dflash",
    summary="DFlash: a block of block_size - 1 drafts in one forward, the target's layers as keys and values",
)

METHODS = {
    "eagle3": Method(
        "EAGLE-3",
        "chain",
        "eagle_train.methods.eagle3.head:Eagle3Head",
        "eagle_train.methods.eagle3.train:build_eagle3_head",
        "eagle_train.methods.eagle3.train:eagle3_objective",
        "eagle_train.methods.eagle3.config:validate_eagle3",
        train_keys_at="eagle_train.methods.eagle3.config:TrainKeys",
        layouts=("eagle3", "speculators"),
        gguf_spec_type="draft-eagle3",
        vllm_method="eagle3",
        speculators_type="eagle3",
        summary="EAGLE-3: one fused decoder layer, trained with training-time test (ttt_length drafts unrolled)",
    ),
    "peagle": Method(
        "P-EAGLE",
        "parallel",
        "eagle_train.methods.peagle.head:PEagleHead",
        "eagle_train.methods.peagle.train:build_peagle_head",
        "eagle_train.methods.peagle.train:peagle_objective",
        "eagle_train.methods.peagle.config:validate_peagle",
        train_keys_at="eagle_train.methods.peagle.config:TrainKeys",
        head_keys_at="eagle_train.methods.peagle.config:HeadKeys",
        layouts=("peagle", "speculators"),
        vllm_method="eagle3",  # with parallel_drafting, which its family asks for
        speculators_type="peagle",
        summary="P-EAGLE: all num_depths drafts in one forward pass, trained with sequence partitioning",
    ),
    "dflash": DFLASH,
    "dspark": dataclasses.replace(  # DFlash's head and training, its options (Markov bias, anchor slot) switched on
        DFLASH,
        title="DSpark",
        layouts=("dspark", "speculators"),
        gguf_spec_type="draft-dspark",
        vllm_method="dspark",
        speculators_type="dspark",
        head_options=("sample_from_anchor", "markov_rank"),  # markov_rank: the config's, MARKOV_RANK when unset
        summary="DSpark: DFlash drafting from the anchor's slot too, with a Markov logit bias and a confidence head",
    ),
    "draft_model": Method(
        "draft model",
        "model",
        "eagle_train.methods.draft_model.model:DraftModel",
        "eagle_train.methods.draft_model.train:build_draft_model",
        "eagle_train.methods.draft_model.train:draft_model_objective",
        "eagle_train.methods.draft_model.train:check_draft_model",
        train_keys_at="eagle_train.methods.draft_model.config:TrainKeys",
        head_keys_at="eagle_train.methods.draft_model.config:HeadKeys",
        layouts=("draft_model",),
        gguf_spec_type="draft-simple",
        vllm_method="draft_model",
        summary="draft model: the target's architecture with a few of its layers, distilled on its answers",
    ),
}


def family_of(method) -> str | None:
    """The drafting family of a method named anywhere (a config, a file's own key); None for any other name."""
    return METHODS[method].family if method in METHODS else None


def row(method: str) -> Method:
    """The row of a method named in a config or an export; ValueError naming the methods there are."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")
    return METHODS[method]


def method_with(**fields) -> str | None:
    """The first method whose row has these values (`layout="dflash"`, `speculators_type="peagle"`): the method of
    a file that names its layout or another's name for it, not ours; None when no row has them."""
    return next((name for name, m in METHODS.items() if all(getattr(m, k) == v for k, v in fields.items())), None)


def noun_of(method: str | None) -> str:
    """What a drafter of `method` is called (its family's noun; "head" for a name no row has)."""
    family = family_of(method)
    return FAMILIES[family].noun if family else "head"


def method_of(cfg) -> Method:
    """The row of `cfg.method`."""
    return row(cfg.method)


def objective_for(cfg):
    """The objective of `cfg.method`, every setting from `cfg`: the one way a config becomes an objective."""
    return method_of(cfg).objective(cfg)


def check_method(cfg, target_config) -> None:
    """The checks of `cfg.method`'s own keys; run after `train_config.validate`, whose common checks they rely on."""
    check = method_of(cfg).check
    if check is not None:
        check(cfg, target_config)


def key_classes(keys_of: Callable[[Method], type | None]) -> dict[type, list[str]]:
    """Each key class the rows name through `keys_of` (`lambda method: method.train_keys`), with the methods whose
    rows name it, in row order: DFlash's and DSpark's rows name one."""
    found = {}
    for name, method in METHODS.items():
        keys = keys_of(method)
        if keys is not None:
            found.setdefault(keys, []).append(name)
    return found


def with_method_keys(name: str, common: type, keys_of: Callable[[Method], type | None]) -> type:
    """The dataclass `name`: the fields of `common` (the keys every method has) and of each key class the rows name
    through `keys_of`, one flat set, so a run's YAML and a head's config.json stay one mapping and `cfg.num_depths`
    reads as any key. The key classes are keyword-only, so `common`'s required fields stay first. A key defined twice
    (by two rows' classes, or by one and `common`) is refused here, at import, in one line naming both."""
    defined = {f.name: f"{common.__module__}:{common.__qualname__}" for f in dataclasses.fields(common)}
    owners = key_classes(keys_of)
    for keys, names in owners.items():
        where = f"{keys.__module__}:{keys.__qualname__} ({', '.join(names)})"
        for f in dataclasses.fields(keys):
            if f.name in defined:
                raise TypeError(f"config key {f.name!r} is defined twice: by {defined[f.name]} and by {where}")
            defined[f.name] = where
    # the fields come in reverse method resolution order: `common`'s first, then each row's in row order
    bases = (*reversed(owners), common)
    return dataclass(type(name, bases, {"__module__": common.__module__, "__qualname__": name}))
