"""Ensembles built from group actions, and the random-transformation baselines: Zhao et al. 2023, Sec. 6, App. I.

A trained model theta and random group elements g_1, ..., g_K near the identity
give K models g_k . theta without any retraining (Zhao et al. 2023, App. I).  For an
*exact* symmetry all of them compute the model's function, so the ensemble is the
model itself; the ensemble becomes interesting for a *data-dependent* action,
which keeps the output only on the batch it is built on and lets the members differ
elsewhere.  The paper acts on the last two fully connected layers (U, V) of a
LeakyReLU network with

    g . (U, V) = (U pi(g, H), g V),   pi(g, H) = sigma(H) sigma(g H)^+      (App. I, eq. 112)

where H = V X are the hidden pre-activations of the *training set* X and ^+ is
the pseudo-inverse.  That is the least-squares action of Zhao 2026, eq. 4.16
(``data_dependent_gl_lstsq``): when sigma(g H) has full rank its least-squares
W2 is exactly U pi(g, H).  With more training samples than hidden units the new U
is only the least-squares best fit, so even on the training set the members
reproduce the model only approximately, with an error that grows with ||g - I||.

Elements are g = exp(eps M) with M the library's random Lie algebra coordinates
(``GroupAction.random_element(scale=eps)``; for GL_h, M has N(0, 1/h) entries, so
||M|| is about 2 whatever h).  The paper writes g = I + eps M, which agrees to
first order in eps and can be singular at large eps; exp(eps M) is always invertible.

The four baselines of App. I transform the same layers with the same g but
without the symmetry: ``g_inverse`` (U g^-1, g V) (the linear GL action, a symmetry
only for a linear activation), ``random`` (U g', g V) with g' = exp(eps D) for a
random diagonal D, ``shuffle`` (U pi'(g, H), g V) with the entries of pi(g, H)
randomly permuted, and ``perm_interp`` (U A^-1, A V) with
A = (I + eps/2 (I + S)) / (1 + eps) for a random permutation matrix S other than I.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

from teleopt.analysis.orbits import _as_inputs, _as_sites, sample_orbit
from teleopt.functional import FunctionalModel
from teleopt.groups import GeneralLinear, Orthogonal
from teleopt.site import Site, lookup_tensor

__all__ = ["ParameterEnsemble", "GroupEnsemble", "BaselineEnsemble", "BASELINES", "COMBINE"]

Combine = Literal["probabilities", "mean"]
COMBINE: tuple[str, ...] = ("probabilities", "mean")
"""How members' outputs are combined: see :class:`ParameterEnsemble`."""

BASELINES: tuple[str, ...] = ("g_inverse", "random", "shuffle", "perm_interp")
"""The random-transformation baselines of Zhao et al. 2023, App. I (see :class:`BaselineEnsemble`)."""

# roles (writer weight, writer bias, reader weight) of two-layer GL actions, by member names
_TWO_LAYER_ROLES: dict[tuple[str, ...], tuple[int, int, int]] = {("W1", "b1", "W2"): (0, 1, 2), ("U", "V", "b"): (1, 2, 0)}


