"""A meta-learned teleport policy: Zhao 2026 (*Symmetry in Neural Networks*), Sec. 5.5, Algorithm 3.

The thesis (and Zhao, Gower, Walters, Yu, ICLR 2024, arXiv:2305.13404, Sec. 6) learns
two meta-optimizers from the gradient: m1 gives an update f_t, m2 a group element g_t,
and the parameters move by

    w_{t+1} = g_t . (w_t + f_t).

What this module implements, and where it departs from the thesis:

* **Coordinate-wise LSTMs** (as in learned optimizers, Andrychowicz et al. 2016): one
  small two-layer LSTM is applied to every coordinate independently, so a policy
  trained on one network size runs on any other.  The thesis uses two-layer LSTMs of
  hidden size 300 on the whole gradient vector (fixed size).
* **m1 input** is the gradient entry (log-magnitude/sign preprocessing).  The update is
  ``f = -base_lr * grad + out_scale * m1(grad)``: the LSTM learns a correction to
  gradient descent (``base_lr=0`` gives the thesis' pure learned update).  In
  ``update="lr"`` mode (the thesis' "LSTM(lr, tele)" baseline) m1 only produces a
  learning rate, ``f = -base_lr * exp(mean m1) * grad``.
* **m2 input**, per Lie algebra coordinate xi of the site's group, is the derivative at
  xi = 0 of the squared gradient norm after teleporting by exp(xi): d/dxi ||grad L(exp(xi) . w)||^2,
  obtained without any forward or backward pass through the loss from the exact
  gradient transport grad L(g . w) = (J^{-1})^T grad L(w) (Zhao 2026, Prop. 4.5.1,
  eq. 4.19).  (The Lie algebra gradient of the loss itself is zero for a symmetry, so
  it carries no information.)  The thesis feeds m2 the raw gradient.
* **Exact parametrisation**: m2's outputs are Lie algebra coordinates and the element is
  ``action.exp(xi)`` of the site's group (``torch.linalg.matrix_exp`` for GL, the
  elementwise exponential for positive scalings), computed in the parameters' dtype,
  so every learned teleport lies exactly in the group and preserves the loss up to
  the rounding of the action itself.
* Output layers start at zero: an untrained policy is gradient descent at ``base_lr``
  with no teleport.

Entry point for ``Teleport``'s search phase: :meth:`TeleportPolicy.elements`.
Standalone use: :meth:`TeleportPolicy.step` (functional) and
:class:`LearnedTeleportOptimizer` (in place on a model).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from teleopt.actions.base import required
from teleopt.site import Site, as_sites, lookup_tensor

__all__ = ["CoordinateLSTM", "LearnedTeleportOptimizer", "TeleportPolicy", "preprocess_gradient"]

UpdateMode = Literal["lstm", "lr", "gd"]
_FORMAT = "teleopt.learned_teleport.TeleportPolicy"
_VERSION = 1


def preprocess_gradient(x: Tensor, p: float = 10.0) -> Tensor:
    """Andrychowicz et al. (2016) preprocessing: (log|x| / p, sign x) or (-1, e^p x) for tiny x; shape (N, 2)."""
    x = x.reshape(-1).to(torch.float32)
    a = x.abs()
    big = a >= math.exp(-p)
    f1 = torch.where(big, torch.log(a.clamp_min(1e-30)) / p, torch.full_like(x, -1.0))
    f2 = torch.where(big, torch.sign(x), math.exp(p) * x)
    return torch.stack([f1, f2], dim=1)


class CoordinateLSTM(nn.Module):
    """A two-layer LSTM applied to every coordinate independently (a batch of N coordinates).

    ``forward(features (N, 2), state) -> (out (N,), state)``; ``state`` is ``None`` at
    the start of a trajectory.  The output layer starts at zero.
    """

    def __init__(self, hidden_size: int = 20, num_layers: int = 2, input_size: int = 2) -> None:
        super().__init__()
        if hidden_size < 1 or num_layers < 1:
            raise ValueError(f"hidden_size and num_layers must be >= 1, got {hidden_size}, {num_layers}")
        self.hidden_size = hidden_size
        self.cells = nn.ModuleList(nn.LSTMCell(input_size if i == 0 else hidden_size, hidden_size) for i in range(num_layers))
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: Tensor, state: list[tuple[Tensor, Tensor]] | None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        x = x.to(self.head.weight.dtype)
        n = x.shape[0]
        if state is None or state[0][0].shape[0] != n:
            z = x.new_zeros(n, self.hidden_size)
            state = [(z, z) for _ in self.cells]
        new_state = []
        h = x
        for cell, (h0, c0) in zip(self.cells, state):
            h, c = cell(h, (h0, c0))
            new_state.append((h, c))
        return self.head(h).squeeze(1), new_state


def _site_params(site: Site, tensors: Mapping[str, Tensor]) -> tuple[Tensor | None, ...]:
    out: list[Tensor | None] = []
    for m in site.members:
        if m is None:
            out.append(None)
        elif m not in tensors:
            raise KeyError(f"site {site.name!r}: tensor {m!r} is not among the given tensors ({', '.join(tensors)})")
        else:
            out.append(tensors[m])
    return tuple(out)


def _norm_gradient(site: Site, params: tuple[Tensor | None, ...], grads: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
    """d/dxi ||grad L(exp(xi) . w)||^2 at xi = 0 for one site, through its action's gradient transport."""
    ref = next(p for p in params if p is not None)
    grad = tuple(
        None if m is None or p is None else (torch.zeros_like(p) if m not in grads or grads[m] is None else grads[m].detach())
        for m, p in zip(site.members, params)
    )
    with torch.enable_grad():
        xi0 = torch.zeros(shape, dtype=ref.dtype, device=ref.device, requires_grad=True)
        moved = site.action.transport_gradient_at(site.action.exp(xi0, params), grad, params)
        squares = [(t**2).sum() for t in moved if t is not None]
        (feat,) = torch.autograd.grad(sum(squares[1:], squares[0]), xi0)
    return feat


