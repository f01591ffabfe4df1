"""The project's import rules, read from the source with `ast` so they cannot drift:

- the runtime imports nothing from the exporter or the harness (it is what a native port follows,
  and what a user installs to serve);
- the exporter shares only small types with the runtime (errors, the manifest, the safetensors
  reader/writer, the model config), never the engine;
- the reference model modules stand alone: nothing from the fast path, the engine or the request
  side (the fast path sits beside them, behind one switch);
- the harness reaches no private name of the runtime (negative controls go through
  valen_runtime/faults.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("valen_runtime", "valen_export", "parity")
EXPORTER_MAY_USE = {"valen_runtime.errors", "valen_runtime.manifest", "valen_runtime.safetensors_file", "valen_runtime.config"}
REFERENCE_MODEL = ("qwen35", "vision", "gated_delta", "positions", "head", "config", "weights", "safetensors_file", "manifest")
REFERENCE_MAY_NOT_USE = ("valen_runtime.fast", "valen_runtime.engine", "valen_runtime.serve", "valen_runtime.cli",
                         "valen_runtime.request", "valen_runtime.wire", "valen_runtime.options", "valen_runtime.plan",
                         "valen_runtime.layouts")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, names imported from it, line) for every import in the file, relative
    imports resolved against the file's package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.append((target, [alias.name for alias in node.names], node.lineno))
    return out


def sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_every_package_is_read():
    for package in PACKAGES:
        assert sources(package), package


@pytest.mark.parametrize("path", sources("valen_runtime"), ids=lambda p: str(p.relative_to(REPO)))
def test_the_runtime_imports_neither_the_exporter_nor_the_harness(path):
    bad = [(m, line) for m, _, line in imports(path) if within(m, ("valen_export", "parity", "benchmarks", "tests"))]
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"


@pytest.mark.parametrize("path", sources("valen_export"), ids=lambda p: str(p.relative_to(REPO)))
def test_the_exporter_shares_only_small_types_with_the_runtime(path):
    bad = [(m, line) for m, _, line in imports(path)
           if within(m, ("valen_runtime",)) and not within(m, EXPORTER_MAY_USE)]
    bad += [(m, line) for m, _, line in imports(path) if within(m, ("parity",))]
    assert not bad, f"{path.relative_to(REPO)} imports {bad} (the exporter may use {sorted(EXPORTER_MAY_USE)})"


@pytest.mark.parametrize("name", REFERENCE_MODEL)
def test_the_reference_model_stands_alone(name):
    path = REPO / "valen_runtime" / f"{name}.py"
    bad = [(m, line) for m, _, line in imports(path) if within(m, REFERENCE_MAY_NOT_USE)]
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def private_runtime_reaches(source: str) -> list[tuple[str, int]]:
    """(expression, line) of every private name of a runtime module or object that `source` reaches."""
    tree = ast.parse(source)
    runtime_names = set()  # local names bound to runtime modules or objects
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and within(node.module, ("valen_runtime",)):
            for alias in node.names:
                runtime_names.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    found.append((f"{node.module}.{alias.name}", node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if within(alias.name, ("valen_runtime",)):
                    runtime_names.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in runtime_names:
                found.append((ast.unparse(node), node.lineno))
    return found


@pytest.mark.parametrize("path", sources("parity"), ids=lambda p: str(p.relative_to(REPO)))
def test_the_harness_reaches_no_private_runtime_name(path):
    bad = private_runtime_reaches(path.read_text(encoding="utf-8"))
    assert not bad, f"{path.relative_to(REPO)} reaches private runtime names {bad} (add a seam to valen_runtime/faults.py)"


def test_the_private_name_check_finds_what_it_must():
    source = ("from valen_runtime import engine\nfrom valen_runtime.qwen35 import TextRotaryEmbedding, _helper\n"
              "import valen_runtime.fast.layers as layers\nengine._secret = 1\nTextRotaryEmbedding._interleave\n"
              "layers._fns.x\nengine.public\nother._private\n")
    assert sorted(e for e, _ in private_runtime_reaches(source)) == [
        "TextRotaryEmbedding._interleave", "engine._secret", "layers._fns", "valen_runtime.qwen35._helper"]


def test_a_built_wheel_ships_every_package():
    """What `pip install .` installs: every folder with an __init__.py under the three packages."""
    from setuptools import find_packages

    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    shipped = set(find_packages(str(REPO), include=config["tool"]["setuptools"]["packages"]["find"]["include"]))
    present = {".".join(p.parent.relative_to(REPO).parts) for package in PACKAGES for p in (REPO / package).rglob("__init__.py")}
    assert present <= shipped, f"not in the wheel: {sorted(present - shipped)}"
