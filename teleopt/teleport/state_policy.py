"""What a teleport does to the base optimizer's per-parameter state.

After a teleport the optimizer continues from g . w, and its state must describe
that point consistently (Zhao 2026, Sec. 5.4.1 compares teleporting momentum,
keeping it and resetting it).  Each state tensor gets one policy:

``"transport"``
    the exact covector rule: first moments (SGD momentum, Adam's ``exp_avg``,
    RMSprop's ``grad_avg``) move like gradients, (J^{-1})^T m; elementwise second
    moments (Adam's ``exp_avg_sq``/``max_exp_avg_sq``, Adagrad's ``sum``,
    RMSprop's ``square_avg``) move by the squared rule, which exists only for
    scalings, sign flips and permutations.  Where no exact rule exists (second
    moments under GL, anything under a data-dependent or learned action) the
    *fallback* policy applies and the report says so.
``"reset"``
    the value a fresh optimizer would start from.  Resetting a second moment of a
    bias-corrected optimizer (Adam family) also resets that parameter's first
    moment and step count, since a zero second moment under an old step count
    makes the bias correction blow the next update up by 1/sqrt(1 - beta2)
    (about 30x for beta2 = 0.999).  Adagrad's ``sum`` resets to its
    ``initial_accumulator_value``.
``"keep"``
    leave the tensor as it is.  Step counts and per-step diagnostics are always kept
    unless a reset above applies.

Defaults: transport first and second moments, except Adagrad's ``sum``, which is
kept (benchmarks/teleport_mlp.py, figures in ``docs/performance.md``: the
transported sum makes AdaGrad's next update the same vector as before the
teleport); fallback when no exact rule: reset first moments, keep second moments (a kept second moment has the right
magnitude, a reset one makes an adaptive optimizer's next step a sign step);
RMSprop's momentum buffer, which holds updates rather than covectors, is reset.
A moment whose shape differs from its parameter's (NovoGrad's 0-d per-tensor
``exp_avg_sq``, a factored second moment) has no elementwise rule: the fallback
applies to it and the report counts the decision.
Policies are given per state key (``{"sum": "keep"}``) or per role
(``{"second_moment": "keep"}``) or as one string for all.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Adagrad, Optimizer

from teleopt.sharding import write_
from teleopt.site import Site
from teleopt.teleport.optimizer_model import StateRole, state_role
from teleopt.teleport.transport import TensorKind, transport, transport_

__all__ = ["StatePolicy", "POLICIES", "MovedState"]

POLICIES = ("transport", "reset", "keep")
_ROLES: tuple[StateRole, ...] = ("first_moment", "second_moment", "step", "derived", "update", "unknown")
_DEFAULT: dict[str, str] = {
    "first_moment": "transport",
    "second_moment": "transport",
    "step": "keep",
    "derived": "keep",
    "update": "reset",
    "unknown": "keep",
}
_DEFAULT_FALLBACK: dict[str, str] = {"first_moment": "reset", "second_moment": "keep", "update": "reset", "unknown": "keep"}


def _check_spec(spec: str | Mapping[str, str] | None, what: str) -> dict[str, str]:
    if spec is None:
        return {}
    if isinstance(spec, str):
        if spec not in POLICIES:
            raise ValueError(f"{what} must be one of {POLICIES} or a dict of them, got {spec!r}")
        return {role: spec for role in ("first_moment", "second_moment", "update")}
    if not isinstance(spec, Mapping):
        raise TypeError(f"{what} must be a string or a dict (state key or role -> policy), got {type(spec).__name__}")
    out = {}
    for key, value in spec.items():
        if not isinstance(key, str):
            raise TypeError(f"{what}: keys must be state keys or roles (strings), got {key!r}")
        if value not in POLICIES:
            raise ValueError(f"{what}[{key!r}] must be one of {POLICIES}, got {value!r}")
        out[key] = value
    return out


@dataclass
class _Entries:
    """The state entries of one move: each entry's role, the moments to transport keyed
    ``name\x00key``, their transported values by key and name, and the names without a rule per key."""

    roles: dict[str, dict[str, StateRole]] = field(default_factory=dict)
    by_role: dict[str, dict[str, Tensor]] = field(default_factory=lambda: {"first_moment": {}, "second_moment": {}})
    moved: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    no_rule: dict[str, set[str]] = field(default_factory=dict)

    def of(self, name: str) -> _ParamEntries:
        """The view of parameter ``name``."""
        return _ParamEntries(self, name)


@dataclass(frozen=True)
class _ParamEntries:
    """One parameter's view of :class:`_Entries`."""

    entries: _Entries
    name: str

    @property
    def roles(self) -> dict[str, StateRole]:
        return self.entries.roles[self.name]

    def has_rule(self, key: str) -> bool:
        """Whether entry ``key`` was transported (a moment of the parameter's shape with a rule)."""
        return key in self.entries.moved and self.name not in self.entries.no_rule.get(key, set())

    def moved(self, key: str) -> Tensor:
        return self.entries.moved[key][self.name]