def _detached(site: Site, tensors: Mapping[str, Tensor]) -> tuple[Tensor | None, ...]:
    return tuple(None if p is None else p.detach() for p in _site_params(site, tensors))


def _check_site(site: Site) -> None:
    action = site.action
    if action.exactness != "exact" or not action.continuous or not action.has_gradient_transport:
        raise ValueError(
            f"site {site.name!r}: a learned teleport needs an exact, continuous action with gradient transport "
            f"(linear), got {action.name} ({action.exactness}, "
            f"{'continuous' if action.continuous else 'discrete'}, {'linear' if action.linear else 'non-linear'})"
        )


class TeleportPolicy(nn.Module):
    """The meta-learned teleport policy of Zhao 2026, Sec. 5.5, Algorithm 3: w <- g . (w + f).

    Parameters
    ----------
    update:
        ``"lstm"``: f from the update LSTM m1 (a correction to GD at ``base_lr``);
        ``"lr"``: m1 gives only a learning rate (the thesis' LSTM(lr, tele));
        ``"gd"``: f = -base_lr * grad (nothing learned).
    teleport:
        Whether m2 produces a group element per site (``False``: g = identity, the
        thesis' LSTM(update)).
    base_lr:
        The gradient-descent step the learned update corrects (>= 0).
    hidden_size, num_layers:
        Of both coordinate-wise LSTMs.
    update_scale, teleport_scale:
        Multipliers of the LSTM outputs (f and Lie algebra coordinates).
    """

    def __init__(
        self,
        update: UpdateMode = "lstm",
        teleport: bool = True,
        base_lr: float = 3e-4,
        hidden_size: int = 20,
        num_layers: int = 2,
        update_scale: float = 0.01,
        teleport_scale: float = 0.1,
    ) -> None:
        super().__init__()
        if update not in ("lstm", "lr", "gd"):
            raise ValueError(f"update must be 'lstm', 'lr' or 'gd', got {update!r}")
        if not (math.isfinite(base_lr) and base_lr >= 0):
            raise ValueError(f"base_lr must be finite and >= 0, got {base_lr}")
        for name, v in (("update_scale", update_scale), ("teleport_scale", teleport_scale)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v}")
        self.config: dict[str, Any] = {
            "update": update,
            "teleport": bool(teleport),
            "base_lr": float(base_lr),
            "hidden_size": int(hidden_size),
            "num_layers": int(num_layers),
            "update_scale": float(update_scale),
            "teleport_scale": float(teleport_scale),
        }
        self.update_net = CoordinateLSTM(hidden_size, num_layers) if update != "gd" else None
        self.group_net = CoordinateLSTM(hidden_size, num_layers) if teleport else None

    # -- state -------------------------------------------------------------------
    @staticmethod
    def new_state() -> dict[str, Any]:
        """A fresh recurrent state for one trajectory (a dict the policy fills in place)."""
        return {"update": {}, "group": {}}

    @staticmethod
    def detach_state(state: dict[str, Any]) -> None:
        """Cut the recurrent state from the graph (truncated back-propagation, Algorithm 3)."""
        for part in ("update", "group"):
            for key, st in state[part].items():
                state[part][key] = [(h.detach(), c.detach()) for h, c in st]

    # -- m2: the group elements ----------------------------------------------------
    def elements(
        self,
        sites: Sequence[Site],
        tensors: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        state: dict[str, Any] | None = None,
    ) -> list[Tensor]:
        """For each site, the group element g_t in the form its ``GroupAction.act`` accepts.

        ``tensors`` and ``grads`` map qualified tensor names (``site.members``) to the
        current values and loss gradients.  ``state`` is the recurrent state from
        :meth:`new_state` (updated in place; ``None``: a throw-away one).  The element is
        ``action.exp(xi)`` with xi from :meth:`coordinates`, in the parameters' dtype, so
        it is exactly in the group; no loss evaluation and no ascent.  Without teleport
        (``teleport=False``) every element is the identity.  Differentiable in the
        policy's weights (used by :func:`meta_train`).
        """
        sites = as_sites(sites)
        coords = self.coordinates(sites, tensors, grads, state)
        return [site.action.exp(xi, _detached(site, tensors)) for site, xi in zip(sites, coords)]

    def coordinates(
        self,
        sites: Sequence[Site],
        tensors: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        state: dict[str, Any] | None = None,
        features: Sequence[Tensor] | None = None,
    ) -> list[Tensor]:
        """For each site, the Lie algebra coordinates xi of the element (zeros without teleport).

        The group network reads the gradient of ||grad L(exp(xi) . w)||^2 at xi = 0
        (coordinate-wise, so one policy serves any layer width) and outputs xi; this is
        what :class:`PolicySearch` hands to :class:`~teleopt.teleport.Teleport`.
        ``features``, when given, are those gradients per site, computed by the caller
        (``PolicySearch`` takes them from the fast path's reduced gradient statistics,
        one backward over O(units) numbers instead of one through every member); by
        default they are computed here through the action's gradient transport.
        """
        sites = as_sites(sites)
        state = self.new_state() if state is None else state
        if features is not None and len(features) != len(sites):
            raise ValueError(f"features: one tensor per site expected, got {len(features)} for {len(sites)} sites")
        out = []
        for index, site in enumerate(sites):
            _check_site(site)
            params = _detached(site, tensors)
            ref = next(p for p in params if p is not None)
            shape = site.action.coord_shape(params)
            assert shape is not None  # _check_site: a continuous action has Lie algebra coordinates
            if self.group_net is None:
                out.append(torch.zeros(shape, dtype=ref.dtype, device=ref.device))
                continue
            feat = _norm_gradient(site, params, grads, shape) if features is None else features[index].detach().reshape(shape)
            raw, state["group"][site.name] = self.group_net(preprocess_gradient(feat), state["group"].get(site.name))
            out.append((self.config["teleport_scale"] * raw).reshape(shape).to(ref.dtype))
        return out

    # -- m1: the update ----------------------------------------------------------------
    def updates(self, grads: Mapping[str, Tensor], state: dict[str, Any] | None = None) -> dict[str, Tensor]:
        """The update f_t for every tensor in ``grads`` (differentiable in the policy's weights)."""
        state = self.new_state() if state is None else state
        lr = self.config["base_lr"]
        mode = self.config["update"]
        names = list(grads)
        if mode == "gd" or not names:
            return {n: -lr * grads[n].detach() for n in names}
        flat = torch.cat([grads[n].detach().reshape(-1) for n in names])
        assert self.update_net is not None  # built for every mode but "gd"
        raw, state["update"]["all"] = self.update_net(preprocess_gradient(flat), state["update"].get("all"))
        out: dict[str, Tensor] = {}
        if mode == "lr":
            scale = torch.exp(raw.mean())  # a learned multiplier of base_lr, 1 untrained
            return {n: -lr * scale.to(grads[n].dtype) * grads[n].detach() for n in names}
        i = 0
        for n in names:
            g = grads[n].detach()
            k = g.numel()
            out[n] = -lr * g + self.config["update_scale"] * raw[i : i + k].reshape(g.shape).to(g.dtype)
            i += k
        return out

    def step(
        self,
        sites: Sequence[Site],
        tensors: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        state: dict[str, Any] | None = None,
    ) -> dict[str, Tensor]:
        """One step of Algorithm 3, w <- g . (w + f), out of place; returns the new tensors by name.

        Tensors without a gradient in ``grads`` get no update f (they may still be
        moved by a teleport).
        """
        state = self.new_state() if state is None else state
        f = self.updates({n: g for n, g in grads.items() if g is not None}, state)
        new = {n: (t + f[n] if n in f else t) for n, t in tensors.items()}
        elems = self.elements(sites, tensors, grads, state)  # g_t from grad_t, as in the thesis
        for site, g in zip(as_sites(sites), elems):
            if self.group_net is None:
                continue
            moved = site.action.act(g, _site_params(site, new))
            for m, v in zip(site.members, moved):
                if m is not None:
                    new[m] = required(v, m)
        return new

    # -- weights-only persistence --------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Save config and weights (plain data and tensors: loadable with ``weights_only=True``)."""
        torch.save({"format": _FORMAT, "version": _VERSION, "config": dict(self.config), "state_dict": self.state_dict()}, path)

    @classmethod
    def load(cls, path: str | os.PathLike, map_location: Any = None) -> TeleportPolicy:
        """Load a policy written by :meth:`save`; ``ValueError`` naming the problem for a bad file."""
        try:
            blob = torch.load(path, map_location=map_location, weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:  # unpickling errors, truncated files
            raise ValueError(f"{os.fspath(path)}: not a readable teleopt policy file ({type(exc).__name__}: {exc})") from exc
        if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
            raise ValueError(f"{os.fspath(path)}: not a TeleportPolicy file (format tag {_FORMAT!r} missing)")
        if blob.get("version") != _VERSION:
            raise ValueError(f"{os.fspath(path)}: unsupported TeleportPolicy file version {blob.get('version')!r}")
        config, sd = blob.get("config"), blob.get("state_dict")
        if not isinstance(config, dict) or not isinstance(sd, dict):
            raise ValueError(f"{os.fspath(path)}: 'config' and 'state_dict' must be dicts")  # noqa: TRY004 (a bad file)
        try:
            policy = cls(**config)
        except TypeError as exc:
            raise ValueError(f"{os.fspath(path)}: bad config {config!r} ({exc})") from exc
        try:
            policy.load_state_dict(sd)
        except RuntimeError as exc:
            raise ValueError(f"{os.fspath(path)}: weights do not match the config ({exc})") from exc
        return policy


class LearnedTeleportOptimizer:
    """Run a :class:`TeleportPolicy` in place on a model: ``w <- g . (w + f)`` on every step.

    ``step()`` reads ``.grad`` of the model's parameters (compute them with
    ``loss.backward()`` first), applies the policy under ``no_grad`` and writes the
    new values with ``copy_``.  The recurrent state lives in ``self.state``.
    """

    def __init__(self, model: nn.Module, sites: Site | Sequence[Site], policy: TeleportPolicy) -> None:
        if not isinstance(policy, TeleportPolicy):
            raise TypeError(f"policy must be a TeleportPolicy, got {type(policy).__name__}")
        self.model = model
        self.sites = as_sites(sites)
        self.policy = policy
        self.params = dict(model.named_parameters())
        for site in self.sites:
            if policy.group_net is not None:
                _check_site(site)
            for m in site.tensor_names:
                lookup_tensor(model, m)
        self.state = policy.new_state()

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        tensors = {n: p.detach() for n, p in self.params.items()}
        grads = {n: p.grad for n, p in self.params.items() if p.grad is not None}
        new = self.policy.step(self.sites, tensors, grads, self.state)
        for n, p in self.params.items():
            p.copy_(new[n])
