"""The discovery objective of Zhao et al. 2024b, Sec. 5 (Zhao 2026, Sec. 6.5, eq. 6.3), derived and computed with torch.func.

Notation: a_X(g, theta) is the action (any callable ``action_fn(vec(g - I), theta, x)``,
batched on leading axes), h_1..h_n in gl(p) the generators and

    xi_h(theta) = D_g a_X|_{I,theta}(h)

the infinitesimal action, one forward-mode ``torch.func.jvp`` in the group input.
Every term is an expectation over the sampled (theta, X) and is computed with
``jvp`` only (no Jacobian is ever formed):

* invariance (eq. 5, Theorem 3.1): E |D_theta L . xi_h| = E |jvp of L along xi_h|,
  averaged over the entries of L when L is vector valued (L: Param x D^d -> R^d).
  Optionally each sample and entry is divided by |D_theta L_j| (``gradient_norms``,
  from :func:`loss_gradient_norms`: the normal component of xi_h) and by |xi_h|
  (``scale_free``: the |cosine| between orbit and gradient);
* identity (eq. 6): E ||a_X(I, theta) - theta||_2;
* associativity, first order (Zhao 2026, Theorem 6.3.2):
  ||D_theta a_X|_{I,theta}(xi_{h1}) + xi_{h2} - xi_{h1+h2}||.  xi is linear in h
  (a derivative), so this equals ||D_theta a_X|_{I,theta}(xi_{h1}) - xi_{h1}||,
  independent of h2: it is the derivative of the identity axiom along the orbit
  and is computed once per generator;
* associativity, second order: the first-order condition holds for every action
  with a_X(I, .) = id, including maps that are no group action (e.g. g^T theta).
  Expanding a(exp(s h1), a(exp(t h2), theta)) = a(exp(s h1) exp(t h2), theta) to
  order s t gives the Lie algebra condition [xi_{h1}, xi_{h2}] = -xi_{[h1,h2]}
  (the fundamental vector fields of a left action form an anti-homomorphism),
  with the vector field bracket [u, v] = Dv . u - Du . v.  Zhao et al. 2024b, eq. 7 aims at
  this term; its printed form multiplies two tangent vectors.  The residual
  ||D xi_{h2} . xi_{h1} - D xi_{h1} . xi_{h2} + xi_{[h1,h2]}|| is computed with
  nested jvps for every pair h1 < h2 and added to the first-order term; it is
  estimated on the first max(1, 64 / #pairs) samples of the batch
  (``BRACKET_ROWS``), which keeps its cost flat in the number of generators;
* norm regulariser (eq. 8): E |beta - ||xi_h|||;
* orthogonality (eq. 9): sum_{i<j} |cos(h_i, h_j)|.  The printed signed cosine is
  minimised by anti-parallel generators, which span one line; the absolute value
  is what "orthogonal" means;
* sparsity (eq. 10): sum |h_kj|;
* linearity (teleopt's addition, weight 0 recovers the papers' objective):
  E ||xi_h - h theta||, the part of the infinitesimal action that the linear
  representation does not explain.  Without it nothing ties h to the symmetry it
  generates (Zhao et al. 2024b, Sec. 5.3: the learned action may compose a reparametrisation
  of the generators with the action); with it, a loss that has a linear symmetry
  gets that symmetry's generator.

Terms that depend on one generator are summed over generators, pair terms over
pairs, and each is averaged over samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

import torch
from torch import Tensor
from torch.func import jvp, vjp, vmap

__all__ = [
    "ActionFn",
    "LossWeights",
    "TERMS",
    "infinitesimal_action",
    "loss_derivative",
    "discovery_losses",
    "total_loss",
]

ActionFn = Callable[[Tensor, Tensor, Tensor], Tensor]
BRACKET_ROWS = 128  # the bracket term (nested jvps over all ordered pairs) uses at most this many (pair, sample) rows
TERMS = ("invariance", "identity", "associativity", "norm", "orthogonality", "sparsity", "linearity")


def _jvp(fn: Callable[[Tensor], Tensor], primal: Tensor, tangent: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.func.jvp`` of a function of one tensor: (output, jvp_out)."""
    # torch annotates jvp's result as a pair or, for has_aux=True, a triple; without has_aux it is the pair
    return cast(tuple[Tensor, Tensor], jvp(fn, (primal,), (tangent,)))


def _vjp(fn: Callable[[Tensor], Tensor], primal: Tensor) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor]]]:
    """``torch.func.vjp`` of a function of one tensor: (output, pullback); pullback(v) is a 1-tuple."""
    # as for jvp: torch's annotation includes the has_aux triple
    return cast(tuple[Tensor, Callable[[Tensor], tuple[Tensor]]], vjp(fn, primal))


