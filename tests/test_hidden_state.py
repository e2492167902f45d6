"""The group math keeps no hidden state: no module-level mutable containers and no ``global`` rebinding.

What the groups remember about their elements lives in a
:class:`~teleopt.groups.GroupCache` owned by its caller (a teleport, an apply),
active for a block; read from the source with ``ast``, like ``tests/test_code_shape.py``.
"""

from __future__ import annotations

import ast
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from teleopt import Site, get_action
from teleopt.groups import GroupCache
from teleopt.groups.cache import active_cache
from teleopt.teleport import SafetyConfig, Schedule, Teleport

PACKAGE = Path(__file__).resolve().parents[1] / "teleopt"
STATELESS = ("groups",)  # packages under teleopt/ held to the rule

#: calls that build a mutable container
MUTABLE_CALLS = {
    "dict",
    "list",
    "set",
    "bytearray",
    "OrderedDict",
    "defaultdict",
    "deque",
    "Counter",
    "ChainMap",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}
MUTABLE_NODES = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def _called(node: ast.expr) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def mutable_globals(source: str) -> list[str]:
    """``name (line)`` of each module-level binding to a mutable container and each ``global`` statement."""
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        targets: list[ast.expr] = []
        value = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        names = [ast.unparse(t) for t in targets]
        if value is None or names == ["__all__"]:
            continue
        if isinstance(value, MUTABLE_NODES) or _called(value) in MUTABLE_CALLS:
            found.append(f"{', '.join(names)} (line {node.lineno})")
    found += [f"global {', '.join(n.names)} (line {n.lineno})" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return found


@pytest.mark.parametrize("package", STATELESS)
def test_the_group_math_has_no_module_level_mutable_state(package):
    bad = {
        str(path.relative_to(PACKAGE.parent)): found
        for path in sorted((PACKAGE / package).rglob("*.py"))
        if (found := mutable_globals(path.read_text()))
    }
    assert not bad, f"module-level mutable state (own it in an object with a lifetime, e.g. GroupCache): {bad}"


def test_the_check_sees_caches_sets_and_global_rebinding():
    source = (
        "from collections import OrderedDict\n"
        "__all__ = ['x']\n"
        "_A: OrderedDict[int, int] = OrderedDict()\n"
        "_B = set()\n"
        "_C = {}\n"
        "_D = (1, 2)\n"
        "_E = frozenset()\n"
        "def f():\n"
        "    global _N\n"
        "    _N = 1\n"
    )
    assert mutable_globals(source) == ["_A (line 3)", "_B (line 4)", "_C (line 5)", "global _N (line 9)"]


class _LinalgCount(TorchDispatchMode):
    """Counts the matrix exponentials and solves run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "matrix_exp" in name or "solve" in name:
            self.counts["matrix_exp" if "matrix_exp" in name else "solve"] += 1
        return func(*args, **(kwargs or {}))


def _gl_teleport_counts() -> Counter[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Identity(), nn.Linear(16, 16), nn.Identity(), nn.Linear(16, 4))
    gl = get_action("gl_linear")
    sites = [Site(gl, ("0.weight", "0.bias", "2.weight")), Site(gl, ("2.weight", "2.bias", "4.weight"))]
    x = torch.randn(16, 8)
    opt = Teleport(
        torch.optim.AdamW(model.parameters()), model, sites, safety=SafetyConfig(watch_steps=0), example_inputs=x[:8], schedule=Schedule()
    )
    nn.functional.mse_loss(model(x), torch.randn(16, 4)).backward()
    with _LinalgCount() as count:
        report = opt.teleport()
    assert report.accepted, report.reason
    return count.counts


def test_a_teleport_owns_a_group_cache_for_its_duration(monkeypatch):
    """Teleport activates a GroupCache per teleport: the GL boundary point's exp comes from its remembered
    eigendecomposition and each contragredient is solved once (the one matrix_exp left is the round-off
    bound's, ``GeneralLinear.roundoff_amplification``, at a shrunk point); with the cache never activated
    the same teleport needs more matrix_exp and more solves (same result, more work)."""
    cached = _gl_teleport_counts()
    assert cached["matrix_exp"] <= 1 and cached["solve"] > 0
    assert active_cache() is None  # nothing outlives the teleport
    monkeypatch.setattr(GroupCache, "active", lambda self: nullcontext(self))
    uncached = _gl_teleport_counts()
    assert uncached["matrix_exp"] > cached["matrix_exp"] and uncached["solve"] > cached["solve"]


def test_a_group_cache_needs_a_positive_size_and_drops_its_oldest_entries():
    with pytest.raises(ValueError, match="size"):
        GroupCache(size=0)
    cache = GroupCache(size=2)
    elements = [torch.ones(1) for _ in range(3)]
    for i, g in enumerate(elements):
        cache.put("t", g, i, i)
    assert cache.keys("t") == [1, 2] and cache.get("t", elements[2], 2) == 2 and cache.get("t", elements[0], 0) is None
    elements[2].add_(1)  # changed in place: a new version is a new element
    assert cache.get("t", elements[2], 2) is None
