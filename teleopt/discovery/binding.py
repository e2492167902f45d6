"""Binding a learned action to a matching subnetwork of a larger model (Zhao et al. 2024b, Sec. 4).

Zhao et al. 2024b, Prop. 4.1: if L(theta, X) = j(theta_1, f(theta_2, h(theta_1, X)), X), a
symmetry a_S of the subnetwork f (acting on theta_2, reading the subnetwork's input
S = h(theta_1, X)) induces the symmetry a'_X(g, theta) = (theta_1, a_{h(theta_1, X)}(g, theta_2))
of the whole network.  Corollary 4.3: a block of consecutive layers is such an f
(deeper networks); Corollary 4.2: the first h' units of a wider two-layer block are
(wider networks).  So a learned action binds to a model as a
:class:`~teleopt.site.Site` whose members are the block's tensors (whole, or slices
for Cor. 4.2) and whose ``data_input`` is the module that receives S: Teleport's
general path (and :meth:`Site.act`) passes that module's input as ``data``.

The learned action must be a symmetry of f itself, not only of a loss built from
it: learn it on the block's output (``target="output"`` in
:mod:`teleopt.discovery.problems`), with data of the batch size it will see.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from teleopt.actions.base import ExampleProblem, GroupAction, Params, required
from teleopt.discovery.action import LearnedAction
from teleopt.discovery.group import LearnedLieGroup
from teleopt.functional import module_input
from teleopt.site import Site, lookup_tensor

__all__ = ["bind", "SubnetworkAction", "module_input"]

Slice = tuple[int, int, int]


def _check_slice(value: Any, member: str, shape: tuple[int, ...]) -> Slice:
    if not (isinstance(value, (tuple, list)) and len(value) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise TypeError(f"slice for member {member!r} must be (axis, start, stop) ints, got {value!r}")
    axis, start, stop = value
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"slice for member {member!r}: axis {axis} out of range for shape {shape}")
    axis %= len(shape)
    if not 0 <= start < stop <= shape[axis]:
        raise ValueError(f"slice for member {member!r}: need 0 <= start < stop <= {shape[axis]}, got ({start}, {stop})")
    return (axis, start, stop)


class SubnetworkAction(GroupAction):
    """A learned action on slices of larger tensors: Zhao et al. 2024b, Cor. 4.2 (narrow layer -> wide layer).

    ``slices`` gives, per member, ``(axis, start, stop)`` (or ``None`` for the whole
    tensor); ``full_shapes`` the shapes of the larger tensors.  The learned action
    acts on the slices, which must have its learned shapes, and leaves the rest of
    every tensor unchanged.
    """

    exactness = "data-dependent"
    linear = False
    group_type = LearnedLieGroup

    def __init__(self, action: LearnedAction, full_shapes: Sequence[Sequence[int]], slices: Sequence[Slice | None]) -> None:
        if not isinstance(action, LearnedAction):
            raise TypeError(f"SubnetworkAction wraps a LearnedAction, got {type(action).__name__}")
        full = tuple(tuple(int(d) for d in s) for s in full_shapes)
        if len(full) != len(action.member_names) or len(slices) != len(full):
            raise ValueError(f"need one full shape and one slice per member ({', '.join(action.member_names)})")
        checked: list[Slice | None] = []
        for name, shape, learned, sl in zip(action.member_names, full, action.spec.param_shapes, slices):
            if sl is None:
                narrow = shape
            else:
                sl = _check_slice(sl, name, shape)
                narrow = tuple(sl[2] - sl[1] if i == sl[0] else d for i, d in enumerate(shape))
            if narrow != learned:
                raise ValueError(f"member {name!r}: the slice has shape {narrow}, but the learned action acts on shape {learned}")
            checked.append(sl)
        self.action, self.full_shapes, self.slices = action, full, tuple(checked)
        self.name = f"{action.name}@subnetwork"
        self.group_name = action.group_name
        self.reference = "Zhao et al. 2024b, Prop. 4.1, Cor. 4.2 (learned action on a sub-block)"
        self.member_names = action.member_names
        self.optional_members = frozenset()

    def _checked(self, params: Params) -> tuple[Tensor, ...]:
        """The members (all required) as tensors, checked against the bound full shapes."""
        full = tuple(required(p, name) for name, p in zip(self.member_names, self.check_params(params)))
        for name, shape, p in zip(self.member_names, self.full_shapes, full):
            if tuple(p.shape) != shape:
                raise ValueError(f"{self.name}: member {name!r} has shape {tuple(p.shape)}, the site was bound to shape {shape}")
        return full

    def _slice(self, full: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return tuple(p if sl is None else p.narrow(sl[0], sl[1], sl[2] - sl[1]) for p, sl in zip(full, self.slices))

    def _narrow(self, params: Params) -> tuple[Tensor, ...]:
        return self._slice(self._checked(params))

    def group(self, params: Params) -> LearnedLieGroup:
        return self.action.group(self._narrow(params))

    def act(self, g: Tensor, params: Params, data: Any = None) -> Params:
        """The learned action on the slices; everything outside them is returned unchanged."""
        full = self._checked(params)
        moved = self.action.act(g, self._slice(full), data)
        out: list[Tensor | None] = []
        for name, p, new, sl in zip(self.member_names, full, moved, self.slices):
            if sl is None:
                out.append(new)
                continue
            axis, start, stop = sl
            size = p.shape[axis]
            out.append(torch.cat([p.narrow(axis, 0, start), required(new, name), p.narrow(axis, stop, size - stop)], dim=axis))
        return tuple(out)

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        """The learned action's example embedded in random larger tensors; ``fn`` reads the slices."""
        inner = self.action.example(generator, dtype)
        params: list[Tensor | None] = []
        for name, shape, sl, small in zip(self.member_names, self.full_shapes, self.slices, inner.params):
            if sl is None:
                params.append(small)
                continue
            big = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
            axis, start, stop = sl
            index = [slice(None)] * len(shape)
            index[axis] = slice(start, stop)
            big[tuple(index)] = required(small, name)
            params.append(big)
        return ExampleProblem(tuple(params), inner.data, lambda p, d: inner.fn(self._narrow(p), d), inner.functional)


