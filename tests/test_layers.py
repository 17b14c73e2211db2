"""The layout shows the architecture: data flows one way (profile -> plan -> deploy -> serve), and
no lower layer imports a higher one. Every import in ``edgepipe`` (lazy ones inside functions
included) is resolved to the sub-package it reaches; a new sub-package must be given its rank here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "edgepipe"

# Lower numbers are lower layers; a part may import its own rank or below.
PACKAGE_RANK = {
    "native": 0, "progress": 0, "generated": 0, "dist": 0, "__version__": 0,
    "runtime": 1, "emulate": 1,
    "model": 2, "net": 2, "plan": 2,
    "worker": 3,
    "cluster": 4,
    "api": 5,
    "serve": 6, "bench": 6,
    "cli": 7, "__main__": 8,
}
# Inside the coordinator: its state, the rules over it, the shells that carry them out, the simulation.
CLUSTER_RANK = {"state": 0, "rules": 1, "shells": 2, "simulation": 3}


def _module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_module(parts: list[str]) -> bool:
    p = ROOT.parent.joinpath(*parts)
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports_of(path: Path) -> set[tuple[str, ...]]:
    """The edgepipe modules ``path`` imports, as dotted parts."""
    here = _module_parts(path)
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[tuple[str, ...]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {tuple(a.name.split(".")) for a in node.names if a.name.split(".")[0] == "edgepipe"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "edgepipe":
                base = []
            else:
                continue
            target = base + (node.module.split(".") if node.module else [])
            subs = [target + [a.name] for a in node.names if _is_module(target + [a.name])]
            found |= {tuple(t) for t in subs} or {tuple(target)}
    return found


def _rank(parts: tuple[str, ...] | list[str]) -> tuple[int, int]:
    top = parts[1] if len(parts) > 1 else "__init__"
    top = top.removesuffix(".py")
    if top == "__init__":
        return -1, -1
    inner = CLUSTER_RANK.get(parts[2], -1) if top == "cluster" and len(parts) > 2 else -1
    return PACKAGE_RANK[top], inner


def _violations() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        here = _module_parts(path)
        mine = _rank(here)
        for target in imports_of(path):
            theirs = _rank(target)
            if theirs[0] > mine[0] or (theirs[0] == mine[0] == PACKAGE_RANK["cluster"] and mine[1] >= 0 and theirs[1] > mine[1]):
                out.append(f"{'.'.join(here)} imports {'.'.join(target)}")
    return out


@pytest.mark.pure
def test_every_part_has_a_rank():
    tops = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert tops - {"__init__"} <= set(PACKAGE_RANK), sorted(tops - set(PACKAGE_RANK) - {"__init__"})
    cluster = {p.name for p in (ROOT / "cluster").iterdir() if (p / "__init__.py").is_file()}
    assert cluster <= set(CLUSTER_RANK), sorted(cluster - set(CLUSTER_RANK))


@pytest.mark.pure
def test_no_lower_layer_imports_a_higher_one():
    assert _violations() == []


@pytest.mark.pure
def test_the_check_sees_a_lazy_import_upwards(tmp_path, monkeypatch):
    """The check itself can fail: a function-level import of the API from the runtime is caught."""
    fake = tmp_path / "edgepipe"
    (fake / "runtime").mkdir(parents=True)
    (fake / "api").mkdir()
    for d in (fake, fake / "runtime", fake / "api"):
        (d / "__init__.py").write_text("")
    (fake / "api" / "app.py").write_text("")
    (fake / "runtime" / "x.py").write_text("def f():\n    from ..api import app\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    assert _violations() == ["edgepipe.runtime.x imports edgepipe.api.app"]
