"""The base optimizer's predicted decrease at g . w without simulating its update per candidate.

The predicted-decrease cap (:class:`~teleopt.teleport.safety.Caps`) asks whether
<grad', u'>, the first-order decrease of the base optimizer's next step from g . w
(Zhao 2026, eq. 4.17 with the optimizer's own update), stays below a multiple of
the loss.  Simulated, it is an optimizer update of every site tensor at every
candidate of the caps' bisection.  Here one pass over the site tensors at the
start of the search reduces it to the group's size, as the gradient norm is
(:class:`~teleopt.teleport.gradient_norm.GradientNormModel`): each candidate then
costs a contraction of per-unit (or, for a weight between two sites, per-entry)
weights with the elements' factors.

For positive scalings on whole axes, entry e of a tensor moves its gradient and
first moment by its covector factor f_e (the product of c^-p over the sites acting
on it) and a second moment by f_e^2 (CONVENTIONS.md section 2), so:

* **SGD** (momentum mu, dampening d, Nesterov, weight decay lambda; Polyak 1964):
  u' = a (grad' + lambda w') + c b', so
  <grad', u'> = a ||grad'||^2 + a lambda <grad, w> + c sum_e grad_e b_e f_e^2, exactly
  (<grad', w'> = <grad, w> for a linear action; a and c from mu, d and Nesterov).
  Under matrix groups the last term is bounded by Cauchy-Schwarz,
  c ||grad'|| ||b'||, with ||b'|| from a reduced norm of the momentum buffers.
* **Adam/AdamW** (Kingma & Ba 2015, Algorithm 1; decoupled decay, Loshchilov &
  Hutter 2019): entry e's term lr / bc1 g_e m'_e f_e / (sqrt(v'_e / bc2) + eps / f_e)
  is at most its value without eps where it is positive, and at most its value with
  eps / f_min where it is negative, f_min <= f_e the smallest factor of the first
  candidate (the bisection only moves towards the identity, where factors near 1):
  a linear function of f, an upper bound within eps of the exact value, plus
  lr lambda <grad, w> for decoupled decay.

:func:`decrease_bound` returns ``None`` elsewhere (Adagrad, RMSprop, ``maximize``,
Adam's L2 decay or matrix groups under Adam, moments not transported, slices and
sharded tensors); the cap then evaluates the simulated decrease.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction, Member
from teleopt.groups import Group
from teleopt.sharding import is_sharded, sum_over
from teleopt.site import Site
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.gradient_norm import GradientNormModel, _diagonal, _plain
from teleopt.teleport.optimizer_model import state_role

__all__ = ["DecreaseBound", "decrease_bound"]

_CHUNK = 1 << 18  # entries per slice of the one-off pass over moments (2^18 float32 temporaries)
# entries above which a weight between two sites keeps its weights in float16, rounded up: half the memory at
# more time per candidate (docs/performance.md), so only for weights whose float32 copy is large in itself
_COMPACT = 1 << 24
_Entries = list[tuple[int, Member, Group]]


class _Linear:
    """sum_e W_e f_e^k for one tensor, f_e the product of its covector factors c^-p, from W summed over the
    axes no site acts on (kept whole where every axis is acted: a weight between two sites), times ``scale``."""

    def __init__(self, chunks: Iterable[Tensor], shape: torch.Size, scale: float, entries: _Entries, k: int, lowest: float = 0.0) -> None:
        self.scale, self.entries, self.k, self.lowest = scale, entries, k, lowest
        axes = [m.axis % len(shape) for _, m, _ in entries]
        order = sorted(axes)
        self.positions = [order.index(a) for a in axes]
        self.units: list[float] = []
        if len(shape) == 2 and len(axes) == 2 and shape.numel() > _COMPACT:
            W, total = self._compact(chunks, shape)
        else:
            W, total = self._reduced(chunks, shape, axes)
        work = torch.float32 if self.units else W.dtype  # the contraction's dtype
        eps, tiny = torch.finfo(work).eps, torch.finfo(work).tiny
        # the float32 rounding of the factors and of the contraction, and products flushed to zero, per unit of
        # the largest factor
        self.slack = (64 * eps * total + shape.numel() * tiny) * scale
        self.W = W

    @staticmethod
    def _reduced(chunks: Iterable[Tensor], shape: torch.Size, axes: list[int]) -> tuple[Tensor, float]:
        """W summed over the axes no site acts on, a chunk of rows at a time (written into place when the rows
        are acted on), and sum |W_e|."""
        out: Tensor | None = None
        total, row = 0.0, 0
        for chunk in chunks:
            total += float(torch.linalg.vector_norm(chunk, 1))
            part = sum_over(chunk.reshape(-1, *shape[1:]), [d for d in range(len(shape)) if d not in axes])
            if 0 not in axes:
                out = part if out is None else out.add_(part)
                continue
            if out is None:
                out = torch.empty((shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
            out[row : row + part.shape[0]] = part
            row += part.shape[0]
        if out is None:  # no entries
            out = torch.zeros([shape[a] for a in sorted(axes)])
        return out, total

    def _compact(self, chunks: Iterable[Tensor], shape: torch.Size) -> tuple[Tensor, float]:
        """float16 weights H >= W / unit entrywise (rounded towards +inf), one power-of-two unit above max |W| per
        chunk of rows: half the memory, and sum H f * unit still bounds sum W f from above for positive factors
        (at most 2^-11 relative per entry more, plus 6e-8 unit for entries below float16's normal range)."""
        H = torch.empty(shape, dtype=torch.float16)
        total, row = 0.0, 0
        for chunk in chunks:
            rows = chunk.numel() // shape[1]
            top = float(chunk.abs().amax()) if chunk.numel() else 0.0
            total += float(torch.linalg.vector_norm(chunk, 1))
            unit = 2.0 ** math.ceil(math.log2(top)) if 0 < top < math.inf else 1.0 if top == 0 else math.inf
            scaled = chunk.reshape(rows, shape[1]) / unit
            half = scaled.to(torch.float16)
            H[row : row + rows] = torch.where(half.float() < scaled, torch.nextafter(half, torch.full_like(half, math.inf)), half)
            self.units.append(unit)
            row += rows
        return H.to(chunk.device) if row else H, total

    def value(self, elements: Sequence[Tensor]) -> float:
        """The term at ``elements`` (``inf`` where a factor is below the ``lowest`` the weights assume)."""
        if self.lowest and _extreme_factor(elements, self.entries, torch.amin) < self.lowest:
            return math.inf
        factors = [
            _factor(grp, elements[i], m.power * self.k).to(torch.float32 if self.W.dtype == torch.float16 else self.W.dtype)
            for i, m, grp in self.entries
        ]
        if self.units:  # chunks of rows of the half-precision weights, widened one at a time
            x, y = (factors[self.positions.index(d)] for d in (0, 1))
            rows = max(1, _CHUNK // self.W.shape[1])
            parts = zip(self.W.split(rows), x.split(rows), self.units)
            value = sum(float((W.float() @ y) @ xs) * unit for W, xs, unit in parts)
        else:
            letters = "abcdefghij"[: self.W.ndim]
            spec = letters + "," + ",".join(letters[pos] for pos in self.positions) + "->"
            value = float(torch.einsum(spec, self.W, *factors))
        return value * self.scale + self.slack * _extreme_factor(elements, self.entries, torch.amax) ** self.k


def _factor(group: Group, g: Tensor, power: float) -> Tensor:
    """The covector factor c^-power of a diagonal group's element, per unit."""
    factor = group.square_factor(g.detach(), -0.5 * power)
    assert factor is not None  # diagonal groups only
    return factor


def _extreme_factor(elements: Sequence[Tensor], entries: _Entries, which: Any) -> float:
    """A lower (``torch.amin``) or upper (``torch.amax``) bound of every entry's covector factor: the product of
    each acting site's extreme factor."""
    value = 1.0
    for i, m, grp in entries:
        f = _factor(grp, elements[i], m.power)
        value *= float(which(f)) if f.numel() else 1.0
    return value


@dataclass
class DecreaseBound:
    """bound(elements) = constant + sum_n a_n ||grad'_n||^2 + the linear terms + the Cauchy-Schwarz term
    sqrt(sum_n w_n ||grad'_n||^2 * sum_n v_n ||b'_n||^2) (matrix groups under SGD momentum); see module docs.
    ``at_identity()`` is the exact decrease at the identity."""

    grads: GradientNormModel | None  # the reduced gradient norm (SGD's squared and Cauchy-Schwarz terms); None for Adam
    constant: float
    at_identity: Callable[[], float]
    squared: dict[str, float] = field(default_factory=dict)
    linear: list[_Linear] = field(default_factory=list)
    cross: tuple[dict[str, float], GradientNormModel, dict[str, float]] | None = None

    @property
    def tight(self) -> bool:
        """Whether the bound is the decrease up to eps and round-off (no Cauchy-Schwarz term)."""
        return self.cross is None

    def __call__(self, elements: Sequence[Tensor]) -> float:
        """The bound at ``elements`` (``inf`` outside the factors it was built for)."""
        total = self.constant
        if any(self.squared.values()):
            assert self.grads is not None  # given with squared terms
            total += float(self.grads.value(elements, self.squared))
        if self.cross is not None:
            assert self.grads is not None  # given with the cross term
            weights, partner, partner_weights = self.cross
            first, second = float(self.grads.value(elements, weights)), float(partner.value(elements, partner_weights))
            total += math.sqrt(max(first, 0.0) * max(second, 0.0))
        for term in self.linear:
            total += term.value(elements)
        return total


def decrease_bound(
    sites: Sequence[Site],
    groups: Sequence[Group],
    ctx: TeleportContext,
    norm: Callable[[], GradientNormModel],
    grads: Mapping[str, Tensor],
    elements: Sequence[Tensor],
) -> DecreaseBound | None:
    """The bound for these fast-path sites (``grads``: their members' gradients, ``norm()`` their reduced norm, asked
    for only by SGD's bound: Adam's reads no squared gradient norm)
    at ``elements`` and any candidate closer to the identity, or ``None`` where the module docs give none.
    Reads each site tensor's gradient and moments once."""
    family, names = ctx.model.family, list(grads)
    if family not in ("sgd", "adam") or not names or any(bool(ctx.groups[n].get("maximize", False)) for n in names):
        return None
    if any(is_sharded(g) for g in grads.values()) or not all(isinstance(s.action, AxisAction) for s in sites):
        return None  # sharded: the exact decrease reduces over ranks; affine and learned actions: no pairing rule
    entries: dict[str, _Entries] = {n: [] for n in names}
    for i, (site, group) in enumerate(zip(sites, groups)):
        assert isinstance(site.action, AxisAction)  # checked above
        for member, n in zip(site.action.members, site.members):
            if n in entries:
                entries[n].append((i, member, group))
    diagonal = all(group.diagonal and group.continuous and _diagonal(group) for group in groups)
    if diagonal and not all(_whole_axes(entries[n], grads[n].ndim) for n in names):
        return None
    if family == "sgd":
        return _sgd(sites, ctx, norm, grads, entries if diagonal else None)
    # Adam: m' / sqrt(v') keeps its size only where the second moment has the squared rule (scalings)
    if not diagonal or not _transported(ctx, names, ("first_moment", "second_moment")):
        return None
    return _adam(ctx, grads, entries, elements)


def _whole_axes(entries: _Entries, ndim: int) -> bool:
    axes = [m.axis % ndim for _, m, _ in entries]
    return all(_plain(m) for _, m, _ in entries) and len(set(axes)) == len(axes)


def _transported(ctx: TeleportContext, names: Sequence[str], roles: Sequence[str]) -> bool:
    """Whether every state entry of these roles is transported (not kept or reset) by the policy."""
    for n in names:
        for key in ctx.state(n):
            role = state_role(ctx.optimizer, key)
            if role in roles and ctx.policy.resolve(key, role, ctx.optimizer) != "transport":
                return False
    return True


def _dots(pairs: Mapping[str, tuple[Tensor, Tensor]], coefficient: Mapping[str, float]) -> float:
    """sum_n coefficient_n <x_n, y_n> (summed in float64)."""
    terms = [coefficient[n] * (x.detach() * y.detach()).sum(dtype=torch.float64) for n, (x, y) in pairs.items() if coefficient.get(n)]
    return float(torch.stack(terms).sum()) if terms else 0.0


def _sgd(
    sites: Sequence[Site],
    ctx: TeleportContext,
    norm: Callable[[], GradientNormModel],
    grads: Mapping[str, Tensor],
    entries: dict[str, _Entries] | None,
) -> DecreaseBound | None:
    """SGD's decrease: exact for scalings (``entries`` given), Cauchy-Schwarz on the momentum for matrix groups."""
    squared: dict[str, float] = {}
    cross: dict[str, float] = {}
    decay: dict[str, float] = {}
    buffers: dict[str, Tensor] = {}
    for n, g in grads.items():
        group = ctx.groups[n]
        lr, mu = float(group["lr"]), float(group.get("momentum", 0.0))
        damp, wd = float(group.get("dampening", 0.0)), float(group.get("weight_decay", 0.0))
        nesterov = bool(group.get("nesterov", False))
        if mu:
            buf = ctx.state(n).get("momentum_buffer")
            if not isinstance(buf, Tensor) or buf.shape != g.shape:
                return None  # the first step's buffer is the gradient itself: the simulated decrease handles it
            buffers[n] = buf
        squared[n] = lr * (1 + mu * (1 - damp)) if nesterov and mu else lr * (1 - damp) if mu else lr
        cross[n] = lr * mu * mu if nesterov else lr * mu
        decay[n] = squared[n] * wd
    if buffers and not _transported(ctx, list(buffers), ("first_moment",)):
        return None
    params = {n: (g, ctx.trainable[n]) for n, g in grads.items()}
    constant = _dots(params, decay)
    squares = _dots({n: (g, g) for n, g in grads.items()}, squared)
    pairs = {n: (grads[n], b) for n, b in buffers.items()}
    exact = constant + squares + _dots(pairs, cross)
    model = norm()
    bound = DecreaseBound(model, constant, lambda: exact, squared)
    if not buffers:
        return bound
    if entries is not None:  # grad_e b_e moves by f_e^2: exact
        for n, b in buffers.items():
            g = grads[n].detach()
            work = torch.float64 if g.dtype == torch.float64 else torch.float32
            flat, other = g.reshape(-1), b.detach().reshape(-1)
            chunks = (flat[part].to(work) * other[part].to(work) for part in _row_chunks(g.shape))
            bound.linear.append(_Linear(chunks, g.shape, cross[n], entries[n], 2))
        return bound
    # w_n = ||b_n|| / ||g_n||: sum c_n ||g'_n|| ||b'_n|| <= sqrt(sum c_n w_n ||g'_n||^2) sqrt(sum c_n ||b'_n||^2 / w_n),
    # an equality at the identity
    g_norms, b_norms = _norms(grads), _norms(buffers)
    weights: dict[str, float] = {}
    partner_weights: dict[str, float] = {}
    for n in grads:
        g_norm, b_norm = g_norms[n], b_norms.get(n, 0.0)
        use = cross[n] > 0 and g_norm > 0 and b_norm > 0
        weights[n] = cross[n] * b_norm / g_norm if use else 0.0
        partner_weights[n] = cross[n] * g_norm / b_norm if use else 0.0
    bound.cross = (weights, GradientNormModel(sites, buffers, model.like), partner_weights)
    return bound


def _norms(tensors: Mapping[str, Tensor]) -> dict[str, float]:
    values = torch.stack(torch._foreach_norm([t.detach() for t in tensors.values()])).to(torch.float64).tolist()
    return dict(zip(tensors, values))


def _adam(
    ctx: TeleportContext, grads: Mapping[str, Tensor], entries: dict[str, _Entries], elements: Sequence[Tensor]
) -> DecreaseBound | None:
    decay: dict[str, float] = {}
    terms: list[_Linear] = []
    for n, g in grads.items():
        group = ctx.groups[n]
        wd = float(group.get("weight_decay", 0.0))
        if wd and not bool(group.get("decoupled_weight_decay", False)):
            return None  # L2 decay mixes w' into Adam's moments
        lowest = min(_extreme_factor(elements, entries[n], torch.amin), 1.0)
        chunks, scale = _adam_weights(group, ctx.state(n), g, lowest)
        terms.append(_Linear(chunks, g.shape, scale, entries[n], 1, lowest))
        decay[n] = float(group["lr"]) * wd
    constant = _dots({n: (g, ctx.trainable[n]) for n, g in grads.items()}, decay)

    def at_identity() -> float:  # a second pass, only for a cap the bound could not clear
        return constant + sum(
            float(W.sum(dtype=torch.float64)) * scale
            for chunks, scale in (_adam_weights(ctx.groups[n], ctx.state(n), g, None) for n, g in grads.items())
            for W in chunks
        )

    return DecreaseBound(None, constant, at_identity, linear=terms)


@torch.no_grad()
def _row_chunks(shape: torch.Size) -> list[slice]:
    """Slices of the flattened tensor of about ``_CHUNK`` entries each, whole rows (of the last axes) each."""
    cols = shape[1:].numel() if len(shape) > 1 else 1
    step = max(1, _CHUNK // max(1, cols)) * cols
    return [slice(start, start + step) for start in range(0, shape.numel(), step)]


def _adam_weights(group: dict[str, Any], state: Mapping[str, Any], grad: Tensor, lowest: float | None) -> tuple[Iterator[Tensor], float]:
    """(chunks of W, scale): scale * W_e f_e bounds entry e's term of <grad', u'> wherever f_e >= ``lowest``
    (module docs); with ``lowest`` None, scale * sum_e W_e is the decrease at the identity, eps included.

    m' and v' are Adam's moments after the next gradient (AMSGrad's running maximum).  A gradient whose
    square underflows (v'_e = 0 < |g_e|) reads as if sqrt(v'_e) were the smallest normal number: its
    positive term only grows, so the bound holds.  W comes in slices of whole rows of the flattened
    tensor (:func:`_row_chunks`), made as they are read, so the temporaries stay small."""
    lr, eps = float(group["lr"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    step = state.get("step", 0)
    t = (float(step.item()) if isinstance(step, Tensor) else float(step)) + 1
    root = math.sqrt((1 - beta2**t) / beta2)  # sqrt(v' / bc2) = sqrt(v' / beta2) / root
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    vmax = state.get("max_exp_avg_sq") if group.get("amsgrad", False) else None
    work = torch.float64 if grad.dtype == torch.float64 else torch.float32  # half precisions read in float32
    flat = [None if x is None else x.detach().reshape(-1) for x in (grad, m, v, vmax)]
    tiny = torch.finfo(work).tiny

    def chunks() -> Iterator[Tensor]:
        for part in _row_chunks(grad.shape):
            g, mi, vi, vm = (None if x is None else x[part].to(work) for x in flat)
            assert g is not None
            m1 = g.mul(1 - beta1) if mi is None else torch.lerp(mi, g, 1 - beta1)
            # v' / beta2 in one op
            v1 = g.square().mul_((1 - beta2) / beta2) if vi is None else torch.addcmul(vi, g, g, value=(1 - beta2) / beta2)
            if vm is not None:
                torch.maximum(v1, vm.div(beta2), out=v1)
            den = v1.sqrt_().clamp_min_(tiny)  # 0 / 0 (no gradient, no moments) reads 0
            gm = m1.mul_(g)
            if lowest is None:
                den.add_(eps * root)
            else:
                den.add_(gm.lt(0), alpha=eps * root / lowest)
            yield gm.div_(den)

    return chunks(), lr / (1 - beta1**t) * root
