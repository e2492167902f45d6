"""Conserved quantities of gradient flow from linear symmetries (Zhao 2026, Sec. 2.5, Zhao et al. 2023, Sec. 5).

If a Lie group G acts linearly on the parameters and leaves the loss invariant,
every M in its Lie algebra gives the infinitesimal invariance
<grad L(theta), M . theta> = 0 (Zhao 2026, eq. 2.6).  Along gradient flow
theta' = -grad L (eq. 2.10) the velocity is therefore orthogonal to M . theta
(eq. 2.11), and for a *symmetric* generator (one whose operator on Param is
self-adjoint) Prop. 2.5.1 integrates this to a conserved quantity

    Q_M(theta) = <theta, M . theta>.

All Q_M of a site come from one vector-Jacobian product.  With the orbit map
c -> exp(c) . theta and its Jacobian J at c = 0, M . theta = J M, so
Q_M = <theta, J M> = <J^T theta, M>: the coordinate-shaped tensor
Q = J^T theta holds every Q_M at once (Q_M = <Q, M>_F).  For the known actions:

* GL_h on two layers (``gl_linear``, Ex. 2.5.3): Q = V V^T - U^T U with V = [W1 b1],
  U = W2: a symmetric h x h matrix, every entry conserved;
* positive rescaling through a degree-alpha activation (Ex. 2.5.4):
  Q = diag(V V^T - alpha U^T U), one conserved number per hidden unit;
* GL blocks of attention (Ex. 1.2.11-1.2.12) and LoRA: one symmetric matrix per block;
* translations (softmax, Ex. 1.2.8): M . theta = J M is constant, so
  d/dt <theta, J M> = <theta', J M> = 0 and Q = J^T theta is conserved too
  (linear in theta: the Noether charge of a translation).

Orthogonal groups have only anti-symmetric generators, whose Q_M vanish
identically; their flow satisfies the angular-momentum relation of Theorem 2.5.6
instead, returned by :func:`angular_momentum` as a residual.  Discrete groups have
no Lie algebra, data-dependent and approximate actions do not leave the training
loss invariant, and non-linear actions fall outside Prop. 2.5.1: such sites are
reported, never silently skipped.

:func:`whitened_conserved_quantity` is the conserved quantity of Zhao 2026
eq. 2.17 for any elementwise activation with whitened input (X = I), which the
Xavier-initialisation study of Sec. 2.6 (Fig. 2.3) uses for tanh and sigmoid.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from teleopt.actions.base import GroupAction, Params, required
from teleopt.site import Site, as_sites

__all__ = [
    "ConservedQuantities",
    "ParamSource",
    "angular_momentum",
    "conserved_quantities",
    "conserved_quantity_kind",
    "expected_whitened_quantity",
    "site_params",
    "whitened_conserved_quantity",
]

ParamSource = nn.Module | Mapping[str, Tensor]
Missing = Literal["warn", "raise", "ignore"]
_MISSING = ("warn", "raise", "ignore")


def site_params(source: ParamSource, site: Site) -> Params:
    """The member tensors of ``site`` (detached), from a model or a ``name -> tensor`` mapping."""
    if isinstance(source, nn.Module):
        return tuple(None if t is None else t.detach() for t in site.tensors(source))
    if isinstance(source, Mapping):
        missing = [m for m in site.tensor_names if m not in source]
        if missing:
            raise KeyError(f"site {site.name!r}: the parameters have no tensor named {', '.join(map(repr, missing))}")
        out: list[Tensor | None] = []
        for m in site.members:
            if m is None:
                out.append(None)
                continue
            t = source[m]
            if not isinstance(t, Tensor):
                raise TypeError(f"site {site.name!r}: {m!r} must be a torch.Tensor, got {type(t).__name__}")
            out.append(t.detach())
        return tuple(out)
    raise TypeError(f"expected an nn.Module or a mapping of tensor names to tensors, got {type(source).__name__}")


def conserved_quantity_kind(action: GroupAction) -> tuple[str | None, str]:
    """What Prop. 2.5.1 gives for ``action``: ``(kind, reason)``.

    ``kind`` is ``"symmetric"`` (matrix groups: the symmetric generators),
    ``"all"`` (diagonal and translation groups: every generator), or ``None`` when
    the site has no conserved quantity; ``reason`` says why in words.
    """
    kind = action.group_type.kind
    if not action.continuous:
        return None, f"{action.group_name} is a discrete group: no Lie algebra, so no conserved quantity of gradient flow"
    if action.exactness != "exact":
        return None, (
            f"{action.name} is {action.exactness}: the training loss is not invariant under it "
            "(Zhao 2026, Prop. 2.5.1 needs an exact symmetry)"
        )
    if kind == "translation":
        return "all", "translations: Q = J^T theta is linear in theta and conserved"
    if not action.linear:
        return None, f"{action.name} acts non-linearly: Zhao 2026, Prop. 2.5.1 needs a linear action"
    if kind == "orthogonal":
        return None, (
            f"{action.group_name} has only anti-symmetric generators, whose Q_M vanish: use angular_momentum() "
            "for the relation of Zhao 2026, Theorem 2.5.6"
        )
    if kind == "diagonal":
        return "all", "diagonal group: every generator is symmetric"
    if kind == "general":
        return "symmetric", "matrix group: Q_M for the symmetric generators M = M^T"
    return None, f"no conserved quantity is known for a {kind} group"


def _orbit_vjp(action: GroupAction, params: Params, cotangents: Sequence[Params]) -> list[Tensor]:
    """J^T v for each v in ``cotangents``, J the Jacobian of c -> exp(c) . params at c = 0."""
    present = [(i, p) for i, p in enumerate(params) if p is not None]
    ref = present[0][1]
    shape = action.coord_shape(params)
    if shape is None:
        raise ValueError(f"{action.name} is a discrete group: it has no Lie algebra coordinates")
    coords = torch.zeros(shape, dtype=ref.dtype, device=ref.device)

    def orbit(c: Tensor) -> tuple[Tensor, ...]:
        moved = action.act(action.exp(c, params), params)
        return tuple(required(moved[i], action.member_names[i]) for i, _ in present)

    with torch.enable_grad():
        vjp_fn = torch.func.vjp(orbit, coords)[1]
        out = []
        for v in cotangents:
            cot = []
            for i, p in present:
                vi = v[i]
                cot.append(torch.zeros_like(p) if vi is None else vi.to(p.dtype))
            out.append(vjp_fn(tuple(cot))[0].detach())
    return out


def _symmetrize(q: Tensor) -> Tensor:
    return (q + q.mT) / 2


@dataclass
class ConservedQuantities(Mapping[str, Tensor]):
    """Per site, the tensor Q with Q_M = <Q, M> for every conserved generator M (Zhao 2026, Prop. 2.5.1).

    A read-only mapping ``site name -> Q``, backed by the dict ``quantities``.
    ``parts[site][member]`` is each member's contribution (they sum to Q; e.g.
    V V^T and -U^T U), whose combined size is the scale drift is measured
    against.  ``unavailable`` names every site without a conserved quantity and
    why.
    """

    quantities: dict[str, Tensor] = field(default_factory=dict)
    parts: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self.quantities[name]
        except KeyError:
            if name in self.unavailable:
                raise KeyError(f"site {name!r} has no conserved quantity: {self.unavailable[name]}") from None
            raise

    def __iter__(self) -> Iterator[str]:
        return iter(self.quantities)

    def __len__(self) -> int:
        return len(self.quantities)

    def scale(self, name: str) -> float:
        """Sum of the Frobenius norms of the members' contributions (the normaliser of Zhao 2026, eq. A.29)."""
        return float(sum(float(p.norm()) for p in self.parts[name].values()))

    def drift(self, reference: ConservedQuantities) -> dict[str, float]:
        """Per site, ||Q - Q_ref|| / scale_ref: the relative change since ``reference``."""
        out = {}
        for name, q in self.quantities.items():
            if name not in reference.quantities:
                raise KeyError(f"site {name!r} is not in the reference")
            ref = reference.quantities[name]
            if ref.shape != q.shape:
                raise ValueError(f"site {name!r}: shape {tuple(q.shape)} differs from the reference's {tuple(ref.shape)}")
            scale = reference.scale(name)
            diff = float((q - ref).norm())
            out[name] = diff / scale if scale > 0 else diff
        return out

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self.quantities.items())
        missing = f"; unavailable: {', '.join(self.unavailable)}" if self.unavailable else ""
        return f"ConservedQuantities({shapes}{missing})"


