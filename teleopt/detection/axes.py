"""Union-find over tensor axes: which channels must transform together, and how.

Detection (Zhao 2026, Sec. 1.2: a symmetry of a subnetwork is a group acting on a
hidden axis, by g on the layer writing it and by the contragredient on the layer
reading it) ties the axes of every tensor in a traced graph into *classes*.  One
group element acts on all axes of a class; each axis carries it by a
representation ``rho(g)**power``:

* ``power=+1`` on activations and on the rows of the layer that writes them,
  ``power=-1`` on the columns of the layer that reads them (Prop. 1.2.3);
* for positive scaling any real power (``2`` for BatchNorm running variances,
  ``alpha`` through a homogeneous activation of degree alpha, Ex. 1.2.4, 1.2.7);
* permutations ignore the power.

An axis is a list of *atoms* (segments): concatenation, chunk and slicing make a
class *refine* into sub-classes, which every axis in the class follows.  A class is
*blocked* (the group must act trivially on it) when any op on it is not equivariant:
the model's input and output, a normalisation over the axis, a non-homogeneous
activation for scaling, an unknown op (fail closed).  There is one
:class:`AxisClasses` per group kind, because the same op passes some kinds and
blocks others (GELU passes permutations, not scaling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["KINDS", "AxisClasses", "Leaf", "Conflict"]

#: The group kinds detection searches, from largest to smallest group.
KINDS = ("general", "diagonal", "permutation")

_TOL = 1e-9
_MAX_REASONS = 4


class Conflict(ValueError):
    """Two axes of different lengths were asked to carry one group (a bug in an op rule)."""


@dataclass(frozen=True)
class Leaf:
    """A piece of an axis: ``length`` entries of class ``root``, carried with ``power``."""

    root: int
    power: float
    length: int


class AxisClasses:
    """Classes of axis atoms for one group kind (``"general"``, ``"diagonal"`` or ``"permutation"``).

    Atoms are identified by external integer ids (shared by the three kinds) and
    created lazily with :meth:`ensure`.  ``unify(a, b, power)`` records
    ``rho_b = rho_a ** power`` between two equally long axes (lists of atoms).
    """

    def __init__(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        self._parent: list[int] = []
        self._power: list[float] = []
        self._length: list[int] = []
        self._size: list[int] = []
        self._children: dict[int, list[int]] = {}
        self._blocked: dict[int, list[str]] = {}
        self._approx: dict[int, list[str]] = {}
        self._ext: dict[int, int] = {}

    # -- atoms ----------------------------------------------------------------
    def _new(self, length: int) -> int:
        self._parent.append(len(self._parent))
        self._power.append(1.0)
        self._length.append(length)
        self._size.append(1)
        return len(self._parent) - 1

    def ensure(self, ext: int, length: int) -> int:
        """The internal node of external atom ``ext`` (created on first use)."""
        node = self._ext.get(ext)
        if node is None:
            node = self._ext[ext] = self._new(length)
        return node

    def find(self, node: int) -> tuple[int, float]:
        """Root of ``node`` and the power relating them (rho_node = rho_root ** power)."""
        path = []
        while self._parent[node] != node:
            path.append(node)
            node = self._parent[node]
        root = node
        acc = 1.0  # power of the current path node relative to the root, folded from the top
        for n in reversed(path):
            acc *= self._power[n]
            self._parent[n] = root
            self._power[n] = acc
        return root, acc

    def leaves(self, nodes: Sequence[int]) -> list[Leaf]:
        """The unrefined pieces an axis (list of nodes) currently consists of, in order."""
        out: list[Leaf] = []
        for node in nodes:
            self._expand(node, 1.0, out)
        return out

    def _expand(self, node: int, power: float, out: list[Leaf]) -> None:
        root, p = self.find(node)
        p *= power
        kids = self._children.get(root)
        if kids is None:
            out.append(Leaf(root, p, self._length[root]))
        else:
            for kid in kids:
                self._expand(kid, p, out)

    def _refine(self, root: int, cuts: list[int]) -> None:
        """Split class ``root`` at the given interior offsets; every axis in the class follows."""
        bounds = [0, *cuts, self._length[root]]
        kids = [self._new(b - a) for a, b in zip(bounds, bounds[1:])]
        for kid in kids:
            if root in self._blocked:
                self._blocked[kid] = list(self._blocked[root])
            if root in self._approx:
                self._approx[kid] = list(self._approx[root])
        self._children[root] = kids

    def _cut(self, nodes: Sequence[int], cuts: set[int]) -> bool:
        """Refine the leaves of an axis so that every offset in ``cuts`` is a boundary."""
        changed = False
        offset = 0
        for leaf in self.leaves(nodes):
            inner = sorted(c - offset for c in cuts if offset < c < offset + leaf.length)
            if inner and leaf.root not in self._children:
                self._refine(leaf.root, inner)
                changed = True
            offset += leaf.length
        return changed

    def range_leaves(self, nodes: Sequence[int], start: int, stop: int) -> list[Leaf]:
        """The leaves covering ``[start, stop)`` of an axis (refining at the ends if needed)."""
        while self._cut(nodes, {start, stop}):
            pass
        out, offset = [], 0
        for leaf in self.leaves(nodes):
            if start <= offset and offset + leaf.length <= stop:
                out.append(leaf)
            offset += leaf.length
        return out

    # -- relations --------------------------------------------------------------
    def unify(
        self,
        a: Sequence[int],
        b: Sequence[int],
        power: float = 1.0,
        a_range: tuple[int, int] | None = None,
        b_range: tuple[int, int] | None = None,
    ) -> None:
        """Tie two axes (or ranges of them) entry by entry: rho_b = rho_a ** power."""
        a_len = sum(self._length[n] for n in a) if a_range is None else a_range[1] - a_range[0]
        b_len = sum(self._length[n] for n in b) if b_range is None else b_range[1] - b_range[0]
        if a_len != b_len:
            raise Conflict(f"cannot tie axes of lengths {a_len} and {b_len}")
        a0, a1 = a_range or (0, a_len)
        b0, b1 = b_range or (0, b_len)
        if a_range is None and b_range is None:
            la, lb = self.leaves(a), self.leaves(b)
        else:
            la, lb = self.range_leaves(a, a0, a1), self.range_leaves(b, b0, b1)
        while len(la) != len(lb) or any(x.length != y.length for x, y in zip(la, lb)):
            cuts_a, cuts_b = _offsets(la), _offsets(lb)
            self._cut_range(a, a0, cuts_b - cuts_a)
            self._cut_range(b, b0, cuts_a - cuts_b)
            la, lb = self.range_leaves(a, a0, a1), self.range_leaves(b, b0, b1)
        for x, y in zip(la, lb):
            self._union(x, y, power)

    def _cut_range(self, nodes: Sequence[int], start: int, cuts: set[int]) -> bool:
        return self._cut(nodes, {start + c for c in cuts}) if cuts else False

    def _union(self, x: Leaf, y: Leaf, power: float) -> None:
        # rho_y_atom = rho_x_atom ** power, rho_x_atom = rho_rx ** px, rho_y_atom = rho_ry ** py
        rx, ry = x.root, y.root
        if self.kind == "permutation":
            w = 1.0
        else:
            w = x.power * power / y.power  # rho_ry = rho_rx ** w
        if rx == ry:
            if abs(w - 1.0) > _TOL:
                why = (
                    "would have to carry both g and g^-T (only an orthogonal group allows that)"
                    if self.kind == "general"
                    else f"would have to carry both c and c**{w:g}"
                )
                self._add(self._blocked, rx, f"the same channels {why}")
            return
        if self.kind == "general" and abs(abs(w) - 1.0) > _TOL:
            self._add(self._blocked, rx, f"tied with power {w:g}, which GL has no representation for")
        if self._size[rx] < self._size[ry]:
            rx, ry, w = ry, rx, 1.0 / w
        self._parent[ry] = rx
        self._power[ry] = w
        self._size[rx] += self._size[ry]
        for table in (self._blocked, self._approx):
            if ry in table:
                for reason in table.pop(ry):
                    self._add(table, rx, reason)

    @staticmethod
    def _add(table: dict[int, list[str]], root: int, reason: str) -> None:
        reasons = table.setdefault(root, [])
        if reason not in reasons and len(reasons) < _MAX_REASONS:
            reasons.append(reason)

    def block(self, nodes: Sequence[int], reason: str, start: int | None = None, stop: int | None = None) -> None:
        """The group must act trivially on these axes (or the range of them)."""
        leaves = self.leaves(nodes) if start is None else self.range_leaves(nodes, start, stop)  # type: ignore[arg-type]
        for leaf in leaves:
            self._add(self._blocked, leaf.root, reason)

    def mark_approximate(self, nodes: Sequence[int], reason: str) -> None:
        """The symmetry on these axes holds only up to a stated error (BatchNorm eps)."""
        for leaf in self.leaves(nodes):
            self._add(self._approx, leaf.root, reason)

    # -- queries ----------------------------------------------------------------
    def blocked(self, root: int) -> list[str]:
        """Why the class is blocked (empty if it is free)."""
        return self._blocked.get(self.find(root)[0], [])

    def approximate(self, root: int) -> list[str]:
        """Why the class is only approximate (empty if exact)."""
        return self._approx.get(self.find(root)[0], [])

    def all_blocked(self, nodes: Sequence[int]) -> bool:
        """Whether every piece of the axis is blocked (the group acts trivially on all of it)."""
        return all(leaf.root in self._blocked for leaf in self.leaves(nodes))

    def length(self, root: int) -> int:
        return self._length[root]


def _offsets(leaves: list[Leaf]) -> set[int]:
    out, offset = set(), 0
    for leaf in leaves:
        offset += leaf.length
        out.add(offset)
    out.discard(offset)
    return out