def _tensor_names(action: LearnedAction, members: Sequence[str] | Mapping[str, str]) -> tuple[str, ...]:
    """The tensor name of each learned member, in ``action.member_names`` order."""
    roles = action.member_names
    if isinstance(members, Mapping):
        unknown = sorted(set(members) - set(roles))
        if unknown or len(members) != len(roles):
            raise ValueError(f"members must map each of {list(roles)} to a tensor name, got keys {sorted(members)}")
        return tuple(members[r] for r in roles)
    if isinstance(members, (str, bytes)) or not isinstance(members, Sequence):
        raise TypeError(f"members must be a sequence of tensor names or a mapping, got {type(members).__name__}")
    if len(members) != len(roles):
        raise ValueError(f"{action.name} acts on {len(roles)} tensors ({', '.join(roles)}), got {len(members)} names")
    return tuple(members)


def _member_shape(model: nn.Module, role: str, tensor_name: Any) -> tuple[int, ...]:
    if not isinstance(tensor_name, str):
        raise TypeError(f"tensor name for member {role!r} must be a string, got {tensor_name!r}")
    try:
        return tuple(lookup_tensor(model, tensor_name).shape)
    except KeyError:
        raise ValueError(f"member {role!r}: {type(model).__name__} has no parameter or buffer named {tensor_name!r}") from None


def _check_learned_shapes(action: LearnedAction, names: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> None:
    """Without slices every tensor must have exactly the learned shape."""
    for role, tensor_name, shape, learned in zip(action.member_names, names, shapes, action.spec.param_shapes):
        if shape != learned:
            raise ValueError(
                f"member {role!r} -> {tensor_name!r} has shape {shape}, but {action.name} acts on shape {learned}; "
                "for a wider layer pass slices={member: (axis, start, stop)} (Zhao et al. 2024b, Cor. 4.2)"
            )


def bind(
    action: LearnedAction,
    model: nn.Module,
    members: Sequence[str] | Mapping[str, str],
    data_input: str,
    *,
    slices: Mapping[str, Slice] | None = None,
    name: str = "",
) -> Site:
    """A :class:`~teleopt.site.Site` of ``action`` on the matching block of ``model`` (Zhao et al. 2024b, Prop. 4.1).

    Parameters
    ----------
    members:
        Qualified tensor names in ``model.state_dict()``, one per learned member (in
        ``action.member_names`` order, or a mapping member -> tensor name).
    data_input:
        Qualified name of the module whose input is the data the action reads (the
        first layer of the block).
    slices:
        For a block inside wider layers (Cor. 4.2): member -> ``(axis, start, stop)``.
        Without slices every tensor must have exactly the learned shape.

    Raises ``ValueError`` naming the member for unknown tensors or modules and for
    shape mismatches.
    """
    if not isinstance(action, LearnedAction):
        raise TypeError(f"bind takes a LearnedAction, got {type(action).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    roles = action.member_names
    names = _tensor_names(action, members)
    shapes = [_member_shape(model, role, tensor_name) for role, tensor_name in zip(roles, names)]
    modules = dict(model.named_modules())
    if not isinstance(data_input, str) or data_input not in modules:
        raise ValueError(f"data_input {data_input!r} is not a module of {type(model).__name__}")
    slices = dict(slices or {})
    unknown = sorted(set(slices) - set(roles))
    if unknown:
        raise ValueError(f"slices given for unknown members {unknown}; members are {list(roles)}")
    if slices:
        bound: GroupAction = SubnetworkAction(action, shapes, [slices.get(r) for r in roles])
    else:
        _check_learned_shapes(action, names, shapes)
        bound = action
    info = {
        "learned_action": action.name,
        "reference": "Zhao et al. 2024b, Prop. 4.1, Cor. 4.2-4.3",
        "slices": {k: list(v) for k, v in slices.items()},
    }
    return Site(bound, names, name or f"{action.name}@{names[0]}", data_input, info)