def _check_sites(sites: Sequence[Site] | Site) -> tuple[Site, ...]:
    sites = as_sites(sites)
    names = [s.name for s in sites]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"site names must be unique, repeated: {', '.join(dup)}")
    return sites


def conserved_quantities(source: ParamSource, sites: Sequence[Site] | Site, *, missing: Missing = "warn") -> ConservedQuantities:
    """Q_M = <theta, M . theta> for every conserved generator of each site (Zhao 2026, Prop. 2.5.1).

    Parameters
    ----------
    source:
        The model, or a mapping from qualified tensor names to tensors (a
        ``state_dict``, or the parameter dict of ``torch.func.functional_call``).
    sites:
        The sites (e.g. from :func:`teleopt.find_symmetries` or built by hand).
    missing:
        Sites without a conserved quantity (discrete, data-dependent, approximate,
        non-linear or orthogonal; see :func:`conserved_quantity_kind`) are always
        listed in ``result.unavailable``; ``"warn"`` (default) also warns,
        ``"raise"`` raises ``ValueError``, ``"ignore"`` does neither.

    Returns
    -------
    ConservedQuantities
        ``result[site.name]`` is Q in the site's Lie-algebra coordinate shape:
        a symmetric matrix (blocks of them) for GL sites, one value per unit for
        diagonal sites, one per direction for translations.  Q_M = <Q, M>_F.
    """
    if missing not in _MISSING:
        raise ValueError(f"missing must be one of {_MISSING}, got {missing!r}")
    result = ConservedQuantities()
    for site in _check_sites(sites):
        kind, reason = conserved_quantity_kind(site.action)
        if kind is None:
            result.unavailable[site.name] = reason
            continue
        params = site.action.check_params(site_params(source, site))
        roles = [(i, role) for i, role in enumerate(site.action.member_names) if params[i] is not None]
        cotangents = [tuple(p if j == i else None for j, p in enumerate(params)) for i, _ in roles]
        contributions = _orbit_vjp(site.action, params, cotangents)
        if kind == "symmetric":
            contributions = [_symmetrize(c) for c in contributions]
        result.parts[site.name] = {role: c for (_, role), c in zip(roles, contributions)}
        result.quantities[site.name] = torch.stack(contributions).sum(0)
    if result.unavailable and missing != "ignore":
        lines = "; ".join(f"{name}: {why}" for name, why in result.unavailable.items())
        if missing == "raise":
            raise ValueError(f"{len(result.unavailable)} site(s) have no conserved quantity: {lines}")
        warnings.warn(f"no conserved quantity for {len(result.unavailable)} site(s): {lines}", UserWarning, stacklevel=2)
    return result


