"""The house's import arrows (docs/design.md section 2): what each package may import, including lazy imports
inside functions, read from the source so a new arrow fails here before it tangles the layers."""

import ast
import dataclasses
import subprocess
import sys
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


def method_folder(module: str) -> str | None:
    """The method folder a module belongs to (`eagle_train.methods.<folder>...`); None for the core and the registry."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["eagle_train", "methods"] and len(parts) > 2 else None


def test_the_core_and_each_method_folder_import_no_other_method_folder():
    """Inside eagle_train a method folder (`eagle_train/methods/<folder>/`) may import the core and the registry
    (`eagle_train.methods`), never another method folder, and the core imports no method folder: what two methods
    share lives in the core (`eagle_train.training_parts`), and the core reaches a method only through its row."""
    paths = {module_name(m): m for m in sorted((REPO / "eagle_train").rglob("*.py"))}
    assert {method_folder(name) for name in paths} >= {"eagle3", "peagle", "block"}
    wrong = {
        name: sorted(reached)
        for name, path in paths.items()
        if (
            reached := {
                other
                for other in imported_modules(path, set(paths))
                if method_folder(other) not in (None, method_folder(name))
            }
        )
    }
    assert not wrong, f"these reach into another method's folder: {wrong}"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in its body: `from pkg import sub` imports the submodule,
    `from pkg import name` the package's `__init__`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [sub if sub in modules else node.module for sub in subs]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            found.add(name)
    return found - {"", module_name(path)}


def test_the_engines_and_the_runtime_reach_a_method_only_through_its_row():
    """engines/ and inference/ import the registry (`eagle_train.methods`), never a method folder: what they need of a
    method is its row's (`drafts`, its names outside) or its head's (the class the row names), so a new method's
    folder and row are all it brings."""
    paths = {module_name(m): m for package in ("engines", "inference") for m in sorted((REPO / package).rglob("*.py"))}
    modules = set(paths) | {module_name(m) for m in (REPO / "eagle_train").rglob("*.py")}
    wrong = {
        name: sorted(reached)
        for name, path in paths.items()
        if (reached := {m for m in imported_modules(path, modules) if method_folder(m)})
    }
    assert not wrong, f"these import a method folder instead of reading its row: {wrong}"


SHARED_CONFIGS = ("eagle_train.train_config", "eagle_train.draft_config")


def method_keys() -> set[str]:
    """Every key a row declares as its own (`Method.train_keys`, `Method.head_keys`)."""
    from eagle_train import methods

    classes = {c for m in methods.METHODS.values() for c in (m.train_keys, m.head_keys) if c is not None}
    return {f.name for c in classes for f in dataclasses.fields(c)}


def test_the_shared_configs_name_no_methods_key():
    """TrainConfig and DraftConfig compose each method's keys from its row (`methods.with_method_keys`): their modules
    name none of them, as an attribute, a name, a keyword or a string, so a new method adds its keys in its folder."""
    keys = method_keys()
    assert {"num_depths", "block_size", "ttt_decay", "draft_init"} <= keys
    for module in SHARED_CONFIGS:
        path = REPO / Path(*module.split(".")).with_suffix(".py")
        named = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                named.add(node.attr)
            elif isinstance(node, ast.Name):
                named.add(node.id)
            elif isinstance(node, ast.keyword) and node.arg:
                named.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                named.add(node.value)
        assert not named & keys, f"{module} names the methods' keys {sorted(named & keys)}: they belong to their rows"


def test_a_rows_keys_import_nothing_heavy():
    """The shared configs import the modules a row names for its keys as they compose (`train_keys_at`,
    `head_keys_at`): such a module and its package import neither torch nor the shared configs, which would import
    it back."""
    from eagle_train import methods

    modules = sorted(
        {ref.partition(":")[0] for m in methods.METHODS.values() for ref in (m.train_keys_at, m.head_keys_at) if ref}
    )
    heavy = ("torch", "transformers", *SHARED_CONFIGS)
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {modules}]; "
        f"print(' '.join(m for m in {heavy} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.split() == [], f"importing {modules} imports {done.stdout.split()}"


def import_arrows() -> tuple[dict[str, Path], dict[str, set[str]]]:
    """Every project module's path and the project modules it imports, lazy imports included."""
    paths = {module_name(m): m for package in PACKAGES for m in sorted((REPO / package).rglob("*.py"))}
    return paths, {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Each circle of `arrows`, once, from its smallest module."""

    def circle_from(start: str, at: str, seen: list[str]) -> list[str] | None:
        for nxt in sorted(arrows.get(at, ())):
            if nxt == start:
                return [*seen, start]
            if nxt not in seen and nxt > start:
                found = circle_from(start, nxt, [*seen, nxt])
                if found:
                    return found
        return None

    return [c for name in sorted(arrows) if (c := circle_from(name, name, [name]))]


def test_no_module_imports_one_that_imports_it_back():
    """No import circle between modules, lazy imports included: the state a checkpoint saves is declared in
    train_checkpoint (the trainer's `Run` is one), vLLM's child-process helpers live in engines/vllm_child.py,
    `Engine` in engines/engine.py (engines/__init__.py, the registry, imports each engine; none imports it back).
    A package's `__init__` counts like any module."""
    found = circles(import_arrows()[1])
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


REGISTRY = "eagle_train.methods"


def row_resolvers() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The names through which a module imports what a row names as "module:name" (its `*_at` fields), with the
    fields each resolves: (the properties of `Method` and `Family` that read such a field, as `head_class` reads
    `head_at`; the registry's functions that read such a property, as `objective_for` reads `objective`)."""
    tree = ast.parse((REPO / "eagle_train" / "methods" / "__init__.py").read_text())
    properties, functions = {}, {}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        for fn in (node for node in cls.body if isinstance(node, ast.FunctionDef)):
            fields = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr.endswith("_at")}
            if fields:
                properties[fn.name] = fields
    for fn in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
        read = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr in properties}
        if read:
            functions[fn.name] = set().union(*(properties[name] for name in read))
    return properties, functions


def row_arrows(paths: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules named by the rows' strings it resolves (reading a resolving property of an object, or
    calling a resolving function of the registry): an import made when asked for, an arrow all the same. The registry
    only holds the strings; a property of that name read of another object (`turn.drafts`) adds an arrow too many,
    never one too few."""
    from eagle_train import methods

    rows = [*methods.METHODS.values(), *methods.FAMILIES.values()]
    properties, functions = row_resolvers()
    named = {
        reader: {getattr(r, f).partition(":")[0] for r in rows for f in fields if getattr(r, f, None)} & set(paths)
        for reader, fields in {**properties, **functions}.items()
    }
    arrows = {}
    for name, path in paths.items():
        nodes = list(ast.walk(ast.parse(path.read_text(), str(path))))
        attributes = {n.attr for n in nodes if isinstance(n, ast.Attribute)}
        names = attributes | {n.id for n in nodes if isinstance(n, ast.Name)}
        read = (attributes & set(properties)) | (names & set(functions))
        if name != REGISTRY and read:
            arrows[name] = set().union(*(named[reader] for reader in read)) - {name}
    return arrows


def test_no_module_reaches_through_a_row_one_that_imports_it_back():
    """A row's "module:name" strings are imports made when asked for: the module that resolves one
    (`row(cfg.method).head_class`) imports the module named. No circle through them either, so a method's head
    module may import what every head is built from (eagle_train.head) while the loader that resolves a row's head
    class (eagle_train.checkpoint, `head_from_state`) sits above both."""
    paths, arrows = import_arrows()
    for name, named in row_arrows(paths).items():
        arrows[name] = arrows[name] | named
    found = circles(arrows)
    assert not found, "import circles through the rows' module:name strings: " + "; ".join(
        " -> ".join(c) for c in found
    )


def test_the_checker_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from inference.generate import Runtime\n    import engines.vllm\n")
    assert project_imports(module) == {"inference", "engines"}
