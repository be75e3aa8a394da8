"""How this process was launched: what `accelerate launch` says in the environment before any process starts."""

import os


def launched_with(backend: str) -> bool:
    """Whether `accelerate launch` runs this process under DEEPSPEED or FSDP (ACCELERATE_USE_<backend>)."""
    return os.environ.get(f"ACCELERATE_USE_{backend}", "false").lower() in ("1", "true", "yes")