@dataclass(frozen=True)
class LossWeights:
    """gamma_1..gamma_6 of Zhao et al. 2024b, eq. 11 (Zhao 2026, eq. 6.3), plus teleopt's ``linearity``.

    Defaults are Zhao et al. 2024b, Sec. 5.3 (data-independent symmetries):
    gamma_1 = 10 (invariance), gamma_2 = 1 (identity), gamma_4 = 1 (norm),
    gamma_5 = 1 (orthogonality), gamma_6 = 0.1 (sparsity); Zhao 2026, Sec. 6.5.3 uses
    the same values.  Neither paper states gamma_3 (associativity): 1, like the
    identity axiom.  :meth:`data_dependent` gives Zhao et al. 2024b, Sec. 5.4.
    ``linearity`` is not in the papers (see :mod:`teleopt.discovery.losses`; 0 gives
    the papers' objective).  Default 10: on the m = h = n = k = 1 linear network
    (generator lr 1e-2) weight 1 left |cos(h, diag(1, -1))| at 0.78 after 500 steps
    and 0.99 after 1500, weight 10 reached 0.999 after 500.  Symmetries that need
    the non-linear, data-dependent part of the action want weight 0.
    """

    invariance: float = 10.0
    identity: float = 1.0
    associativity: float = 1.0
    norm: float = 1.0
    orthogonality: float = 1.0
    sparsity: float = 0.1
    linearity: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"loss weight {f.name!r} must be a finite number >= 0, got {value!r}")

    @classmethod
    def data_independent(cls) -> LossWeights:
        """Zhao et al. 2024b, Sec. 5.3 (and Zhao 2026, Sec. 6.5.3): gamma = (10, 1, 1, 1, 1, 0.1)."""
        return cls()

    @classmethod
    def data_dependent(cls, linearity: float = 0.0) -> LossWeights:
        """Zhao et al. 2024b, Sec. 5.4 (and Zhao 2026, Sec. 6.5.4): gamma_1 = 1, gamma_2 = gamma_4 = 10, gamma_5 = 1, gamma_6 = 0.1.

        ``linearity`` defaults to 0 (the papers' objective).  In our runs on the
        sigmoid network of Sec. 5.4 these weights left the invariance term too weak
        (learned curves barely flatter than random ones, ``docs/performance.md``);
        ``benchmarks/discovery.py`` uses the Sec. 5.3 weights with ``linearity=0``.
        """
        return cls(invariance=1.0, identity=10.0, associativity=1.0, norm=10.0, orthogonality=1.0, sparsity=0.1, linearity=linearity)

    def as_dict(self) -> dict[str, float]:
        """The weights by term name."""
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LossWeights:
        """Inverse of :meth:`as_dict`."""
        return cls(**{k: float(v) for k, v in data.items()})


