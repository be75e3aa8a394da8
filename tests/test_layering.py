"""The house's import arrows (docs/design.md section 2): what each package may import, including lazy imports
inside functions, read from the source so a new arrow fails here before it tangles the layers."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle_train", "data_prep", "inference", "engines", "eagle_cli")
MAY_IMPORT = {
    "eagle_train": {"eagle_train"},
    "data_prep": {"eagle_train", "data_prep", "engines"},  # a serving engine can make the data
    "inference": {"eagle_train", "inference"},
    "engines": {"eagle_train", "inference", "engines"},
    "eagle_cli": set(PACKAGES),
}


def project_imports(path: Path) -> set[str]:
    """The project packages a module imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_the_layers_below_it(package):
    modules = sorted((REPO / package).rglob("*.py"))
    assert modules, f"no package {package}"
    wrong = {
        str(m.relative_to(REPO)): sorted(project_imports(m) - MAY_IMPORT[package])
        for m in modules
        if project_imports(m) - MAY_IMPORT[package]
    }
    assert not wrong, f"{package} may import only {sorted(MAY_IMPORT[package])}; these reach further: {wrong}"


def test_the_checker_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from inference.generate import Runtime\n    import engines.vllm\n")
    assert project_imports(module) == {"inference", "engines"}
