"""teleopt's modules import only downwards: no cycles, no upward or sideways edges.

Every ``import`` in ``teleopt/`` is read from the source (function-level and
``TYPE_CHECKING`` imports included, since those are dependencies too) and each
module is placed in a layer by its name.  A module may import its own family
(the same top-level subpackage, e.g. ``teleopt.teleport.*``) as long as the
family's graph has no cycle, and any module of a strictly lower layer.  The
top-level package ``teleopt`` is a lazy facade over everything and is exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "teleopt"

#: Bottom to top.  Within one layer, each prefix is a family of its own: siblings
#: (e.g. teleport and syre) may not import each other.  Detection sits below the
#: algorithms because ``Teleport(..., "auto")`` finds its sites with it, and the
#: integrations (other libraries' modules recognised by structure) below detection,
#: which adds their sites.
LAYERS: list[tuple[str, ...]] = [
    ("teleopt._lazy", "teleopt._version", "teleopt.numerics", "teleopt.unwrap"),
    ("teleopt.sharding",),  # sums over ranks, reading values with numerics.read_together
    ("teleopt.groups",),
    ("teleopt.actions",),
    ("teleopt.registry",),
    ("teleopt.site", "teleopt.functional", "teleopt.wrapper", "teleopt.syre_anchors"),
    ("teleopt.integrations",),
    ("teleopt.detection", "teleopt.datasets"),
    ("teleopt.teleport", "teleopt.syre", "teleopt.discovery", "teleopt.analysis", "teleopt.checkpoint"),
    ("teleopt.learned_teleport",),  # plugs a trained policy into Teleport's search
    ("teleopt.testing", "teleopt.demo"),
    ("teleopt.cli",),
    ("teleopt.__main__",),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every teleopt module ``path`` imports, resolved to absolute names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from teleopt.x import y`` imports the submodule teleopt.x.y when there is
            # one; otherwise the name y comes from teleopt.x itself
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if _is_module(f"{module}.{alias.name}") else module)
    return {m for m in found if m == "teleopt" or m.startswith("teleopt.")}


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _place(module: str) -> tuple[int, str]:
    """(layer index, family prefix) of a module."""
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or module.startswith(prefix + "."):
                return index, prefix
    raise LookupError(module)


def test_every_module_has_a_layer():
    unplaced = []
    for module in _graph():
        if module == "teleopt":
            continue
        try:
            _place(module)
        except LookupError:
            unplaced.append(module)
    assert not unplaced, f"add these modules to LAYERS in {Path(__file__).name}: {unplaced}"


def test_imports_only_go_down_or_stay_in_their_family():
    bad = []
    for module, targets in _graph().items():
        if module == "teleopt":
            continue
        layer, family = _place(module)
        for target in targets:
            if target == "teleopt":
                bad.append(f"{module} -> teleopt (the lazy facade; import the defining module)")
                continue
            t_layer, t_family = _place(target)
            if t_family == family:
                continue
            if t_layer > layer:
                bad.append(f"{module} -> {target} (upward: layer {layer} imports layer {t_layer})")
            elif t_layer == layer:
                bad.append(f"{module} -> {target} (sideways: {family} and {t_family} are siblings)")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycles():
    graph = {m: t for m, t in _graph().items() if m != "teleopt"}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_cycle_finder_finds_cycles_and_only_cycles(graph, expected):
    assert _cycle(graph) == expected


def test_the_layer_check_catches_an_upward_edge():
    """The check must be able to fail: the registry importing teleport is upward."""
    assert _place("teleopt.registry")[0] < _place("teleopt.teleport.optimizer")[0]
    assert _place("teleopt.teleport.optimizer")[1] != _place("teleopt.syre")[1]
    assert _place("teleopt.teleport.optimizer")[0] == _place("teleopt.syre")[0]