def angular_momentum(source: ParamSource, velocity: ParamSource, site: Site) -> Tensor:
    """The angular-momentum relation of Zhao 2026, Theorem 2.5.6, as a residual that vanishes on gradient flow.

    For a matrix-group site (O(h) or GL_h) acting on (V, U) by (g V, U g^{-1}),
    returns the anti-symmetric matrix

        V V'^T - V' V^T + U^T U' - U'^T U        (eq. 2.13)

    (per block for blocked groups) with theta' = ``velocity`` (e.g. the negative
    gradient, or an optimizer update divided by the learning rate).  Its (k, l)
    entry is the summed 2D angular momentum r^2 phi' of the rows/columns in the
    (k, l) plane.  On a gradient-flow trajectory of a loss invariant under the
    site it is zero: it equals -2 <theta', A . theta> summed over the
    anti-symmetric generators A (eq. 2.11).  Generically: the anti-symmetric part
    of K^T - K with K_kl = <theta', E_kl . theta>.
    """
    if not isinstance(site, Site):
        raise TypeError(f"site must be a Site, got {type(site).__name__}")
    action = site.action
    if action.group_type.kind not in ("orthogonal", "general") or not action.continuous:
        raise ValueError(f"site {site.name!r}: the angular-momentum relation needs a matrix group (O(h) or GL_h), got {action.group_name}")
    if not action.linear:
        raise ValueError(f"site {site.name!r}: {action.name} acts non-linearly (Zhao 2026, Theorem 2.5.6 needs a linear action)")
    params = action.check_params(site_params(source, site))
    vel = site_params(velocity, site)
    for role, p, v in zip(action.member_names, params, vel):
        if (p is None) != (v is None):
            raise ValueError(f"site {site.name!r}: velocity and parameters disagree on member {role!r}")
        if p is not None and v is not None and p.shape != v.shape:
            raise ValueError(f"site {site.name!r}: velocity of {role!r} has shape {tuple(v.shape)}, expected {tuple(p.shape)}")
    (k,) = _orbit_vjp(action, params, [vel])
    return k.mT - k


