"""The relations op rules record between tensor axes, for every group kind at once.

A rule (``teleopt.detection.rules``) looks at one node of the traced graph and
states, for each group kind, how the axes of its inputs, outputs and parameters
are tied (:meth:`NodeContext.unify`), which must stay fixed
(:meth:`NodeContext.block`), which only hold approximately (BatchNorm eps) and
which are reshaped into products of other axes (:meth:`NodeContext.kron`).  Every
axis a rule does not mention is blocked for that kind when the rule finishes:
detection fails closed.

Parameters and buffers enter as *occurrences*: one set of axis atoms per use (op
and role).  A tensor used by a single op may play two roles there (the LayerScale
vector gamma in ``x * gamma`` absorbs the scaling of x and writes the scaling of
the output); a tensor used by several ops (a shared module, tied weights) has all
its occurrences tied, so no site moves it for one use only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import nn

from teleopt.detection.axes import KINDS, AxisClasses, Conflict
from teleopt.detection.tracing import TensorMeta, TracedGraph, module_path

__all__ = [
    "ALL",
    "GD",
    "DP",
    "G",
    "D",
    "P",
    "Ref",
    "ParamView",
    "Occurrence",
    "ModelTensors",
    "DirectSite",
    "Relations",
    "NodeContext",
]

G, D, P = ("general",), ("diagonal",), ("permutation",)

#: roles in which one use of a tensor acts as two independent boundaries (see ``Relations.tie_occurrences``)
SPLIT_ROLES = frozenset({"absorbs", "writes"})
ALL = KINDS
GD = ("general", "diagonal")
DP = ("diagonal", "permutation")

#: A tensor in the analysis: ("t", graph, node, path) for traced values, ("o", id) for occurrences.
Ref = tuple
#: An axis: (tensor, axis index), or a raw list of atoms (virtual axes such as grouped-conv channels).
AxisHandle = tuple | list


@dataclass(frozen=True)
class ParamView:
    """A parameter, buffer or constant seen through view ops (reshape with size-1 axes, expand, permute)."""

    name: str
    kind: str  # "parameter" | "buffer" | "constant"
    axis_map: tuple[int | None, ...]
    shape: tuple[int, ...]
    expanded: tuple[bool, ...]


@dataclass(frozen=True)
class Occurrence:
    """One axis of one use of a parameter or buffer (a candidate site member)."""

    param: str
    axis: int
    groups: int
    use: tuple[str, str]
    role: str


@dataclass
class DirectSite:
    """A site a rule states directly (attention heads), with members as (tensor name, Member fields)."""

    action: str
    group: str
    members: list[tuple[str | None, dict[str, Any]]]
    blocks: int | None
    unit_size: int
    reference: str
    where: str
    info: dict[str, Any]
    exactness: str = "exact"
    graph: int = 0


@dataclass
class ModelTensors:
    """Names and properties of a model's parameters and buffers (shared tensors get one name)."""

    names: dict[int, str]
    kinds: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    movable: set[str]
    frozen: set[str]

    @classmethod
    def of(cls, model: nn.Module, include_frozen: bool) -> ModelTensors:
        names: dict[int, str] = {}
        kinds: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        frozen: set[str] = set()
        for name, p in model.named_parameters():
            names.setdefault(id(p), name)
            kinds[name] = "parameter"
            shapes[name] = tuple(p.shape)
            if not p.requires_grad and not include_frozen:
                frozen.add(name)
        for name, b in model.named_buffers():
            if id(b) in names:
                continue
            names[id(b)] = name
            kinds[name] = "buffer"
            shapes[name] = tuple(b.shape)
        state = set(model.state_dict(keep_vars=True))
        movable = {n for n in kinds if n in state and n not in frozen}
        return cls(names, kinds, shapes, movable, frozen)


