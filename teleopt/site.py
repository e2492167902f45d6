"""Sites: group actions bound to the named tensors of a model.

A site is where a symmetry lives in a concrete ``nn.Module``: a
:class:`~teleopt.actions.base.GroupAction` plus, for each of its members, the
fully qualified name of a parameter or buffer in ``model.state_dict()``
(Zhao et al. 2024b, Prop. 4.1: a symmetry of a subnetwork extends to the whole network by
acting on the subnetwork's parameters only).  Sites act in place with ``copy_``, so
``nn.Parameter`` identity and optimizer references survive a teleport, and a
transformed ``state_dict`` loads into a fresh instance of the original model (no
hidden state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from teleopt.actions.axis import CONFIG_VARIANTS, AxisAction
from teleopt.actions.base import GroupAction, Params, required

__all__ = ["Site", "as_sites", "lookup_tensor"]


def lookup_tensor(model: nn.Module, name: str) -> Tensor:
    """The parameter or buffer of ``model`` with fully qualified ``name``."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        pass
    try:
        return model.get_buffer(name)
    except AttributeError:
        raise KeyError(f"{type(model).__name__} has no parameter or buffer named {name!r}") from None


@dataclass
class Site:
    """A group action bound to named parameters/buffers of a model.

    Parameters
    ----------
    action:
        The group action (registered, detected or learned).
    members:
        For each of ``action.member_names``, the qualified tensor name in the model
        (``None`` for an absent optional member).
    name:
        A readable identifier (defaults to the action name and first member).
    data_input:
        For data-dependent actions: the qualified name of the module whose input is
        the batch the symmetry holds on.
    info:
        Free-form plain data describing the site (axes, heads, block structure).
    """

    action: GroupAction
    members: tuple[str | None, ...]
    name: str = ""
    data_input: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.action, GroupAction):
            raise TypeError(f"Site.action must be a GroupAction, got {type(self.action).__name__}")
        if isinstance(self.members, str) or not isinstance(self.members, Sequence):
            raise TypeError("Site.members must be a sequence of tensor names")
        self.members = tuple(self.members)
        if len(self.members) != len(self.action.member_names):
            raise ValueError(
                f"site for {self.action.name} needs {len(self.action.member_names)} members "
                f"({', '.join(self.action.member_names)}), got {len(self.members)}"
            )
        for role, m in zip(self.action.member_names, self.members):
            if m is None and role not in self.action.optional_members:
                raise ValueError(f"site for {self.action.name}: required member {role!r} is None")
            if m is not None and not isinstance(m, str):
                raise TypeError(f"site member names must be strings, got {m!r}")
        if not self.name:
            first = next(m for m in self.members if m is not None)
            self.name = f"{self.action.name}@{first}"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The qualified names of the present members."""
        return tuple(m for m in self.members if m is not None)

    def tensors(self, model: nn.Module) -> Params:
        """The member tensors of ``model`` (the live parameters/buffers, not copies)."""
        return tuple(None if m is None else lookup_tensor(model, m) for m in self.members)

    def act(self, model: nn.Module, g: Tensor, data: Any = None) -> Params:
        """The transformed member values (out of place; the model is not changed)."""
        return self.action.act(g, tuple(None if t is None else t.detach() for t in self.tensors(model)), data)

    @torch.no_grad()
    def apply_(self, model: nn.Module, g: Tensor, data: Any = None) -> None:
        """Act on the model in place with ``copy_`` (parameter identity is preserved)."""
        live = self.tensors(model)
        new = self.act(model, g, data)
        for t, v in zip(live, new):
            if t is not None:
                t.copy_(required(v))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (names, not tensors) that :meth:`from_dict` turns back into a site."""
        if isinstance(self.action, AxisAction) or type(self.action).__name__ in CONFIG_VARIANTS:
            action: Any = {"axis_action": self.action.config()}  # type: ignore[attr-defined]
        else:
            action = {"registered": self.action.name}
        return {"action": action, "members": list(self.members), "name": self.name, "data_input": self.data_input, "info": dict(self.info)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Site:
        """Rebuild a site from :meth:`to_dict` output (registered actions are looked up by name)."""
        spec = data["action"]
        if "axis_action" in spec:
            action: GroupAction = AxisAction.from_config(spec["axis_action"])
        else:
            from teleopt.registry import get_action

            action = get_action(spec["registered"])
        return cls(action, tuple(data["members"]), data.get("name", ""), data.get("data_input"), dict(data.get("info", {})))


def as_sites(sites: Site | Sequence[Site]) -> tuple[Site, ...]:
    """One site or a sequence of sites as a tuple, with a ``TypeError`` for anything else."""
    if isinstance(sites, Site):
        return (sites,)
    if isinstance(sites, (str, bytes)) or not isinstance(sites, Sequence):
        raise TypeError(f"sites must be a Site or a sequence of Sites, got {type(sites).__name__}")
    for site in sites:
        if not isinstance(site, Site):
            raise TypeError(f"sites must contain Site objects, got {type(site).__name__}")
    return tuple(sites)
