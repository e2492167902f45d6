"""Linear actions given by one group acting on an axis of several tensors.

Every exact linear symmetry of Zhao 2026, Table 1.1 has this form: a group G acts on
a "hidden" axis of length h (neurons, channels, heads, LoRA rank), and each member
tensor carries that axis somewhere and transforms on it by a representation of G:

* the layer *writing* the axis (rows of W1, entries of b1) by g (``power=+1``);
* the layer *reading* the axis (columns of W2) by g^{-T} (``power=-1``),
  so that W2 g^{-1} g W1 = W2 W1 (Zhao 2026, Prop. 1.2.3);
* for homogeneous activations of degree alpha, ``power=-alpha`` on the reader
  (Ex. 1.2.4); BatchNorm running variances scale with ``power=2`` (Ex. 1.2.7).

A member may act only on a slice ``[start, stop)`` of its axis (q, k, v rows of a
fused ``qkv`` projection).  Because the action is linear, its Jacobian is J = rho(g)
and gradients transform by the contragredient representation (``-power``),
Zhao 2026, Prop. 4.5.1.  Detection (``teleopt.find_symmetries``) builds these
actions with many members (a residual stream ties every block that reads or writes
it); the registry holds the canonical two-layer forms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.base import (
    Exactness,
    ExampleProblem,
    GroupAction,
    Params,
    check_exactness,
)
from teleopt.groups import (
    GeneralLinear,
    Group,
    Orthogonal,
    Permutation,
    PositiveScaling,
    SignFlip,
    is_validated,
)

__all__ = ["Member", "AxisAction", "GROUP_TYPES"]

GROUP_TYPES: dict[str, type[Group]] = {
    "general": GeneralLinear,
    "orthogonal": Orthogonal,
    "diagonal": PositiveScaling,
    "sign": SignFlip,
    "permutation": Permutation,
}


@dataclass(frozen=True)
class Member:
    """How one tensor transforms: on ``axis`` (optionally its slice ``[start, stop)``) by ``rho(g)**power``.

    ``power=+1`` is the standard representation (g), ``power=-1`` the contragredient
    (g^{-T}); scaling groups accept any real power (c**power).

    Layouts that detection (``teleopt.find_symmetries``) needs on real models:

    * ``outer``/``inner``: the acted-on part is viewed as (outer, n, inner) in
      row-major order and the group acts on n, with the same element on every outer
      block and inner position.  A Linear reading a flattened (C, H, W) feature map
      has ``inner=H*W`` on its columns; channels-last flattening gives ``outer``;
      a head permutation of a fused qkv projection has ``outer=3, inner=d_head``.
    * ``groups=G``: a grouped convolution weight of shape (out, in/G, ...) (or a
      grouped transposed convolution, (in, out/G, ...)) acted on through its G
      groups of axis 0 and ``axis``: channel ``g * shape[axis] + j`` is entry ``j``
      of ``axis`` in the rows of group ``g``.  Elementwise groups (scaling, signs) only.
    * ``tensor``: members with the same ``tensor`` (default: their ``name``) are
      parts of one tensor (q rows and k rows of a fused qkv weight); ``act`` composes
      them and returns the fully transformed tensor for each of them.
    """

    name: str
    axis: int
    power: float = 1
    optional: bool = False
    start: int | None = None
    stop: int | None = None
    outer: int = 1
    inner: int = 1
    groups: int = 1
    tensor: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"member name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise TypeError(f"member {self.name!r}: axis must be an int, got {self.axis!r}")
        if (self.start is None) != (self.stop is None):
            raise ValueError(f"member {self.name!r}: give both start and stop, or neither")
        if self.start is not None and self.stop is not None and not 0 <= self.start < self.stop:
            raise ValueError(f"member {self.name!r}: need 0 <= start < stop, got [{self.start}, {self.stop})")
        for field_name in ("outer", "inner", "groups"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"member {self.name!r}: {field_name} must be a positive int, got {value!r}")
        if self.groups > 1 and (self.start is not None or self.outer > 1 or self.inner > 1 or self.axis == 0):
            raise ValueError(f"member {self.name!r}: groups > 1 acts on a whole non-leading axis (no slice, outer or inner)")
        if self.tensor is not None and (not isinstance(self.tensor, str) or not self.tensor):
            raise ValueError(f"member {self.name!r}: tensor must be a non-empty string, got {self.tensor!r}")

    @property
    def tensor_key(self) -> str:
        """The tensor this member is part of (members with equal keys are composed)."""
        return self.tensor or self.name

    def axis_length(self, t: Tensor) -> int:
        """Length of the part of the axis the group acts on."""
        if not -t.ndim <= self.axis < t.ndim:
            raise ValueError(f"member {self.name!r}: axis {self.axis} out of range for shape {tuple(t.shape)}")
        if self.groups > 1:
            if self.axis % t.ndim == 0 or t.shape[0] % self.groups:
                raise ValueError(
                    f"member {self.name!r}: groups={self.groups} needs a non-leading axis and a leading axis "
                    f"divisible into groups, got shape {tuple(t.shape)}"
                )
            return self.groups * t.shape[self.axis]
        if self.start is None or self.stop is None:  # both or neither (checked at construction)
            part = t.shape[self.axis]
        elif self.stop > t.shape[self.axis]:
            raise ValueError(
                f"member {self.name!r}: slice [{self.start}, {self.stop}) exceeds axis {self.axis} of length {t.shape[self.axis]}"
            )
        else:
            part = self.stop - self.start
        if part % (self.outer * self.inner):
            raise ValueError(
                f"member {self.name!r}: a part of length {part} is not divisible into outer={self.outer} x n x inner={self.inner}"
            )
        return part // (self.outer * self.inner)

    def transform(self, t: Tensor, fn: Callable[[Tensor, int], Tensor]) -> Tensor:
        """Apply ``fn(part, axis)`` to the acted-on part of ``t`` and reassemble (out of place)."""
        axis = self.axis % t.ndim
        if self.groups > 1:
            return self._transform_grouped(t, axis, fn)
        if self.start is None or self.stop is None:  # both or neither (checked at construction)
            return self._transform_part(t, axis, fn)
        before = t.narrow(axis, 0, self.start)
        part = t.narrow(axis, self.start, self.stop - self.start)
        after = t.narrow(axis, self.stop, t.shape[axis] - self.stop)
        return torch.cat([before, self._transform_part(part, axis, fn), after], dim=axis)

    def part_view(self, t: Tensor) -> tuple[Tensor, int]:
        """The acted-on part of ``t`` as (tensor, axis) with the group's axis of length ``axis_length`` (a view
        where the layout allows, for reading: what ``transform`` hands to its ``fn``)."""
        axis = self.axis % t.ndim
        if self.groups > 1:
            shape = tuple(t.shape)
            moved = t.reshape((self.groups, shape[0] // self.groups) + shape[1:]).movedim(0, axis)
            mshape = tuple(moved.shape)
            return moved.reshape(mshape[:axis] + (self.groups * shape[axis],) + mshape[axis + 2 :]), axis
        part = t if self.start is None or self.stop is None else t.narrow(axis, self.start, self.stop - self.start)
        if self.outer == 1 and self.inner == 1:
            return part, axis
        shape = tuple(part.shape)
        n = shape[axis] // (self.outer * self.inner)
        return part.reshape(shape[:axis] + (self.outer, n, self.inner) + shape[axis + 1 :]), axis + 1

    def _transform_part(self, part: Tensor, axis: int, fn: Callable[[Tensor, int], Tensor]) -> Tensor:
        if self.outer == 1 and self.inner == 1:
            return fn(part, axis)
        shape = tuple(part.shape)
        n = shape[axis] // (self.outer * self.inner)
        view = part.reshape(shape[:axis] + (self.outer, n, self.inner) + shape[axis + 1 :])
        return fn(view, axis + 1).reshape(shape)

    def _transform_grouped(self, t: Tensor, axis: int, fn: Callable[[Tensor, int], Tensor]) -> Tensor:
        shape = tuple(t.shape)
        G = self.groups
        split = t.reshape((G, shape[0] // G) + shape[1:])  # group index first; ``axis`` is now axis + 1
        moved = split.movedim(0, axis)  # (..., G, shape[axis], ...) with the group index at ``axis``
        mshape = tuple(moved.shape)
        merged = moved.reshape(mshape[:axis] + (G * shape[axis],) + mshape[axis + 2 :])
        out = fn(merged, axis).reshape(mshape)
        return out.movedim(axis, 0).reshape(shape)


def _check_parts(members: tuple[Member, ...]) -> None:
    """Members that are parts of one tensor must not overlap on a shared axis (their order would matter)."""
    by_tensor: dict[str, list[Member]] = {}
    for m in members:
        by_tensor.setdefault(m.tensor_key, []).append(m)
    for key, parts in by_tensor.items():
        for i, a in enumerate(parts):
            for b in parts[i + 1 :]:
                if a.axis != b.axis:
                    continue
                if a.start is None or b.start is None or a.stop is None or b.stop is None or not (a.stop <= b.start or b.stop <= a.start):
                    raise ValueError(
                        f"members {a.name!r} and {b.name!r} of tensor {key!r} overlap on axis {a.axis}: "
                        "parts of one tensor must be disjoint slices"
                    )


def _second_moment_power(group: Group, power: float) -> float:
    squared = group.second_moment_power(power)
    if squared is None:
        raise TypeError(f"{group!r} has no exact elementwise rule for second moments")
    return squared


#: other axis-wise actions whose ``config()`` names them as ``variant``, by name (:meth:`AxisAction.from_config`)
CONFIG_VARIANTS: dict[str, Any] = {}


class AxisAction(GroupAction):
    """An exact linear action: ``group`` acting on an axis of every member (see module docs).

    Parameters
    ----------
    name, reference, group_name:
        Registry name, paper reference and printable group.
    group:
        ``"general"`` (GL), ``"orthogonal"`` (O), ``"diagonal"`` (positive scaling),
        ``"sign"`` (Z_2) or ``"permutation"`` (S).
    members:
        One :class:`Member` per tensor, in the order ``act`` takes them.
    blocks:
        For matrix groups, the number of independent copies along the axis (heads).
    unit_size:
        For permutations, the size of each permuted unit (head dimension).
    exactness:
        ``"exact"`` or ``"approximate"`` (e.g. BatchNorm input scaling with eps > 0).
    """

    def __init__(
        self,
        name: str,
        group: str,
        members: Sequence[Member],
        *,
        reference: str = "",
        group_name: str | None = None,
        blocks: int | None = None,
        unit_size: int = 1,
        exactness: Exactness = "exact",
    ) -> None:
        if group not in GROUP_TYPES:
            raise ValueError(f"group must be one of {sorted(GROUP_TYPES)}, got {group!r}")
        members = tuple(members)
        if not members or not all(isinstance(m, Member) for m in members):
            raise TypeError("members must be a non-empty sequence of Member")
        if len({m.name for m in members}) != len(members):
            raise ValueError("member names must be unique")
        if all(m.optional for m in members):
            raise ValueError("at least one member must be required")
        check_exactness(exactness)
        if exactness == "data-dependent":
            raise ValueError("AxisAction is not data-dependent: use a data-dependent action class")
        for m in members:
            if group in ("general", "orthogonal") and m.power not in (1, -1):
                raise ValueError(f"member {m.name!r}: {group} groups use power +1 or -1, got {m.power}")
            if group == "sign" and float(m.power) != int(m.power):
                raise ValueError(f"member {m.name!r}: sign flips need an integer power, got {m.power}")
            if m.groups > 1 and group not in ("diagonal", "sign"):
                raise ValueError(f"member {m.name!r}: groups > 1 needs an elementwise group ('diagonal', 'sign'), not {group!r}")
        _check_parts(members)
        if blocks is not None and group not in ("general", "orthogonal"):
            raise ValueError("blocks applies to matrix groups only ('general', 'orthogonal')")
        if unit_size != 1 and group != "permutation":
            raise ValueError("unit_size applies to permutations only")
        self.name = name
        self.group_kind = group
        self.group_type = GROUP_TYPES[group]
        self.group_name = group_name or self._default_group_name(group, blocks)
        self.reference = reference
        self.exactness = exactness
        self.linear = True
        self.members = members
        self.member_names = tuple(m.name for m in members)
        self.optional_members = frozenset(m.name for m in members if m.optional)
        self.blocks = blocks
        self.unit_size = unit_size
        self._example: Callable[[torch.Generator | None, torch.dtype], ExampleProblem] | None = None

    @staticmethod
    def _default_group_name(group: str, blocks: int | None) -> str:
        base = {"general": "GL_h(R)", "orthogonal": "O(h)", "diagonal": "R_{>0}^h", "sign": "Z_2^h", "permutation": "S_h"}[group]
        return base if blocks is None else f"({base})^{blocks}"

    def config(self) -> dict[str, Any]:
        """A plain-data description from which ``AxisAction.from_config`` rebuilds the action."""
        return {
            "name": self.name,
            "group": self.group_kind,
            "members": [asdict(m) for m in self.members],
            "reference": self.reference,
            "group_name": self.group_name,
            "blocks": self.blocks,
            "unit_size": self.unit_size,
            "exactness": self.exactness,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AxisAction:
        """Inverse of :meth:`config` (the example problem is not serialised); a config naming a ``variant``
        (:data:`CONFIG_VARIANTS`) is rebuilt by that class."""
        cfg = dict(config)
        variant = cfg.pop("variant", None)
        if variant is not None:
            return CONFIG_VARIANTS[variant].from_config(config)
        members = [Member(**m) for m in cfg.pop("members")]
        name, group = cfg.pop("name"), cfg.pop("group")
        return cls(name, group, members, **cfg)

    # -- group ------------------------------------------------------------------
    def axis_length(self, params: Params) -> int:
        """Length of the acted-on axis, checked to agree across members."""
        params = self.check_params(params)
        length = None
        for m, p in zip(self.members, params):
            if p is None:
                continue
            n = m.axis_length(p)
            if length is None:
                length, first = n, m.name
            elif n != length:
                raise ValueError(
                    f"{self.name}: member {m.name!r} has axis length {n} but {first!r} has {length}: they cannot share one group"
                )
        assert length is not None
        return length

    def group(self, params: Params) -> Group:
        n = self.axis_length(params)
        if self.group_kind in ("general", "orthogonal"):
            b = self.blocks or 1
            if n % b:
                raise ValueError(f"{self.name}: axis length {n} is not divisible into {b} blocks")
            matrix = GeneralLinear if self.group_kind == "general" else Orthogonal
            return matrix(n // b, blocks=self.blocks)
        if self.group_kind == "permutation":
            if n % self.unit_size:
                raise ValueError(f"{self.name}: axis length {n} is not divisible into units of {self.unit_size}")
            return Permutation(n // self.unit_size, unit_size=self.unit_size)
        return self.group_type(n)

    # -- action -------------------------------------------------------------------
    def _apply(self, g: Tensor, params: Params, sign: int, square: bool = False) -> Params:
        grp = self.group(params)
        current: dict[str, Tensor] = {}  # members that are parts of one tensor are composed
        for m, p in zip(self.members, params):
            if p is None:
                continue
            key = m.tensor_key
            if key in current and current[key].shape != p.shape:
                raise ValueError(f"{self.name}: members of tensor {key!r} were given tensors of different shapes")
            power = _second_moment_power(grp, sign * m.power) if square else sign * m.power
            base = current.get(key, p)

            def fn(part: Tensor, axis: int, power: float = power) -> Tensor:
                return grp.act_on_axis(g, part, axis, power)

            current[key] = m.transform(base, fn)
        return tuple(None if p is None else current[m.tensor_key] for m, p in zip(self.members, params))

    def act(self, g: Tensor, params: Params, data: Any = None) -> Params:
        """g . params: each member transformed on its axis by rho(g)**power."""
        params = self.check_params(params)
        if not is_validated(g):
            self.group(params).validate(g.detach())
        return self._apply(g, params, +1)

    def transport_gradient(self, g: Tensor, grads: Params) -> Params:
        """Gradients transform by the contragredient representation (power -> -power)."""
        grads = self.check_params(grads)
        return self._apply(g, grads, -1)

    def transport_second_moment(self, g: Tensor, moments: Params) -> Params | None:
        """Exact for diagonal, sign and permutation groups; ``None`` for GL and O(h)."""
        moments = self.check_params(moments)
        if self.group(moments).second_moment_power(1) is None:
            return None
        return self._apply(g, moments, -1, square=True)

    @property
    def isometric(self) -> bool:
        """Orthogonal, permutation and sign groups with every member by rho(g) or its contragredient."""
        return self.group_kind in ("orthogonal", "permutation", "sign") and all(abs(m.power) == 1 for m in self.members)

    def acted_axes(self) -> tuple[int | None, ...]:
        return tuple(None if m.groups > 1 else m.axis for m in self.members)

    def norm_statistics(self, group: Group, params: Sequence[Tensor | None]) -> dict[float, Tensor] | None:
        """The group's :meth:`~teleopt.groups.Group.norm_statistic` of every given member's acted-on part,
        summed per power: sum over the members of ||rho(g)^power x||^2 is a function of these alone
        (``None`` entries are left out; ``None`` when the group has no closed form).  Members that are parts
        of one tensor each contribute their own part."""
        stats: dict[float, Tensor] = {}
        for m, x in zip(self.members, params):
            if x is None:
                continue
            stat = group.norm_statistic(*m.part_view(x))
            if stat is None:
                return None
            power = float(m.power)
            stats[power] = stats[power] + stat if power in stats else stat
        return stats

    @property
    def has_infinitesimal_action(self) -> bool:
        """Closed form when the group has one and every member acts on a whole axis or a slice of it
        (no outer/inner views or grouped layouts)."""
        return self.group_type.has_algebra_action and all(m.outer == 1 and m.inner == 1 and m.groups == 1 for m in self.members)

    def infinitesimal_action(self, group: Group, M: Tensor, tensors: Params) -> Params:
        """Each member's d rho(M) on its axis (``power`` picks the representation), zero outside its slice."""
        out: list[Tensor | None] = []
        for member, x in zip(self.members, tensors):
            if x is None:
                out.append(None)
                continue
            axis = member.axis % (x.ndim - 1) + 1
            if member.start is None or member.stop is None:
                out.append(group.algebra_action(M, x, axis, member.power))
                continue
            part = x.narrow(axis, member.start, member.stop - member.start)
            moved = group.algebra_action(M, part, axis, member.power)
            before = torch.zeros_like(x.narrow(axis, 0, member.start))
            after = torch.zeros_like(x.narrow(axis, member.stop, x.shape[axis] - member.stop))
            out.append(torch.cat([before, moved, after], dim=axis))
        return tuple(out)

    def with_example(self, example: Callable[[torch.Generator | None, torch.dtype], ExampleProblem]) -> AxisAction:
        """This action, with ``example(generator, dtype)`` as its example problem (the property tests of a
        user-defined action use it; the registry's actions override :meth:`example`).  A module-level
        function or a partial, not a closure, if the action is to pickle."""
        if not callable(example):
            raise TypeError(f"example must be callable(generator, dtype) -> ExampleProblem, got {type(example).__name__}")
        self._example = example
        return self

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        if self._example is None:
            raise TypeError(f"{self.name}: no example problem was given for this action (AxisAction.with_example)")
        return self._example(generator, dtype)