def _identity_f(v: Tensor) -> Tensor:
    return v * v / 2


def _tanh_f(v: Tensor) -> Tensor:
    # sigma / sigma' = tanh(x) cosh(x)^2 = sinh(2x) / 2, integral sinh(v)^2 / 2
    return torch.sinh(v) ** 2 / 2


def _sigmoid_f(v: Tensor) -> Tensor:
    # sigma / sigma' = 1 / (1 - sigma(x)) = 1 + e^x, integral v + e^v - 1
    return v + torch.expm1(v)


# F(v) = int_0^v sigma(x) / sigma'(x) dx in closed form.  Homogeneous activations of degree 1
# have sigma = x sigma', so F = v^2 / 2; for ReLU on v < 0 (0/0) the same limit is used: those
# weights have zero gradient under whitened input and never move, so any choice is conserved.
_ANTIDERIVATIVES: dict[str, Callable[[Tensor], Tensor]] = {
    "identity": _identity_f,
    "linear": _identity_f,
    "relu": _identity_f,
    "leaky_relu": _identity_f,
    "tanh": _tanh_f,
    "sigmoid": _sigmoid_f,
}


def _gauss_rule(kind: Literal["legendre", "normal"], nodes: int) -> tuple[Tensor, Tensor]:
    """Gauss quadrature nodes and weights (float64) by the Golub-Welsch eigenvalue method.

    ``"legendre"``: weight 1 on [-1, 1] (weights sum to 2); ``"normal"``: the
    standard normal density (probabilists' Hermite, weights sum to 1).
    """
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 2:
        raise ValueError(f"nodes must be an int >= 2, got {nodes!r}")
    k = torch.arange(1, nodes, dtype=torch.float64)
    off = k / torch.sqrt(4 * k**2 - 1) if kind == "legendre" else torch.sqrt(k)
    x, vectors = torch.linalg.eigh(torch.diag(off, 1) + torch.diag(off, -1))
    return x, (2.0 if kind == "legendre" else 1.0) * vectors[0] ** 2


