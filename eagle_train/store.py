"""The on-disk sample formats (docs/design.md section 8): hidden-state stores and tokenized datasets.

Both are directories of a few large safetensors shards, each holding many samples concatenated
along the token axis, plus a `manifest.json` and a `vocab_map.safetensors`:

- `input_ids` int32 [T], `loss_mask` bool [T], `sample_offsets` int64 [n+1], `sample_ids` int64 [n]
  (the sample's index in the tokenized dataset it came from; lets a capture resume and lets a user
  trace a sample back);
- hidden-state stores add `aux_hidden` [T, 3H] and `final_hidden` [T, H] in bfloat16, float32 or
  float8_e4m3fn; fp8 adds `aux_scale` float32 [T, 3] (one absmax scale per token and aux layer,
  because low and high layers differ by orders of magnitude) and `final_scale` float32 [T, 1].

Shards are named `shard-NNNNN.safetensors` by a global shard index. Several capture processes
take a rank-strided share of the indices (rank r writes k with k % world_size == r), so their
files never clash and the store looks the same whatever the process count. Every shard is written
to a temp name and renamed, so a killed run leaves only whole shards behind.

Nothing wrong gets through silently. Each shard's sha256, taken from the bytes as they are
written (`written_sha256`), goes beside it (`shard-NNNNN.sha256`, what `sha256sum -c` reads) and into the manifest;
a reader checks a shard the first time it opens it, and a rerun of the capture recomputes a
damaged shard. Hidden states that are not finite are refused when captured and when read. The
manifest records a fingerprint of the target's weights, so a store is never trained against
another model of the same shape.
"""

import bisect
import hashlib
import json
import os
import queue
import re
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from eagle_train.files import write_json, write_safetensors, write_text
from eagle_train.hidden_states import default_aux_layer_ids
from eagle_train.unreadable import read_json_object, unreadable

HIDDEN_FORMAT = "eagle-hidden-states"
TOKENIZED_FORMAT = "eagle-tokenized"
VERSION = 1
MANIFEST = "manifest.json"
VOCAB_MAP = "vocab_map.safetensors"
SHARD_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
RECAPTURE = "rerun the eagle-prep command that made the store: it recomputes missing and damaged shards only"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def chat_template_fingerprint(template: str | None) -> str:
    """Short hash of the chat template text: a store made with another template is another store."""
    return hashlib.sha256((template or "").encode()).hexdigest()[:16]


def target_identity(config) -> dict:
    """What a store records about the target that made it."""
    return {
        "name": _target_name(getattr(config, "_name_or_path", "") or ""),
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
    }


def fingerprinted_weights(model) -> list[torch.Tensor]:
    """The weights a store's fingerprint samples: the input embedding, the lm_head (when not tied to it) and the
    final norm. Two checkpoints of one architecture differ there unless they hold the same weights (a fine-tune
    that froze all three is the blind spot)."""
    weights = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
    norm = getattr(getattr(model, "model", None), "norm", None)
    weights += [norm.weight] if getattr(norm, "weight", None) is not None else []
    return [w for k, w in enumerate(weights) if not any(w is other for other in weights[:k])]