def infinitesimal_action(action_fn: ActionFn, theta: Tensor, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """(a_X(I, theta), xi_h(theta)) with xi_h = D_g a_X|_{I,theta}(h) (Zhao et al. 2024b, Theorem 3.1).

    One forward-mode jvp at g = I in the direction h; ``h`` (..., p, p) broadcasts
    against the leading axes of ``theta`` (..., p).
    """
    p = theta.shape[-1]
    zeros = theta.new_zeros(*theta.shape[:-1], p * p)
    tangent = h.reshape(*h.shape[:-2], p * p).to(theta.dtype).expand_as(zeros)
    return _jvp(lambda g: action_fn(g, theta, x), zeros, tangent)


def loss_derivative(loss_fn: Callable[[Any, Any], Tensor], unflatten: Callable[[Tensor], Any], rebuild: Callable[[Any], Any]):
    """The directional derivative D_theta L(theta, X) . v for batches of samples, by jvp.

    Returns ``f(theta, leaves, v)`` with theta, v of shape (n, B, p) and data leaves
    of shape (B, ...) shared by the n directions; the result has shape
    (n, B, *L.shape).  ``loss_fn(params, data)`` is evaluated per sample under
    ``torch.func.vmap``.
    """

    def single(theta: Tensor, leaves: tuple[Tensor, ...], v: Tensor) -> Tensor:
        return _jvp(lambda t: loss_fn(unflatten(t), rebuild(leaves)), theta, v)[1]

    return vmap(vmap(single), in_dims=(0, None, 0))


def loss_gradient_norms(loss_fn: Callable[[Any, Any], Tensor], unflatten: Callable[[Tensor], Any], rebuild: Callable[[Any], Any]):
    """|D_theta L_j(theta, X)| for every entry j of L, per sample, by vjp: ``f(theta (B, p), leaves) -> (B, d)``.

    The invariance weights of :func:`discovery_losses` (they depend on the samples
    only, not on anything trained).
    """

    def single(theta: Tensor, leaves: tuple[Tensor, ...]) -> Tensor:
        out, pullback = _vjp(lambda t: loss_fn(unflatten(t), rebuild(leaves)).reshape(-1), theta)
        rows = vmap(pullback)(torch.eye(out.numel(), dtype=out.dtype, device=out.device))[0]
        return rows.norm(dim=-1)

    return vmap(single)


def _bracket_term(action_fn: ActionFn, theta: Tensor, x: Tensor, xi: Tensor, generators: Tensor) -> Tensor:
    """The second-order associativity residual (Zhao et al. 2024b, eq. 7, as derived in the module docs):
    ||D xi_{h_j} . xi_{h_i} - D xi_{h_i} . xi_{h_j} + xi_{[h_i,h_j]}|| over pairs i < j, on at most
    ``BRACKET_ROWS`` (pair, sample) rows."""
    n, batch, p = generators.shape[0], theta.shape[0], theta.shape[-1]
    i, j = torch.triu_indices(n, n, offset=1, device=theta.device)
    pairs = i.numel()
    sub = max(1, min(batch, BRACKET_ROWS // (2 * pairs)))
    # ordered pairs (a, b) = (i, j) then (j, i): D xi_{h_b} . xi_{h_a}
    a_idx, b_idx = torch.cat([i, j]), torch.cat([j, i])
    th2 = theta[:sub].expand(2 * pairs, sub, p).contiguous()
    x2 = x[:sub].expand(2 * pairs, sub, x.shape[-1])
    h_b = generators[b_idx][:, None]
    _, along = _jvp(lambda t: infinitesimal_action(action_fn, t, x2, h_b)[1], th2, xi[a_idx, :sub])
    commutators = generators[i] @ generators[j] - generators[j] @ generators[i]
    _, xi_bracket = infinitesimal_action(action_fn, th2[:pairs], x2[:pairs], commutators[:, None])
    residual = along[:pairs] - along[pairs:] + xi_bracket
    return residual.norm(dim=-1).mean(dim=-1).sum()


def discovery_losses(  # noqa: PLR0913  eq. 11's inputs (a batch, the generators, beta) and discover's three loss options
    action_fn: ActionFn,
    loss_jvp: Callable[[Tensor, tuple[Tensor, ...], Tensor], Tensor],
    theta: Tensor,
    leaves: tuple[Tensor, ...],
    x: Tensor,
    generators: Tensor,
    beta: float,
    second_order: bool = True,
    gradient_norms: Tensor | None = None,
    scale_free: bool = False,
) -> dict[str, Tensor]:
    """Every term of Zhao et al. 2024b, eq. 11 on a batch (theta (B, p), data leaves, features x (B, d)).

    ``loss_jvp`` is :func:`loss_derivative`; ``generators`` is (n, p, p).  Returns a
    dict with the terms of :data:`TERMS` and the two parts of the associativity
    term (``associativity_first_order``, ``associativity_bracket``).
    """
    n, p = generators.shape[0], theta.shape[-1]
    batch = theta.shape[0]
    thetas = theta.expand(n, batch, p).contiguous()
    xs = x.expand(n, batch, x.shape[-1])
    a_identity, xi = infinitesimal_action(action_fn, thetas, xs, generators[:, None])

    violation = loss_jvp(thetas, leaves, xi).abs().reshape(n, batch, -1)
    if gradient_norms is not None:
        violation = violation / gradient_norms.reshape(1, batch, -1).clamp_min(torch.finfo(violation.dtype).tiny)
    if scale_free:
        violation = violation / xi.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(violation.dtype).tiny)
    invariance = violation.mean(dim=-1).mean(dim=-1).sum()
    identity = (a_identity[0] - theta).norm(dim=-1).mean()

    zeros = theta.new_zeros(n, batch, p * p)
    _, d_theta_a = _jvp(lambda t: action_fn(zeros, t, xs), thetas, xi)
    first_order = (d_theta_a - xi).norm(dim=-1).mean(dim=-1).sum()
    bracket = _bracket_term(action_fn, theta, x, xi, generators) if second_order and n > 1 else theta.new_zeros(())

    norm = (beta - xi.norm(dim=-1)).abs().mean(dim=-1).sum()
    flat = generators.reshape(n, -1)
    unit = flat / flat.norm(dim=1, keepdim=True).clamp_min(torch.finfo(flat.dtype).tiny)
    orthogonality = (unit @ unit.T).triu(diagonal=1).abs().sum()
    sparsity = generators.abs().sum()
    linear_part = (generators[:, None] @ thetas.unsqueeze(-1)).squeeze(-1)
    linearity = (xi - linear_part).norm(dim=-1).mean(dim=-1).sum()
    return {
        "invariance": invariance,
        "identity": identity,
        "associativity": first_order + bracket,
        "associativity_first_order": first_order,
        "associativity_bracket": bracket,
        "norm": norm,
        "orthogonality": orthogonality,
        "sparsity": sparsity,
        "linearity": linearity,
    }


def total_loss(terms: dict[str, Tensor], weights: LossWeights) -> Tensor:
    """Zhao et al. 2024b, eq. 11: sum_k gamma_k L_k (plus teleopt's linearity term)."""
    w = weights.as_dict()
    return sum(w[name] * terms[name] for name in TERMS)  # type: ignore[return-value]