class ParameterEnsemble(nn.Module):
    """One architecture evaluated at several parameter points, outputs combined (Zhao et al. 2023, App. I).

    Parameters
    ----------
    model:
        The model; the ensemble keeps a deep copy, so later training of ``model``
        does not change it.
    points:
        One dict per member from qualified ``state_dict`` names to tensors (all
        with the same names); names missing take the model's values.
    combine:
        ``"probabilities"`` (default): the output is log((1/K) sum_k softmax(f_k(x)))
        over dimension 1 (torch's class dimension), the log of the mixture of the
        members' predictive distributions.  It is a valid logit vector:
        ``F.cross_entropy`` and ``argmax`` apply unchanged, and its log-loss is at
        most the members' average log-loss (Jensen's inequality).  Averaging
        logits instead is the geometric mean of the probabilities, dominated by
        the most confident member.  ``"mean"``: the plain average of the outputs
        (regression, or logit averaging when wanted).  For an exact symmetry both
        give the model's own prediction (``"probabilities"``: its log-softmax).

    ``size`` is the number of members K.  Members are stored as stacked buffers, so ``.to()``, ``state_dict()`` and
    ``deepcopy`` carry them.  Evaluate in eval mode: in train mode BatchNorm
    statistics of the ensemble's copy update member by member.
    """

    def __init__(self, model: nn.Module, points: Sequence[Mapping[str, Tensor]], combine: Combine = "probabilities") -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if combine not in COMBINE:
            raise ValueError(f"combine must be one of {COMBINE}, got {combine!r}")
        points = list(points)
        if not points:
            raise ValueError("an ensemble needs at least one member point")
        names = tuple(points[0])
        for k, point in enumerate(points):
            if not isinstance(point, Mapping):
                raise TypeError(f"member {k} must be a mapping from tensor names to tensors, got {type(point).__name__}")
            if set(point) != set(names):
                raise ValueError(f"member {k} has tensors {sorted(point)}, member 0 has {sorted(names)}")
        self.model = copy.deepcopy(model)
        self.combine = combine
        self.member_names = names
        self.size = len(points)
        for i, name in enumerate(names):
            live = lookup_tensor(self.model, name)
            values = [p[name].detach() for p in points]
            for k, v in enumerate(values):
                if v.shape != live.shape:
                    raise ValueError(f"member {k}: {name!r} has shape {tuple(v.shape)}, the model's has {tuple(live.shape)}")
            self.register_buffer(f"member_{i}", torch.stack(values).to(live.dtype))

    def member_point(self, k: int) -> dict[str, Tensor]:
        """Member k's tensors by qualified name (a ``functional_call`` dict)."""
        return {name: getattr(self, f"member_{i}")[k] for i, name in enumerate(self.member_names)}

    def member_outputs(self, *inputs: Any) -> Tensor:
        """Every member's output on ``inputs``, stacked: shape (K, *output shape)."""
        outs = []
        for k in range(self.size):
            out = functional_call(self.model, self.member_point(k), inputs, strict=False)
            if not isinstance(out, Tensor):
                raise TypeError(f"ensembles need a model returning a tensor, got {type(out).__name__}")
            outs.append(out)
        return torch.stack(outs)

    def combine_outputs(self, outputs: Tensor) -> Tensor:
        """Combine stacked member outputs (K, ...) as ``combine`` says."""
        if self.combine == "mean":
            return outputs.mean(0)
        if outputs.ndim < 3:
            raise ValueError(
                "combine='probabilities' needs outputs of shape (batch, classes, ...); "
                f"got member outputs of shape {tuple(outputs.shape[1:])}: use combine='mean'"
            )
        return torch.logsumexp(torch.log_softmax(outputs, dim=2), dim=0) - math.log(outputs.shape[0])

    def forward(self, *inputs: Any) -> Tensor:
        """The combined prediction (see ``combine``)."""
        return self.combine_outputs(self.member_outputs(*inputs))

    @torch.no_grad()
    def member_deviation(self, *inputs: Any) -> Tensor:
        """Per member, ||f_k(x) - f(x)|| / ||f(x)|| on ``inputs`` (Frobenius norms over the batch), float64.

        On the reference batch of a data-dependent ensemble this is the action's
        residual there (0 up to round-off where the action is exact); on new data it
        measures how far the members moved from the model.
        """
        base = self.model(*inputs).to(torch.float64)
        outs = self.member_outputs(*inputs).to(torch.float64)
        diff = (outs - base).flatten(1).norm(dim=1)
        return diff / base.norm().clamp_min(torch.finfo(torch.float64).tiny)

    def extra_repr(self) -> str:
        return f"members={self.size}, combine={self.combine!r}, tensors={list(self.member_names)}"


def _check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def _check_members(members: int) -> int:
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise ValueError(f"members must be a positive int, got {members!r}")
    return members