@dataclass
class Relations:
    """All axis classes of an analysis (one union-find per group kind) and the pending constraints."""

    tensors: ModelTensors
    spaces: dict[str, AxisClasses] = field(default_factory=lambda: {k: AxisClasses(k) for k in KINDS})
    lengths: list[int] = field(default_factory=list)
    axes: dict[Ref, list[list[int]]] = field(default_factory=dict)
    shapes: dict[Ref, tuple[int, ...]] = field(default_factory=dict)
    aliases: dict[Ref, Ref] = field(default_factory=dict)
    views: dict[Ref, ParamView] = field(default_factory=dict)
    occurrences: dict[int, Occurrence] = field(default_factory=dict)
    occurrence_atoms: dict[Occurrence, int] = field(default_factory=dict)
    krons: list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[str, ...], str]] = field(default_factory=list)
    products: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], float, float, str]] = field(default_factory=list)
    direct_sites: list[DirectSite] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    _n_views: int = 0

    # -- atoms ------------------------------------------------------------------
    def new_atom(self, length: int) -> int:
        self.lengths.append(length)
        return len(self.lengths) - 1

    def nodes(self, kind: str, atoms: Sequence[int]) -> list[int]:
        """Internal union-find nodes of external atoms in one kind's space."""
        space = self.spaces[kind]
        return [space.ensure(a, self.lengths[a]) for a in atoms]

    def resolve(self, ref: Ref) -> Ref:
        while ref in self.aliases:
            ref = self.aliases[ref]
        return ref

    def declare(self, ref: Ref, shape: Sequence[int]) -> None:
        """Give a tensor fresh atoms, one per axis (if it has none yet)."""
        ref = self.resolve(ref)
        if ref not in self.axes:
            self.shapes[ref] = tuple(shape)
            self.axes[ref] = [[self.new_atom(n)] for n in shape]

    def occurrence_atom(self, occ: Occurrence, length: int) -> int:
        atom = self.occurrence_atoms.get(occ)
        if atom is None:
            atom = self.occurrence_atoms[occ] = self.new_atom(length)
            self.occurrences[atom] = occ
        return atom

    def materialise(self, view: ParamView, use: tuple[str, str], role: str, movable: bool = False) -> tuple[Ref, list[str]]:
        """A tensor for one use of a parameter view: its axes are occurrence atoms.

        Buffers are fixed unless ``movable`` (BatchNorm running statistics); constants,
        frozen parameters and tensors outside ``state_dict`` are always fixed.
        Returns the tensor and, if it is fixed, why.
        """
        self._n_views += 1
        ref: Ref = ("o", self._n_views)
        axes = []
        for size, t_axis, _expanded in zip(view.shape, view.axis_map, view.expanded):
            if t_axis is None:
                axes.append([self.new_atom(size)])
            else:
                occ = Occurrence(view.name, t_axis, 1, use, role)
                axes.append([self.occurrence_atom(occ, size)])
        self.axes[ref] = axes
        self.shapes[ref] = view.shape
        why: list[str] = []
        if view.kind == "constant":
            why.append(f"{view.name or 'a constant'} is a constant tensor, not a parameter or buffer")
        elif view.name in self.tensors.frozen:
            why.append(f"{view.name} is frozen (requires_grad=False)")
        elif view.name not in self.tensors.movable:
            why.append(f"{view.name} is not in the model's state_dict")
        elif view.kind == "buffer" and not movable:
            why.append(f"buffer {view.name} is used as a fixed tensor")
        for i, atoms in enumerate(axes):
            if view.expanded[i]:
                for kind in GD:
                    self.spaces[kind].block(self.nodes(kind, atoms), f"{view.name} is broadcast (constant) along this axis")
            if why:
                for kind in KINDS:
                    self.spaces[kind].block(self.nodes(kind, atoms), why[0])
        return ref, why

    def virtual_axis(self, param: str, axis: int, groups: int, use: tuple[str, str], role: str, length: int) -> list[int]:
        """Occurrence atoms of a virtual axis (grouped-convolution channels over axis 0 and ``axis``)."""
        atoms = [self.occurrence_atom(Occurrence(param, axis, groups, use, role), length)]
        if param not in self.tensors.movable:
            for kind in KINDS:
                self.spaces[kind].block(self.nodes(kind, atoms), f"{param} is frozen or not in the model's state_dict")
        return atoms

    def tie_occurrences(self) -> None:
        """Occurrences of a tensor used by several ops must transform identically (shared weights)."""
        by_param: dict[str, list[tuple[Occurrence, int]]] = {}
        for atom, occ in self.occurrences.items():
            by_param.setdefault(occ.param, []).append((occ, atom))
        for param, occs in by_param.items():
            uses = {occ.use for occ, _ in occs}
            if len(uses) <= 1:
                continue
            reason = f"{param} is used by {len(uses)} ops (a shared module or tied weights)"
            self.skipped.append(("parameter", param, f"used by {len(uses)} ops: its symmetries are tied across uses"))
            self._tie_uses(occs, reason)

    def _tie_uses(self, occs: list[tuple[Occurrence, int]], reason: str) -> None:
        """Tie the occurrences of one tensor used by several ops, axis by axis; block what cannot be tied.

        A use that splits the tensor into two roles (it absorbs the scaling of its input and
        writes that of its output) assumed it was the only use: those roles are fixed.  A
        grouped virtual axis and a plain axis of the same tensor cannot be tied entry by
        entry: both are fixed.
        """
        for occ, atom in occs:
            if occ.role in SPLIT_ROLES:
                self._block_in_every_kind([atom], reason)
        by_axis: dict[tuple[int, int], list[int]] = {}
        for occ, atom in occs:
            if occ.role not in SPLIT_ROLES:
                by_axis.setdefault((occ.axis, occ.groups), []).append(atom)
        variants: dict[int, list[tuple[int, int]]] = {}
        for (axis, groups), atoms in by_axis.items():
            variants.setdefault(axis, []).append((axis, groups))
            for kind in KINDS:
                nodes = self.nodes(kind, atoms)
                for other in nodes[1:]:
                    self.spaces[kind].unify([nodes[0]], [other], 1.0)
        for keys in variants.values():
            if len(keys) > 1:
                for key in keys:
                    self._block_in_every_kind(by_axis[key], reason)

    def _block_in_every_kind(self, atoms: list[int], reason: str) -> None:
        """Fix ``atoms`` in every group kind's space, saying why."""
        for kind in KINDS:
            self.spaces[kind].block(self.nodes(kind, atoms), reason)


