"""Where bf16 pays: the one rule that training's `mixed_precision: auto` and the data engines' dtype share."""

from pathlib import Path

import torch


def cpu_multiplies_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bf16 dot-product instructions (x86 AVX512-BF16 or AMX-BF16). There bf16 matmuls
    outrun fp32 ones; without them bf16 has no native path, and work stays fp32."""
    try:
        flags = cpuinfo.read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_is_fast() -> bool:
    """Whether this machine multiplies bf16 faster than fp32: CUDA, or a CPU with bf16 instructions."""
    return torch.cuda.is_available() or cpu_multiplies_bf16()


def data_engine_dtype(engine_options: dict | None = None) -> str:
    """The dtype an engine that makes data (hf or vllm) runs in: `engine_options["dtype"]` when given, else bf16
    where the machine multiplies it fast, elsewhere fp32."""
    return (engine_options or {}).get("dtype") or ("bfloat16" if bf16_is_fast() else "float32")
