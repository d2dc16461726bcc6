"""The pure core is a place, and the tree shows it.

Walks every module of the pure packages (``overlay/core``, ``inference/core``) and fails on
an import outside an allow-list (no trio, libp2p, llama_cpp, socket, time, os ...), on a
clock read, on the process-global random generator, and on a function longer than
``MAX_CORE_FUNCTION_LINES``. Then checks the package graph: no package imports one above
it (core <- inference <- overlay <- node <- bench/cli) and no two modules import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE_DIRS = ("overlay/core", "inference/core")
# What pure code may import: the standard library's computational modules, the two
# codec/crypto libraries, and other pure modules (relative imports inside a core package).
ALLOWED_IMPORTS = {
    "__future__", "base64", "binascii", "bisect", "collections", "contextlib", "dataclasses",
    "enum", "functools", "hashlib", "heapq", "hmac", "ipaddress", "itertools", "json", "math",
    "operator", "random", "struct", "typing", "zlib", "cbor2", "cryptography",
}
FORBIDDEN_HINT = "trio, libp2p, llama_cpp, socket, time, os and other IO stay in the shells"
CLOCK_CALLS = {
    ("time", "time"), ("time", "monotonic"), ("time", "perf_counter"), ("time", "time_ns"),
    ("time", "monotonic_ns"), ("datetime", "now"), ("datetime", "utcnow"), ("date", "today"),
}
MAX_CORE_FUNCTION_LINES = 80
# Functions still being split (issue 13); this set only shrinks, and must end empty.
LONG_FUNCTIONS_BEING_SPLIT: set[tuple[str, str]] = set()

# Package layering, lowest first: a module may import its own layer or lower ones.
LAYERS = {
    "prefixmesh.inference.core": 0,
    "prefixmesh.overlay.core": 1,
    "prefixmesh.inference": 2,
    "prefixmesh.overlay": 3,
    "prefixmesh.node": 4,
    "prefixmesh.bench": 5,
    "prefixmesh": 6,  # the CLI entry point
}
PACKAGE_DIRS = {
    "prefixmesh.inference": "inference",
    "prefixmesh.overlay": "overlay",
    "prefixmesh.node": "node",
    "prefixmesh.bench": "bench",
    "prefixmesh": "prefixmesh",
}


def _pure_modules() -> list[Path]:
    return sorted(p for d in PURE_DIRS for p in (ROOT / d).glob("*.py"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    top = {"inference", "overlay", "node", "bench"}
    if parts[0] in top:
        parts = ["prefixmesh", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every imported module (absolute name), with its line, including function-level ones."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mod = _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x -> the submodules
                    out.extend((node.lineno, f"{name}.{a.name}") for a in node.names)
                    continue
                out.append((node.lineno, name))
            else:
                out.append((node.lineno, node.module or ""))
    return out


def _is_pure_import(name: str) -> bool:
    if name.startswith(("prefixmesh.overlay.core", "prefixmesh.inference.core")):
        return True
    return name.split(".")[0] in ALLOWED_IMPORTS


def purity_violations(path: Path) -> list[str]:
    """What makes ``path`` impure, one line each (empty: pure)."""
    problems = [
        f"{path.name}:{line}: imports {name} ({FORBIDDEN_HINT})"
        for line, name in _imports(path)
        if not _is_pure_import(name)
    ]
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name):
                key = (owner.id, node.func.attr)
                if key in CLOCK_CALLS:
                    problems.append(f"{path.name}:{node.lineno}: reads the clock ({owner.id}.{node.func.attr})")
                if owner.id == "random" and node.func.attr not in ("Random",):
                    problems.append(
                        f"{path.name}:{node.lineno}: uses the process-global random generator "
                        f"(random.{node.func.attr}); pass a random.Random in"
                    )
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_CORE_FUNCTION_LINES and (path.name, node.name) not in LONG_FUNCTIONS_BEING_SPLIT:
                problems.append(
                    f"{path.name}:{node.lineno}: function {node.name} has {length} lines "
                    f"(> {MAX_CORE_FUNCTION_LINES})"
                )
    return problems


def test_the_pure_packages_exist_and_hold_the_core():
    names = {p.stem for p in _pure_modules()}
    assert {"wire", "digest", "antientropy", "partition", "peerindex", "routing", "trust",
            "identity", "blocks", "radix"} <= names


@pytest.mark.parametrize("path", _pure_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_has_no_io_no_clock_and_short_functions(path: Path):
    assert purity_violations(path) == []


def test_the_purity_check_catches_what_it_claims(tmp_path: Path):
    # The check itself must fail on a broken module; otherwise the test above proves nothing.
    bad = ROOT / "overlay" / "core" / "_purity_probe_tmp.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CORE_FUNCTION_LINES + 1))
    bad.write_text(
        "import trio\nimport time\nimport random\nfrom socket import socket\n"
        "def f():\n    return time.monotonic() + random.random()\n"
        f"def long():\n{body}\n"
    )
    try:
        found = "\n".join(purity_violations(bad))
    finally:
        bad.unlink()
    for needle in ("imports trio", "imports time", "imports socket", "reads the clock",
                   "process-global random", "function long has"):
        assert needle in found, found


def _layer(module: str) -> tuple[str, int] | None:
    best = None
    for pkg, layer in LAYERS.items():
        if module == pkg or module.startswith(pkg + "."):
            if best is None or len(pkg) > len(best[0]):
                best = (pkg, layer)
    return best


def _all_product_modules() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS.values() for p in (ROOT / d).rglob("*.py"))


def test_no_package_imports_a_higher_layer():
    problems = []
    for path in _all_product_modules():
        me = _layer(_module_name(path))
        assert me is not None, path
        for line, name in _imports(path):
            other = _layer(name)
            if other is None or other[0] == me[0]:
                continue
            if other[1] > me[1]:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {me[0]} imports {name}")
    assert problems == []


def test_no_two_modules_import_each_other():
    names = {_module_name(p): p for p in _all_product_modules()}
    graph: dict[str, set[str]] = {n: set() for n in names}
    for mod, path in names.items():
        for _, name in _imports(path):
            while name and name not in names:  # from pkg.mod import symbol -> pkg.mod
                name = name.rpartition(".")[0]
            if name and name != mod:
                graph[mod].add(name)
    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if a < b and a in graph[b])
    assert cycles == []
