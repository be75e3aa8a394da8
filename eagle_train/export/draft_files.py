"""Reading an exported directory without loading its weights: config.json, and each tensor's name,
shape and dtype, the tensors themselves only on request (read_export reads them all, the engines'
rule checks only d2t)."""

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle_train.unreadable import HEAD_FIX, check_safetensors, read_json_object

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
}


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index, "head weights index", HEAD_FIX).get("weight_map", {})
        return sorted({directory / f for f in weight_map.values()})
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).exists():
            return [directory / name]
    raise FileNotFoundError(
        f"{directory} holds no model.safetensors (nor model.safetensors.index.json or pytorch_model.bin)"
    )


class DraftFiles:
    """config.json and the weights' names, shapes and dtypes; tensors are read only on request."""

    def __init__(self, directory):
        self.directory = Path(directory)
        path = self.directory / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{self.directory} has no config.json")
        self.config = read_json_object(path, "head config", HEAD_FIX)
        self.meta: dict[str, tuple[tuple, torch.dtype, Path]] = {}
        self._bin: dict[str, torch.Tensor] = {}
        for f in weight_files(self.directory):
            if f.suffix == ".bin":
                self._bin.update(torch.load(f, map_location="cpu", weights_only=True))
                self.meta.update({k: (tuple(v.shape), v.dtype, f) for k, v in self._bin.items()})
                continue
            check_safetensors(f, "head weights", HEAD_FIX)
            with safe_open(f, "pt") as handle:
                for k in handle.keys():
                    s = handle.get_slice(k)
                    self.meta[k] = (tuple(s.get_shape()), SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype()), f)

    def tensor(self, name: str) -> torch.Tensor:
        if name in self._bin:
            return self._bin[name]
        with safe_open(self.meta[name][2], "pt") as handle:
            return handle.get_tensor(name)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = dict(self._bin)
        for f in {m[2] for m in self.meta.values() if m[2].suffix != ".bin"}:
            out.update(load_file(f))
        return out