def fingerprint(weights: list[torch.Tensor], values: int = 4096) -> str:
    """A short hash of evenly spaced values of each weight, rounded to bfloat16 first, so that it is the same
    whichever dtype (fp32 or bf16) and device the weights were loaded in, or read from the checkpoint's files."""
    digest = hashlib.sha256()
    for w in weights:
        flat = w.detach().flatten()
        n = min(values, flat.numel())
        picks = (torch.arange(n) * (flat.numel() - 1) // max(n - 1, 1)).to(flat.device)
        digest.update(flat[picks].to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def target_fingerprint(model) -> str:
    """The fingerprint of a loaded target (`fingerprinted_weights`); `target.files_fingerprint` reads the same
    from its files without loading it."""
    return fingerprint(fingerprinted_weights(model))


def _target_name(name_or_path: str) -> str:
    """A location-independent name: the hub id's or directory's last part, without our cache's key
    (`target.gguf_content_key`: the content hash, then the converter and its revision)."""
    name = Path(str(name_or_path).rstrip("/")).name
    return re.sub(r"-[0-9a-f]{12}(-tf\d+(-r\d+)?)?$", "", name)


# --------------------------------------------------------------------------------------- writing


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (and per-group of the last dim) absmax scaling to float8_e4m3fn."""
    t, d = x.shape
    g = x.float().view(t, groups, d // groups)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, d), scale.squeeze(-1)


def encode_hidden(aux: torch.Tensor, final: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """aux [T, 3H] and final [T, H] in the store's on-disk form (fp8 adds the per-token scales).

    Capture calls this on the target's device, so fp8 quantization runs on the GPU and only half
    the bytes cross to the host.
    """
    if dtype == "float8_e4m3fn":
        aux_q, aux_scale = quantize_fp8(aux, groups=3)
        final_q, final_scale = quantize_fp8(final, groups=1)
        return {"aux_hidden": aux_q, "aux_scale": aux_scale, "final_hidden": final_q, "final_scale": final_scale}
    return {"aux_hidden": aux.to(STORE_DTYPES[dtype]), "final_hidden": final.to(STORE_DTYPES[dtype])}


def encode_checked(aux: torch.Tensor, final: torch.Tensor, dtype: str, where: str) -> dict[str, torch.Tensor]:
    """`encode_hidden` of hidden states that `check_finite` accepts: how a writer puts what a target computed
    into a store."""
    check_finite({"aux_hidden": aux, "final_hidden": final}, where)
    return encode_hidden(aux, final, dtype)


def pack_shard(samples: list[dict], sample_ids: list[int], dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """Concatenate per-sample dicts (input_ids, loss_mask[, aux_hidden, final_hidden]) into shard tensors.

    Hidden states may come raw (encoded here) or already encoded by `encode_hidden` (fp8 with scales).
    """
    lengths = [len(s["input_ids"]) for s in samples]
    out = {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.bool),
        "sample_offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
        "sample_ids": torch.tensor(sample_ids, dtype=torch.int64),
    }
    if "aux_hidden" in samples[0]:
        keys = [k for k in ("aux_hidden", "aux_scale", "final_hidden", "final_scale") if k in samples[0]]
        hidden = {k: torch.cat([s[k] for s in samples]) for k in keys}
        if (dtype == "float8_e4m3fn") != ("aux_scale" in hidden) or hidden["aux_hidden"].dtype != STORE_DTYPES[dtype]:
            hidden = encode_hidden(hidden["aux_hidden"], hidden["final_hidden"], dtype)
        out.update(hidden)
    return {k: v.contiguous() for k, v in out.items()}


def checksum_path(shard: Path) -> Path:
    return shard.with_suffix(".sha256")


def write_shard(path: str | Path, index: int, tensors: dict[str, torch.Tensor], rank: int = 0) -> Path:
    """Write one shard atomically and its sha256 beside it; the writing process's rank goes in its metadata.
    A kill between the two leaves a shard without a sum, which `finalize_manifest` hashes."""
    shard = write_safetensors(Path(path) / shard_name(index), tensors, metadata={"rank": str(rank)})
    write_text(checksum_path(shard), f"{written_sha256(shard, tensors)}  {shard.name}\n")
    return shard


def written_sha256(shard: Path, tensors: dict[str, torch.Tensor]) -> str:
    """The sha256 of the file just written, without reading its data back: the header read from disk (a few
    KB), then the tensors' bytes from memory in the order the header lays them out, which is the file."""
    with open(shard, "rb") as f:
        size = f.read(8)
        header = f.read(int.from_bytes(size, "little"))
    digest = hashlib.sha256(size + header)
    layout = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
    for name in sorted(layout, key=lambda k: layout[k]["data_offsets"][0]):
        digest.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class StoreWriter:
    """Packs and writes shards on a background thread so the target's forwards never wait on disk.

    `max_pending` bounds how many packed-but-unwritten shards sit in memory. Errors on the thread
    are re-raised by the next `add_shard` or by `close`.
    """

    def __init__(self, path: str | Path, dtype: str = "bfloat16", rank: int = 0, max_pending: int = 2):
        if dtype not in STORE_DTYPES:
            raise ValueError(f"store dtype {dtype!r} not in {sorted(STORE_DTYPES)}")
        self.path, self.dtype, self.rank = Path(path), dtype, rank
        self.path.mkdir(parents=True, exist_ok=True)
        self.queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.error: BaseException | None = None
        self.written: list[Path] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while (job := self.queue.get()) is not None:
            index, samples, sample_ids = job
            try:
                if self.error is None:
                    tensors = pack_shard(samples, sample_ids, self.dtype)
                    self.written.append(write_shard(self.path, index, tensors, self.rank))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self.error = e

    def _raise(self):
        if self.error is not None:  # a full disk or a directory it may not write stays an OSError
            kind = OSError if isinstance(self.error, OSError) else RuntimeError
            raise kind(f"writing a shard to {self.path} failed: {self.error}") from self.error

    def add_shard(self, index: int, samples: list[dict], sample_ids: list[int]) -> None:
        """Queue shard `index` (blocks while `max_pending` shards wait)."""
        self._raise()
        self.queue.put((index, [{k: v.detach().cpu() for k, v in s.items()} for s in samples], list(sample_ids)))

    def close(self) -> None:
        """Finish every queued shard, then stop the thread."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        self._raise()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def list_shards(path: str | Path) -> list[tuple[int, str]]:
    """(index, file name) of the finished shards in a directory, by index."""
    found = [(int(m.group(1)), m.group(0)) for f in os.listdir(path) if (m := SHARD_RE.match(f))]
    return sorted(found)


def shard_sample_ids(path: str | Path) -> list[int]:
    with open_shard(path) as f:
        return f.get_tensor("sample_ids").tolist()


def open_shard(path: str | Path):
    """`safe_open`, with a damaged or truncated file named in one line."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise unreadable(path, "store shard", e, RECAPTURE) from None


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, read in blocks (shards can be larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 23):
            digest.update(block)
    return digest.hexdigest()


def recorded_sha256(shard: Path) -> str | None:
    """The checksum written beside `shard` when it was written (None for shards of older stores)."""
    file = checksum_path(shard)
    return file.read_text().split()[0] if file.is_file() else None


def shard_damage(shard: Path, sha256: str) -> str | None:
    """Why `shard` (which exists) is not the file whose checksum was recorded, or None when it is."""
    if file_sha256(shard) != sha256:
        return "its sha256 differs from the one recorded when it was written (its bytes changed since)"
    return None


def check_finite(hidden: dict[str, torch.Tensor], where: str) -> None:
    """Refuse hidden states holding inf or nan: a store hands training only what a target computed."""
    for name, x in hidden.items():
        finite = torch.isfinite(x.float() if x.dtype == torch.float8_e4m3fn else x)
        if not finite.all():
            bad = int((~finite).sum())
            raise ValueError(
                f"{where}: {bad} non-finite values (inf or nan) in {name}; a store must hold finite hidden states"
            )


def finalize_manifest(path: str | Path, header: dict) -> dict:
    """Write `manifest.json` listing every finished shard; `header` holds format, target, dtype...

    Counts come from the shards themselves, so the manifest is right whichever process wrote
    which shard. Shards are listed in index order; that is the store's sample order.
    """
    shards = []
    for _, name in list_shards(path):
        shard = Path(path) / name
        with open_shard(shard) as f:
            n = f.get_slice("sample_ids").get_shape()[0]
            t = f.get_slice("input_ids").get_shape()[0]
            rank = int((f.metadata() or {}).get("rank", 0))
        sha256 = recorded_sha256(shard) or file_sha256(shard)
        shards.append(
            {"file": name, "samples": n, "tokens": t, "rank": rank, "sha256": sha256, "bytes": shard.stat().st_size}
        )
    manifest = {
        **header,
        "version": VERSION,
        "complete": True,
        "num_samples": sum(s["samples"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "shard_naming": "shard-NNNNN by global index; process r of W writes the indices k % W == r",
        "shards": shards,
    }
    write_json(Path(path) / MANIFEST, manifest)
    return manifest


def write_vocab_map(
    path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor, fill: torch.Tensor | None = None
) -> None:
    """`fill`: the wider text's counts that ranked the data's ties (`vocab_map.top_k_vocab_map`), if any."""
    tensors = {
        "d2t": d2t.to(torch.int64).contiguous(),
        "t2d": t2d.to(torch.bool).contiguous(),
        "counts": counts.to(torch.int64).contiguous(),
    }
    if fill is not None:
        tensors["fill"] = fill.to(torch.int64).contiguous()
    write_safetensors(Path(path) / VOCAB_MAP, tensors)


def read_vocab_map(path: str | Path) -> dict[str, torch.Tensor]:
    """`d2t` int64 [Vd], `t2d` bool [V], `counts` int64 [V] and, where the map has one, `fill` int64 [V]
    from a store or tokenized dataset dir."""
    file = Path(path) / VOCAB_MAP if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no {VOCAB_MAP} in {path}; make one with `eagle-prep vocab`")
    remake = f"remake it with `eagle-prep vocab --data {file.parent}`"
    try:
        with safe_open(str(file), framework="pt") as f:
            vmap = {k: f.get_tensor(k) for k in ("d2t", "t2d", "counts")}
            if "fill" in f.keys():
                vmap["fill"] = f.get_tensor("fill")
    except (SafetensorError, OSError) as e:
        raise unreadable(file, "vocab map", e, remake) from None
    ids, t2d = vmap["d2t"] + torch.arange(len(vmap["d2t"])), vmap["t2d"]  # draft id k is target id k + d2t[k]
    consistent = (
        len(vmap["counts"]) == len(t2d) == len(vmap.get("fill", t2d))
        and bool((ids[1:] > ids[:-1]).all())
        and (len(ids) == 0 or 0 <= int(ids[0]) <= int(ids[-1]) < len(t2d))
        and int(t2d.sum()) == len(ids)
        and bool(t2d[ids].all())
    )
    if not consistent:
        raise ValueError(f"{file} is damaged (its d2t, t2d and counts disagree): {remake}")
    return vmap


# --------------------------------------------------------------------------------------- checking


def check_store_matches(
    manifest: dict, target_config, aux_layer_ids=None, weights_fingerprint: str | None = None
) -> None:
    """Raise ValueError when a store was captured from another target or another aux layer set.

    `aux_layer_ids=None` means the target's defaults. `weights_fingerprint` (`target_fingerprint` of the
    loaded target) is compared when both sides have one. Tokenized datasets carry no hidden states
    and only need the same vocabulary size.
    """
    want = target_identity(target_config)
    have = manifest.get("target", {})
    keys = ["model_type", "num_hidden_layers", "hidden_size", "vocab_size"]
    if manifest.get("format") == TOKENIZED_FORMAT:
        keys = ["vocab_size"]
    elif want["name"] and have.get("name"):
        keys = ["name", *keys]
    diff = [f"{k}: store {have.get(k)!r} vs target {want[k]!r}" for k in keys if have.get(k) != want[k]]
    if diff:
        raise ValueError(
            f"store made by target {have.get('name')!r} ({have.get('num_hidden_layers')} layers, hidden "
            f"{have.get('hidden_size')}, vocab {have.get('vocab_size')}) does not match target {want['name']!r} "
            f"({want['num_hidden_layers']} layers, hidden {want['hidden_size']}, vocab {want['vocab_size']}): "
            f"{'; '.join(diff)}. Capture a new store with this target (eagle-prep capture --target ...) "
            "or train with the target that made the store."
        )
    recorded = have.get("fingerprint")
    if manifest.get("format") == HIDDEN_FORMAT and weights_fingerprint and recorded and recorded != weights_fingerprint:
        loaded = getattr(target_config, "_name_or_path", "") or want["name"]
        raise ValueError(
            f"store made by target {have.get('given') or have.get('name')!r} (weights fingerprint {recorded}) "
            f"does not match the target loaded now, {loaded!r} (weights fingerprint {weights_fingerprint}): same "
            "architecture, other weights. Capture a new store with this target or train with the one that made it."
        )
    if manifest.get("format") == HIDDEN_FORMAT:
        ids = list(aux_layer_ids if aux_layer_ids is not None else default_aux_layer_ids(want["num_hidden_layers"]))
        if list(manifest.get("aux_layer_ids", [])) != ids:
            raise ValueError(
                f"store holds aux layers {manifest.get('aux_layer_ids')} but aux layers {ids} were asked for "
                f"(target {want['name']!r}): capture a new store with --aux-layers "
                f"{','.join(map(str, ids))} or use aux_layer_ids={manifest.get('aux_layer_ids')}"
            )


# --------------------------------------------------------------------------------------- reading


def parse_manifest(file: Path) -> dict:
    """The JSON of a manifest, finished or not; a damaged one is named in one line."""
    fix = (
        f"delete it and rerun the eagle-prep command that made {file.parent}, which keeps the shards that match "
        "their checksums"
    )
    return read_json_object(file, "store manifest", fix)


def read_manifest(path: str | Path) -> dict:
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a store or tokenized dataset: no {MANIFEST}")
    manifest = parse_manifest(file)
    if manifest.get("format") not in (HIDDEN_FORMAT, TOKENIZED_FORMAT):
        raise ValueError(f"{file}: unknown format {manifest.get('format')!r}")
    if not manifest.get("complete", False):
        raise ValueError(f"{path}: the capture that writes it has not finished; rerun it to resume")
    return manifest


class ShardedSamples:
    """Memory-mapped, random-access samples of a hidden-state store or a tokenized dataset.

    Each item is a dict of `input_ids` int64 [T] and `loss_mask` bool [T], plus `aux_hidden`
    [T, 3H] and `final_hidden` [T, H] in `dtype` for a hidden-state store. Only the sample's own
    byte range is read (safetensors slices over an mmap), so items cost what they hold.

    A shard is checked against the manifest's checksum when first opened (its one full read, which
    leaves it in the page cache for the reads that follow); `verified` lives in shared memory, so
    DataLoader workers, started anew each epoch, check each shard once per run, not once per epoch.
    """

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32):
        self.path, self.dtype = Path(path), dtype
        self.manifest = read_manifest(path)
        self.has_hidden = self.manifest["format"] == HIDDEN_FORMAT
        self.files = [self.path / s["file"] for s in self.manifest["shards"]]
        self.offsets = []
        for file, entry in zip(self.files, self.manifest["shards"]):
            if not file.is_file():
                raise FileNotFoundError(f"store shard {file} is missing: {RECAPTURE}")
            with open_shard(file) as f:
                offsets = f.get_tensor("sample_offsets").tolist()
            if len(offsets) != entry["samples"] + 1 or offsets[-1] != entry["tokens"] or offsets != sorted(offsets):
                raise ValueError(
                    f"store shard {file} is damaged (its sample offsets are not the manifest's): {RECAPTURE}"
                )
            self.offsets.append(offsets)
        self.verified = torch.zeros(len(self.files), dtype=torch.bool).share_memory_()
        self.starts = [0]
        for off in self.offsets:
            self.starts.append(self.starts[-1] + len(off) - 1)
        self._handles: dict[int, object] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.starts[-1]

    def lengths(self) -> list[int]:
        return [b - a for off in self.offsets for a, b in zip(off[:-1], off[1:])]

    def __getstate__(self):  # picklable for spawned DataLoader workers: open maps are not sent
        return {**self.__dict__, "_handles": {}}

    def _handle(self, k: int):
        if self._pid != os.getpid():  # forked into a DataLoader worker: open our own maps
            self._handles, self._pid = {}, os.getpid()
        if k not in self._handles:
            self._verify(k)
            self._handles[k] = open_shard(self.files[k])
        return self._handles[k]

    def _verify(self, k: int) -> None:
        entry = self.manifest["shards"][k]
        if not self.verified[k] and "sha256" in entry:  # stores written before checksums have none
            damage = shard_damage(self.files[k], entry["sha256"])
            if damage:
                raise ValueError(f"store shard {self.files[k]} is damaged: {damage}; {RECAPTURE}")
        self.verified[k] = True

    def _locate(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i %= len(self)
        k = bisect.bisect_right(self.starts, i) - 1
        j = i - self.starts[k]
        return k, self.offsets[k][j], self.offsets[k][j + 1]

    def tokens(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i's `input_ids` and `loss_mask` only (no hidden-state reads)."""
        k, a, b = self._locate(i)
        f = self._handle(k)
        return {
            "input_ids": f.get_slice("input_ids")[a:b].to(torch.int64),
            "loss_mask": f.get_slice("loss_mask")[a:b].to(torch.bool),
        }

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.tokens(i)
        if self.has_hidden:
            k, a, b = self._locate(i)
            f = self._handle(k)
            for name in ("aux_hidden", "final_hidden"):
                x = f.get_slice(name)[a:b]
                if x.dtype == torch.float8_e4m3fn:
                    scale = f.get_slice(name.replace("hidden", "scale"))[a:b]
                    t, d = x.shape
                    x = (x.float().view(t, scale.shape[1], -1) * scale.unsqueeze(-1)).view(t, d)
                item[name] = x.to(self.dtype)
            where = f"store shard {self.files[k]}, sample {i} of the store"
            check_finite({name: item[name] for name in ("aux_hidden", "final_hidden")}, where)
        return item