class NodeContext:
    """What a rule sees of one node: its inputs and outputs as tensors, and the relation helpers."""

    def __init__(self, rel: Relations, traced: TracedGraph, gi: int, node: fx.Node, describe: str) -> None:
        self.rel = rel
        self.traced = traced
        self.gi = gi
        self.node = node
        self.describe = describe
        self.where = module_path(node) or node.name
        self.use = (node.name, str(node.target))
        self._mentioned: dict[tuple, set[str]] = {}
        self._involved: list[Ref] = []
        self._virtual: list[list[int]] = []

    # -- values -----------------------------------------------------------------
    def value(self, arg: Any) -> Any:
        """The recorded value of an argument (TensorMeta for tensors, python values otherwise)."""
        if isinstance(arg, fx.Node):
            return self.traced.values.get(arg.name)
        return arg

    def meta(self, ref: Ref) -> tuple[int, ...]:
        return self.rel.shapes[self.rel.resolve(ref)]

    def node_ref(self, node: fx.Node, path: tuple = ()) -> Ref:
        return self.rel.resolve(("t", self.gi, node.name, path))

    def view_of(self, arg: Any) -> ParamView | None:
        if isinstance(arg, fx.Node):
            return self.rel.views.get(("t", self.gi, arg.name, ()))
        return None

    def is_tensor(self, arg: Any) -> bool:
        v = self.value(arg)
        return isinstance(v, TensorMeta) and v.is_float and (isinstance(arg, fx.Node))

    def tensor(self, arg: Any, role: str = "input", movable: bool = False) -> Ref:
        """The tensor an argument refers to (a parameter view is materialised as an occurrence)."""
        view = self.view_of(arg)
        if view is not None:
            ref, why = self.rel.materialise(view, self.use, role, movable)
            self._involved.append(ref)
            return ref
        ref = self.node_ref(arg)
        meta = self.value(arg)
        unknown = ref not in self.rel.axes and isinstance(meta, TensorMeta) and not meta.is_float
        self.rel.declare(ref, meta.shape)
        if unknown:  # a mask or index no rule followed (an op without a rule drops them): fixed
            for atoms in self.rel.axes[ref]:
                for kind in KINDS:
                    self.rel.spaces[kind].block(self.rel.nodes(kind, atoms), self.reason("a non-floating-point tensor of unknown origin"))
        self._involved.append(ref)
        return ref

    def output(self, path: tuple = (), shape: Sequence[int] | None = None) -> Ref:
        """The node's output tensor (or one entry of a tuple output)."""
        ref = self.node_ref(self.node, path)
        if shape is None:
            value: Any = self.traced.values.get(self.node.name)
            for i in path:
                value = value[i]
            shape = value.shape
        self.rel.declare(ref, shape)
        self._involved.append(ref)
        return ref

    def param(self, module: nn.Module, attr: str, role: str, movable: bool = False) -> Ref | None:
        """A parameter/buffer of a leaf module as an occurrence (``None`` if absent)."""
        t = getattr(module, attr, None)
        if t is None:
            return None
        name = self.rel.tensors.names.get(id(t))
        kind = self.rel.tensors.kinds.get(name, "constant") if name else "constant"
        view = ParamView(name or f"{self.where}.{attr}", kind, tuple(range(t.ndim)), tuple(t.shape), (False,) * t.ndim)
        ref, _ = self.rel.materialise(view, self.use, role, movable)
        self._involved.append(ref)
        return ref

    # -- relations --------------------------------------------------------------
    def virtual_axis(self, param: str, axis: int, groups: int, role: str, length: int) -> list[int]:
        """A virtual occurrence axis (grouped-convolution channels), blocked for the kinds the rule leaves unmentioned."""
        atoms = self.rel.virtual_axis(param, axis, groups, self.use, role, length)
        self._virtual.append(atoms)
        return atoms

    def _atoms(self, h: AxisHandle, kinds: Iterable[str]) -> list[int]:
        if isinstance(h, list):
            self._mentioned.setdefault(("atoms", tuple(h)), set()).update(kinds)
            return h
        ref, axis = h
        ref = self.rel.resolve(ref)
        ax = axis % len(self.rel.axes[ref])
        key = (ref, ax)
        self._mentioned.setdefault(key, set()).update(kinds)
        return self.rel.axes[ref][ax]

    def reason(self, what: str | None = None) -> str:
        return f"{what or self.describe} at {self.where}"

    def unify(
        self,
        kinds: Iterable[str],
        a: AxisHandle,
        b: AxisHandle,
        power: float = 1.0,
        a_range: tuple[int, int] | None = None,
        b_range: tuple[int, int] | None = None,
    ) -> None:
        """rho_b = rho_a ** power on the two axes (or the given ranges), for each kind."""
        kinds = tuple(kinds)
        atoms_a, atoms_b = self._atoms(a, kinds), self._atoms(b, kinds)
        for kind in kinds:
            space = self.rel.spaces[kind]
            try:
                space.unify(self.rel.nodes(kind, atoms_a), self.rel.nodes(kind, atoms_b), power, a_range, b_range)
            except Conflict as e:
                space.block(self.rel.nodes(kind, atoms_a), self.reason(f"{self.describe}: {e}"))
                space.block(self.rel.nodes(kind, atoms_b), self.reason(f"{self.describe}: {e}"))

    def block(self, kinds: Iterable[str], h: AxisHandle, what: str | None = None) -> None:
        """The group must act trivially on this axis (for the given kinds)."""
        kinds = tuple(kinds)
        atoms = self._atoms(h, kinds)
        for kind in kinds:
            self.rel.spaces[kind].block(self.rel.nodes(kind, atoms), self.reason(what))

    def block_tensor(self, kinds: Iterable[str], ref: Ref, what: str | None = None) -> None:
        for i in range(len(self.meta(ref))):
            self.block(kinds, (ref, i), what)

    def mention(self, kinds: Iterable[str], h: AxisHandle) -> None:
        """The rule has handled this axis without a constraint (e.g. a sum over it, for permutations)."""
        self._atoms(h, tuple(kinds))

    def approximate(self, h: AxisHandle, what: str) -> None:
        """Scaling this axis is a symmetry only up to a stated error."""
        atoms = self._atoms(h, ())
        self.rel.spaces["diagonal"].mark_approximate(self.rel.nodes("diagonal", atoms), self.reason(what))

    def kron(self, kinds: Iterable[str], merged: AxisHandle, factors: Sequence[AxisHandle]) -> None:
        """``merged`` is the row-major product of the ``factors`` axes (a reshape merges or splits them)."""
        kinds = tuple(kinds)
        m = tuple(self._atoms(merged, kinds))
        fs = tuple(tuple(self._atoms(f, kinds)) for f in factors)
        self.rel.krons.append((m, fs, kinds, self.reason()))

    def product(self, a: AxisHandle, b: AxisHandle, out: AxisHandle, ea: float = 1.0, eb: float = 1.0) -> None:
        """Positive scaling through out = a**ea * b**eb: decided once the classes of a and b are known."""
        kinds = D
        self.rel.products.append(
            (tuple(self._atoms(a, kinds)), tuple(self._atoms(b, kinds)), tuple(self._atoms(out, kinds)), ea, eb, self.reason())
        )

    def finish(self) -> None:
        """Block, for each kind, every axis of the tensors involved that the rule did not mention."""
        seen = set()
        for ref in self._involved:
            ref = self.rel.resolve(ref)
            if ref in seen:
                continue
            seen.add(ref)
            for i in range(len(self.rel.axes[ref])):
                missing = [k for k in KINDS if k not in self._mentioned.get((ref, i), ())]
                if missing:
                    for kind in missing:
                        self.rel.spaces[kind].block(
                            self.rel.nodes(kind, self.rel.axes[ref][i]), self.reason(f"{self.describe} does not preserve this axis")
                        )
        for atoms in self._virtual:
            for kind in KINDS:
                if kind not in self._mentioned.get(("atoms", tuple(atoms)), ()):
                    self.rel.spaces[kind].block(self.rel.nodes(kind, atoms), self.reason(f"{self.describe} does not preserve this axis"))