@dataclass
class MovedState:
    """The optimizer state at g . w for the site parameters (not yet written back).

    ``values[name][key]`` is the new tensor (or Python number for int step counts),
    ``decisions[name][key]`` the policy that produced it (``"fallback:reset"`` etc.
    when no exact rule existed).
    """

    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    decisions: dict[str, dict[str, str]] = field(default_factory=dict)


class StatePolicy:
    """Per-state-tensor policies for a teleport (see module docs).

    Parameters
    ----------
    policy:
        ``"transport"``/``"reset"``/``"keep"`` for every moment, or a dict from state
        keys or roles to policies; unspecified entries take the defaults.
    fallback:
        Policies used where ``"transport"`` has no exact rule (same forms).
    """

    def __init__(self, policy: str | Mapping[str, str] | None = None, fallback: str | Mapping[str, str] | None = None) -> None:
        self.policy = _check_spec(policy, "state_policy")
        self.fallback = _check_spec(fallback, "state_fallback")
        for key, value in self.fallback.items():
            if value == "transport":
                raise ValueError(f"state_fallback[{key!r}] cannot be 'transport': it applies where no exact rule exists")
        self._warned: set[str] = set()

    def resolve(self, key: str, role: StateRole, optimizer: Optimizer | None = None) -> str:
        """The policy for state entry ``key`` with ``role`` (of ``optimizer``, for per-optimizer defaults)."""
        if key in self.policy:
            return self.policy[key]
        if role in self.policy:
            return self.policy[role]
        if key == "sum" and isinstance(optimizer, Adagrad):
            return "keep"
        return _DEFAULT[role]

    def resolve_fallback(self, key: str, role: StateRole) -> str:
        """The policy used for ``key`` where transport has no exact rule."""
        return self.fallback.get(key, self.fallback.get(role, _DEFAULT_FALLBACK.get(role, "keep")))

    def describe(self) -> dict[str, str]:
        """Effective policy per role (for reports and docs)."""
        return {role: self.resolve(role, role) for role in _ROLES}

    # ------------------------------------------------------------------------------
    def invertible(self, optimizer: Optimizer, states: Mapping[str, Mapping[str, Any]], like: Mapping[str, Tensor]) -> bool:
        """Whether :meth:`move` will transport or keep every entry of ``states`` on the fast path (no
        reset, whichever rule exists), so that moving by the inverse elements undoes it.

        First moments of their parameter's shape always have the covector rule on the fast path; a
        second moment or a differently shaped moment may have none and then takes the fallback.
        """
        for name, st in states.items():
            for key, value in st.items():
                role = state_role(optimizer, key)
                policy = self.resolve(key, role, optimizer)
                if policy == "reset":
                    return False
                if policy != "transport" or self.resolve_fallback(key, role) != "reset":
                    continue
                has_rule = role == "first_moment" and isinstance(value, Tensor) and value.shape == like[name].shape
                if role in ("first_moment", "second_moment", "update", "unknown") and not has_rule:
                    return False
        return True

    def move(
        self,
        optimizer: Optimizer,
        sites: Sequence[Site],
        elements: Sequence[Tensor],
        states: Mapping[str, Mapping[str, Any]],
        like: Mapping[str, Tensor],
        groups: Mapping[str, dict[str, Any]],
        in_place: bool = False,
    ) -> MovedState:
        """The state of every site parameter at g . w (differentiable in the elements).

        ``states`` maps parameter names to their optimizer state (names without
        state are skipped), ``groups`` parameter names to their param group.  With
        ``in_place``, moments of diagonal sites are moved in the given tensors
        themselves (:func:`~teleopt.teleport.transport.transport_`; the result holds
        the same tensors), others as without it.
        """
        entries = self._sort(optimizer, states, like)
        self._transport_moments(entries, sites, elements, like, in_place)
        result = MovedState()
        for name, st in states.items():
            vals, dec = self._decide(optimizer, st, entries.of(name), groups[name])
            result.values[name] = vals
            result.decisions[name] = dec
        return result

    def _sort(self, optimizer: Optimizer, states: Mapping[str, Mapping[str, Any]], like: Mapping[str, Tensor]) -> _Entries:
        """Every entry's role, and the moments to transport by role (those of another shape have no rule)."""
        entries = _Entries()
        for name, st in states.items():
            entries.roles[name] = {}
            for key, value in st.items():
                role = state_role(optimizer, key)
                entries.roles[name][key] = role
                self._warn_unknown(optimizer, key, role)
                if role in entries.by_role and isinstance(value, Tensor) and self.resolve(key, role, optimizer) == "transport":
                    if name not in like or value.shape == like[name].shape:
                        entries.by_role[role][f"{name}\x00{key}"] = value
                    else:  # a per-tensor norm (NovoGrad's 0-d exp_avg_sq) or a factored moment: no elementwise rule
                        entries.no_rule.setdefault(key, set()).add(name)
        return entries

    def _warn_unknown(self, optimizer: Optimizer, key: str, role: StateRole) -> None:
        """Warn once per key about an entry of no known role that teleports keep as it is."""
        if role != "unknown" or key in self._warned or key in self.policy or self.resolve(key, role, optimizer) != "keep":
            return
        self._warned.add(key)
        warnings.warn(
            f"Teleport: optimizer state entry {key!r} of {type(optimizer).__name__} has no known role; it is "
            "kept unchanged by teleports (pass state_policy={" + repr(key) + ": 'reset'} to reset it)",
            stacklevel=5,
        )

    @staticmethod
    def _transport_moments(
        entries: _Entries, sites: Sequence[Site], elements: Sequence[Tensor], like: Mapping[str, Tensor], in_place: bool
    ) -> None:
        """Transport the sorted moments by the covector and squared rules, one state key at a time (into ``entries``)."""
        kinds: tuple[tuple[str, TensorKind], ...] = (("first_moment", "covector"), ("second_moment", "second_moment"))
        for moment, kind in kinds:
            # transport() works on tensor names; one state key at a time
            keys = {k.split("\x00", 1)[1] for k in entries.by_role[moment]}
            for key in keys:
                values = {k.split("\x00", 1)[0]: v for k, v in entries.by_role[moment].items() if k.endswith("\x00" + key)}
                if in_place and transport_(sites, elements, values, like, kind):
                    out, missing = dict(values), set[str]()
                else:
                    out, missing = transport(sites, elements, values, like, kind)
                entries.moved[key] = out
                entries.no_rule[key] = entries.no_rule.get(key, set()) | missing

    def _decide(
        self, optimizer: Optimizer, st: Mapping[str, Any], entries: _ParamEntries, group: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """One parameter's moved state and the decision per entry (a reset second moment of the Adam
        family restarts its first moment and step too: its bias correction starts again)."""
        vals: dict[str, Any] = {}
        dec: dict[str, str] = {}
        fresh = False
        for key, value in st.items():
            role = entries.roles[key]
            moment = role in ("first_moment", "second_moment") and isinstance(value, Tensor)
            policy, dec[key] = self._policy_of(optimizer, key, role, entries.has_rule(key) if moment else None)
            if dec[key] == "transport":
                vals[key] = entries.moved(key)
            elif policy == "reset":
                vals[key] = self._fresh(optimizer, group, key, value)
                fresh = fresh or (role == "second_moment" and "step" in st and "exp_avg" in st and not isinstance(optimizer, Adagrad))
            else:
                vals[key] = value
        if fresh:
            for key, value in st.items():
                if entries.roles[key] in ("first_moment", "second_moment", "step"):
                    vals[key] = self._fresh(optimizer, group, key, value)
                    if not dec[key].endswith("reset"):
                        dec[key] = "reset:bias-correction"
        return vals, dec

    def _policy_of(self, optimizer: Optimizer, key: str, role: StateRole, has_rule: bool | None) -> tuple[str, str]:
        """The policy applied to entry ``key`` and the decision reported: transport where a moment tensor has a
        rule (``has_rule``; ``None`` for entries that are no moment tensor), else the fallback (moments
        without a rule, update buffers, unknown entries) or keep (steps, diagnostics)."""
        policy = self.resolve(key, role, optimizer)
        if policy != "transport":
            return policy, policy
        if has_rule is not None:
            if has_rule:
                return "transport", "transport"
            fallback = self.resolve_fallback(key, role)
            return fallback, "fallback:" + fallback
        if role in ("update", "unknown"):
            fallback = self.resolve_fallback(key, role)
            return fallback, "fallback:" + fallback
        return "keep", "keep"

    @staticmethod
    def _fresh(optimizer: Optimizer, group: dict[str, Any], key: str, value: Any) -> Any:
        if not isinstance(value, Tensor):
            return type(value)(0) if isinstance(value, (int, float)) else value
        if key == "sum" and isinstance(optimizer, Adagrad):
            return torch.full_like(value, float(group.get("initial_accumulator_value", 0.0)))
        return torch.zeros_like(value)

    @staticmethod
    @torch.no_grad()
    def write(states: Mapping[str, dict[str, Any]], moved: MovedState) -> None:
        """Write moved values into the real optimizer state in place (tensor identity kept)."""
        for name, vals in moved.values.items():
            st = states[name]
            for key, value in vals.items():
                old = st[key]
                if isinstance(old, Tensor) and isinstance(value, Tensor):
                    if value is not old:
                        write_(old, value.detach())  # a sharded (FSDP2) entry takes its shard of the whole value
                else:
                    st[key] = value


def restart_curvature_history(optimizer: Optimizer) -> None:
    """Make an ``LBFGS`` start its curvature history afresh at its next step.

    ``LBFGS`` stores one flat history of steps and gradient differences; after a
    teleport those pairs belong to another point of the orbit, so the next step
    begins again from a scaled gradient step (``n_iter`` 0 is how ``LBFGS`` itself
    starts).  Other optimizers are left alone.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        for state in optimizer.state.values():
            state["n_iter"] = 0