def _quadrature_f(activation: Callable[[Tensor], Tensor], nodes: int) -> Callable[[Tensor], Tensor]:
    x, w = _gauss_rule("legendre", nodes)

    def fn(v: Tensor) -> Tensor:
        t = x.to(dtype=v.dtype, device=v.device)
        wt = w.to(dtype=v.dtype, device=v.device)
        pts = (v.unsqueeze(-1) * (t + 1) / 2).detach().requires_grad_(True)
        with torch.enable_grad():
            s = activation(pts)
            (ds,) = torch.autograd.grad(s.sum(), pts)
        if bool((ds == 0).any()):
            raise ValueError("the activation's derivative vanishes on [0, v]: sigma / sigma' is undefined there")
        return ((s.detach() / ds) * wt).sum(-1) * v / 2

    return fn


def _antiderivative(activation: str | Callable[[Tensor], Tensor], nodes: int) -> Callable[[Tensor], Tensor]:
    """F(v) = int_0^v sigma / sigma' for a named activation (closed form) or a callable (quadrature)."""
    if isinstance(activation, str):
        if activation not in _ANTIDERIVATIVES:
            raise ValueError(f"unknown activation {activation!r}: use one of {sorted(_ANTIDERIVATIVES)} or a callable")
        return _ANTIDERIVATIVES[activation]
    if callable(activation):
        return _quadrature_f(activation, nodes)
    raise TypeError(f"activation must be a name or a callable, got {type(activation).__name__}")


def whitened_conserved_quantity(
    U: Tensor, V: Tensor, activation: str | Callable[[Tensor], Tensor], *, nodes: int = 32, parts: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Q = 1/2 Tr[U^T U] - sum_aj int_0^{V_aj} sigma(x) / sigma'(x) dx (Zhao 2026, eq. 2.17).

    For the two-layer network U sigma(V X) with whitened input X = I (so each
    entry of V is the pre-activation of one sample) and any loss of the output,
    Q is conserved by gradient flow: d/dt 1/2 Tr U^T U = -sum (U^T G) sigma(V) and
    d/dt sum F(V) = -sum (sigma / sigma') sigma' (U^T G) cancel (G = dL/dF).  For
    the identity it is eq. 2.14, 1/2 Tr[U^T U - V V^T].

    ``activation`` is ``"identity"``, ``"relu"``, ``"leaky_relu"``, ``"tanh"``,
    ``"sigmoid"`` (closed forms) or any elementwise callable, integrated by
    ``nodes``-point Gauss-Legendre quadrature (sigma' from autograd; an error if
    it vanishes on the path).  ``U`` is (m, h), ``V`` is (h, n).  With
    ``parts=True`` returns the two terms (1/2 Tr U^T U, -sum F(V)), whose sizes
    are the normaliser of eq. A.29.
    """
    for name, t in (("U", U), ("V", V)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 2 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point matrix, got shape {tuple(t.shape)} and {t.dtype}")
    if U.shape[1] != V.shape[0]:
        raise ValueError(f"U is {tuple(U.shape)} and V is {tuple(V.shape)}: U's columns must match V's rows (hidden units)")
    antiderivative = _antiderivative(activation, nodes)
    terms = (0.5 * (U.detach() ** 2).sum(), -antiderivative(V.detach()).sum())
    return terms if parts else terms[0] + terms[1]


def expected_whitened_quantity(m: int, h: int, n: int, activation: str | Callable[[Tensor], Tensor], *, nodes: int = 64) -> float:
    """E[Q] of eq. 2.17 under the initialisation of Zhao 2026, eq. 2.15 (U_ij ~ N(0, 1/h), V_ij ~ N(0, 1/n)).

    E[1/2 Tr U^T U] = m / 2 and E[F(V_aj)] by ``nodes``-point Gauss-Hermite
    quadrature; for the identity this is (m - h) / 2, eq. 2.16 for eq. 2.14's Q.
    """
    for name, size in (("m", m), ("h", h), ("n", n)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    x, w = _gauss_rule("normal", nodes)
    mean_f = float((_antiderivative(activation, nodes)(x / math.sqrt(n)) * w).sum())
    return m / 2 - h * n * mean_f
