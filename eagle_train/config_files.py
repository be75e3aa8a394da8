"""Where a `--config` name leads: a file that exists, else a config this package ships.

The repo's `configs/` directory is the package's `eagle_train/configs` (a link in the source tree, real files
in a wheel), so `eagle-train --config eagle3_smollm2` and `eagle-prep run --config smollm2_sharegpt` work from
any directory, on a wheel install as in a checkout, and the YAMLs exist once.
"""

from pathlib import Path

import yaml

SHIPPED = Path(__file__).parent / "configs"


def shipped_names(key: str | None = None) -> list[str]:
    """The names of the shipped run configs (file names without .yaml); with `key`, of those that set it
    (`method`: training configs, `prep`: eagle-prep's)."""
    files = sorted(SHIPPED.glob("*.yaml"))
    return [p.stem for p in files if key is None or key in (yaml.safe_load(p.read_text()) or {})]


def config_file(name: str) -> Path:
    """The config `name` means: a path that exists wins; else a shipped config, named bare with or without .yaml
    (`eagle3_smollm2`) or as the docs write it from a checkout (`configs/eagle3_smollm2.yaml`); else
    FileNotFoundError listing the shipped names (a missing path elsewhere never falls back to a shipped file)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.parent in (Path("."), Path("configs")):
        shipped = SHIPPED / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
        if shipped.is_file():
            return shipped
    raise FileNotFoundError(
        f"config {name} is neither a file nor a shipped config; the shipped configs are: {', '.join(shipped_names())}"
    )