class GroupEnsemble(ParameterEnsemble):
    """The group-action ensemble of Zhao et al. 2023, Sec. 6 / App. I: members g_k . theta, g_k = exp(eps M_k).

    Parameters
    ----------
    model:
        The trained model (not modified; the ensemble keeps a copy).
    sites:
        One site or several on disjoint tensors (``teleopt.find_symmetries``, a
        hand-made :class:`~teleopt.site.Site`, or the paper's
        ``data_dependent_gl_lstsq(strict=False)`` on the last hidden layer).
    eps:
        Size of the random Lie algebra coordinates (0 gives the model itself).
    members:
        Number of members K.
    reference:
        The model inputs of the batch data-dependent sites are built on: the
        training data, as in the paper.  Required for data-dependent sites.
    generator:
        Source of the random elements (drawn member by member, site by site).
    combine:
        ``"probabilities"`` or ``"mean"`` (see :class:`ParameterEnsemble`).

    What holds:

    * exact sites: every member computes the model's function, so the ensemble
      equals the model on every input for every ``eps`` (up to round-off);
    * data-dependent sites, on the reference batch: the members reproduce the
      model's output exactly where the action is exact on that batch
      (``data_dependent_gl``: at most n + 1 samples; ``data_dependent_gl_lstsq``: at
      most h samples; ``nonlinear_gl``: one sample), otherwise only as the
      least-squares best fit (the paper's setting: a training set larger than the
      hidden width); ``member_deviation(reference)`` reports the residual;
    * data-dependent sites, on new data: only approximately, with a deviation of
      order eps (Zhao et al. 2023, Prop. 4.2 bounds the members' Lipschitz constants).

    Attributes ``eps``, ``sites`` and ``elements`` (per member, one element per site)
    record how the members were drawn.
    """

    def __init__(
        self,
        model: nn.Module,
        sites: Site | Sequence[Site],
        eps: float,
        members: int = 8,
        *,
        reference: Any = None,
        generator: torch.Generator | None = None,
        combine: Combine = "probabilities",
    ) -> None:
        eps = _check_eps(eps)
        members = _check_members(members)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sample = sample_orbit(model, sites, members, scale=eps, generator=generator, inputs=reference)
        if caught:  # one summary instead of one warning per member (e.g. least-squares residuals of eq. 4.16)
            warnings.warn(
                f"{len(caught)} warning(s) while building {members} members; the first: {caught[0].message}",
                caught[0].category,
                stacklevel=2,
            )
        super().__init__(model, sample.points, combine)
        self.eps = eps
        self.sites = sample.sites
        self.elements = sample.elements


def _two_layer(site: Site, model: nn.Module) -> tuple[str, str | None, str, Tensor, Tensor | None, Tensor]:
    roles = _TWO_LAYER_ROLES.get(tuple(site.action.member_names))
    if roles is None:
        raise ValueError(
            f"site {site.name!r} ({site.action.name}, members {site.action.member_names}): the App. I baselines "
            "need a two-layer site with members (W1, b1, W2) or (U, V, b)"
        )
    w1, b1, w2 = (site.members[i] for i in roles)
    assert w1 is not None and w2 is not None  # required members of both layouts
    W1 = lookup_tensor(model, w1).detach()
    B1 = None if b1 is None else lookup_tensor(model, b1).detach()
    W2 = lookup_tensor(model, w2).detach()
    return w1, b1, w2, W1, B1, W2


def _pi(g: Tensor, Z: Tensor, activation: Any) -> Tensor:
    """pi(g, H) = sigma(H) sigma(g H)^+ of Zhao et al. 2023, eq. 112, for pre-activations Z = H^T (samples as rows)."""
    # U pi sigma(g H) ~ U sigma(H): in rows, sigma(Z g^T) pi^T ~ sigma(Z), solved by least squares
    return torch.linalg.lstsq(activation(Z @ g.T), activation(Z)).solution.T


def _check_gl_site(site: Site, params: tuple[Tensor | None, ...]) -> None:
    group = site.action.group(params)
    if not isinstance(group, (GeneralLinear, Orthogonal)) or group.blocks is not None:
        raise ValueError(f"site {site.name!r}: the App. I baselines need a GL_h or O(h) site, got {group!r}")


def _shuffle_inputs(model: nn.Module, site: Site, reference: Any, W1: Tensor, B1: Tensor | None) -> tuple[Tensor, Any]:
    """(Z, sigma) of the ``shuffle`` baseline: the hidden pre-activations Z = H^T of ``reference`` and the activation."""
    activation = getattr(site.action, "activation", None)
    if activation is None:
        raise ValueError(f"site {site.name!r} ({site.action.name}) has no activation: the shuffle baseline needs sigma")
    args = _as_inputs(reference)
    if args is None:
        raise ValueError("the shuffle baseline needs reference=<the model inputs pi(g, H) is built on>")
    if site.data_input is None:
        raise ValueError(f"site {site.name!r} names no data_input module: the shuffle baseline needs H")
    X = FunctionalModel(model, None).module_input({}, (args, None), site.data_input).detach().to(W1.dtype)
    return (X @ W1.T if B1 is None else X @ W1.T + B1), activation


class _Layers(NamedTuple):
    """The layers a baseline transforms: writer weight W1 (h rows), reader weight W2, and for
    ``shuffle`` the pre-activations Z and the activation sigma."""

    W1: Tensor
    W2: Tensor
    Z: Tensor | None = None
    activation: Any = None


def _g_inverse(g: Tensor, layers: _Layers, eps: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """(W2 g^-1, g W1): the linear GL action."""
    return g, torch.linalg.solve(g.mT, layers.W2.mT).mT


def _random_diagonal(g: Tensor, layers: _Layers, eps: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """(W2 g', g W1) with g' = exp(eps D), D diagonal with N(0, 1) entries."""
    d = torch.randn(layers.W1.shape[-2], generator=generator, dtype=torch.float64).to(layers.W1.dtype)
    return g, layers.W2 * torch.exp(eps * d)


def _shuffled_pi(g: Tensor, layers: _Layers, eps: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """(W2 pi'(g, H), g W1) with pi' the entries of pi(g, H) randomly permuted."""
    assert layers.Z is not None  # _shuffle_inputs builds it for the shuffle baseline
    h = layers.W1.shape[-2]
    pi = _pi(g, layers.Z, layers.activation)
    order = torch.randperm(h * h, generator=generator)
    return g, layers.W2 @ pi.reshape(-1)[order.to(pi.device)].reshape(h, h)


def _permutation_interpolation(g: Tensor, layers: _Layers, eps: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """(W2 A^-1, A W1) with A = (I + eps/2 (I + S)) / (1 + eps), S a random permutation other than I (g unused)."""
    h, W1 = layers.W1.shape[-2], layers.W1
    eye = torch.eye(h, dtype=W1.dtype, device=W1.device)
    order = torch.randperm(h, generator=generator)
    while h > 1 and bool((order == torch.arange(h)).all()):  # S = I would give A = I: no change at all
        order = torch.randperm(h, generator=generator)
    A = (eye + eps / 2 * (eye + eye[order.to(W1.device)])) / (1 + eps)
    return A, torch.linalg.solve(A.mT, layers.W2.mT).mT


_BASELINE_TRANSFORMS = {
    "g_inverse": _g_inverse,
    "random": _random_diagonal,
    "shuffle": _shuffled_pi,
    "perm_interp": _permutation_interpolation,
}


class BaselineEnsemble(ParameterEnsemble):
    """A random-transformation baseline of Zhao et al. 2023, App. I at the same eps as a :class:`GroupEnsemble`.

    ``kind`` is one of :data:`BASELINES`; with g = exp(eps M) drawn exactly as the
    group ensemble draws it (the same ``generator`` seed gives the same g's, all
    drawn before the baseline's own randomness):

    * ``"g_inverse"``: (W2 g^-1, g W1, g b1);
    * ``"random"``: (W2 g', g W1, g b1), g' = exp(eps D), D diagonal with N(0, 1) entries;
    * ``"shuffle"``: (W2 pi'(g, H), g W1, g b1), pi' the entries of pi(g, H) randomly
      permuted (needs ``reference`` and an action with an ``activation``, such as the
      data-dependent GL actions); note that at eps = 0 it still scrambles the identity;
    * ``"perm_interp"``: (W2 A^-1, A W1, A b1), A = (I + eps/2 (I + S)) / (1 + eps) for a
      random permutation matrix S other than I (which would give A = I; g is not used).

    The site must be a two-layer site (members (W1, b1, W2) or (U, V, b)) of a
    GL_h or O(h) group: the hidden layer the paper transforms.
    """

    def __init__(
        self,
        model: nn.Module,
        site: Site,
        kind: str,
        eps: float,
        members: int = 8,
        *,
        reference: Any = None,
        generator: torch.Generator | None = None,
        combine: Combine = "probabilities",
    ) -> None:
        if not isinstance(site, Site):
            raise TypeError(f"site must be a Site, got {type(site).__name__}")
        if kind not in BASELINES:
            raise ValueError(f"kind must be one of {BASELINES}, got {kind!r}")
        eps = _check_eps(eps)
        members = _check_members(members)
        (site,) = _as_sites(site)
        w1, b1, w2, W1, B1, W2 = _two_layer(site, model)
        params = tuple(None if n is None else lookup_tensor(model, n).detach() for n in site.members)
        _check_gl_site(site, params)
        layers = _Layers(W1, W2, *(_shuffle_inputs(model, site, reference, W1, B1) if kind == "shuffle" else ()))
        gs = [site.action.random_element(params, generator=generator, scale=eps) for _ in range(members)]
        points = []
        for g in gs:
            A, W2_new = _BASELINE_TRANSFORMS[kind](g, layers, eps, generator)
            point = {w1: A @ W1, w2: W2_new}
            if b1 is not None:
                assert B1 is not None  # _two_layer looks B1 up exactly when b1 is named
                point[b1] = A @ B1
            points.append(point)
        super().__init__(model, points, combine)
        self.kind = kind
        self.eps = eps
        self.site = site
