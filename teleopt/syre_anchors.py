"""Anchors and decay kernel of :class:`~teleopt.syre.Syre` (Ziyin et al. 2025, eq. 6, eq. 7): draws, checks, math.

An anchor ``theta_0`` is a parameter-shaped Gaussian draw with standard deviation
``sigma0 / sqrt(fan_in)`` (Ziyin et al. 2025, Sec. 5.4: ``sigma0`` relative to the
initialisation scale); eq. 7's diagonal ``D`` is ``Uniform(1 - eps, 1 + eps)``.
Both come from a CPU ``torch.Generator`` seeded by ``(seed, parameter index,
stream)``, so every process, rank and device draws the same numbers; a sharded
(FSDP2) parameter keeps its shards of the same whole-tensor draw.  Complex
parameters are handled in their real view (``torch.view_as_real``): their anchors
and ``D`` have the real view's shape and dtype.  :func:`decay_list` is the decay's
functional kernel on one device/dtype bucket (like torch.optim's ``_single_tensor_*``
/ ``_multi_tensor_*`` kernels); :class:`~teleopt.syre.Syre` gathers the buckets.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from teleopt.sharding import from_local_like, is_sharded, shard_like

__all__ = [
    "OPTION_NAMES",
    "anchor_std",
    "add_penalty",
    "check_options",
    "check_scales",
    "decay_list",
    "draw_anchor",
    "draw_diagonal",
    "fan_in",
    "install_grads",
    "real_view",
    "use_foreach",
]

_MASK64 = (1 << 64) - 1
_ANCHOR_STREAM = 0
_DIAGONAL_STREAM = 1
OPTION_NAMES = ("gamma", "sigma0", "decoupled", "diagonal_eps", "enabled", "exclude_1d", "fan_in", "seed")
# |z| <= 16 for every standard normal draw ever made (P(|z| > 16) ~ 1e-57): anchors stay below 16 std.
_DRAW_BOUND = 16.0


def fan_in(shape: Iterable[int]) -> int | None:
    """torch.nn.init's fan-in of a weight of this shape (``shape[1] * prod(shape[2:])``); None below 2-D.

    This is the fan-in the default initialisers scale by, so ``sigma0`` is relative
    to the initialisation scale as in Ziyin et al. 2025, Sec. 5.4: ``(out, in)`` Linear
    weights have fan-in ``in``, ``(out, in / groups, *kernel)`` conv weights
    ``in / groups * prod(kernel)``.  1-D and 0-D tensors (biases, norm weights,
    scalars) have no defined fan-in.
    """
    dims = tuple(int(s) for s in shape)
    if len(dims) < 2:
        return None
    return dims[1] * math.prod(dims[2:])


def anchor_std(sigma0: float, shape: Iterable[int], group_fan_in: int | None) -> float:
    """Standard deviation of an anchor entry: ``sigma0 / sqrt(n)``.

    ``n`` is the group's ``fan_in`` when set, else the tensor's :func:`fan_in`;
    tensors below 2-D have none and use their length, the width ``d`` of Ziyin et al. 2025
    Sec. 5.4's ``0.01 / sqrt(d)`` (1 for a scalar).
    """
    dims = tuple(int(s) for s in shape)
    size = group_fan_in or fan_in(dims) or max(math.prod(dims), 1)
    return sigma0 / math.sqrt(size)


def real_view(t: Tensor) -> Tensor:
    """``t`` itself, or its real view (trailing axis of 2) when complex."""
    return torch.view_as_real(t) if t.is_complex() else t


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _generator(seed: int, index: int, stream: int) -> torch.Generator:
    """A CPU generator for (seed, parameter index, stream): the same numbers in every process and on every rank."""
    mixed = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ index) ^ stream)
    return torch.Generator(device="cpu").manual_seed(mixed)


def _draw_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 parameters get float64 draws; everything else is drawn in float32 and rounded.
    return torch.float64 if dtype == torch.float64 else torch.float32


def draw_anchor(seed: int, index: int, p: Tensor, std: float) -> Tensor:
    """The anchor of parameter ``index`` (in ``p``'s real view, device and dtype).

    The whole tensor is drawn, then laid out like ``p``: a sharded (FSDP2
    ``DTensor``) parameter gets the shards of the same anchor an unsharded one
    would get, whatever the world size (:func:`~teleopt.sharding.shard_like`; the
    draw costs one transient full-size CPU tensor per parameter).
    """
    target = real_view(p)
    generator = _generator(seed, index, _ANCHOR_STREAM)
    noise = torch.randn(target.shape, generator=generator, dtype=_draw_dtype(target.dtype))
    return shard_like(noise.mul_(std).to(device=target.device, dtype=target.dtype), target)


def draw_diagonal(seed: int, index: int, p: Tensor, eps: float) -> Tensor:
    """eq. 7's diagonal ``D ~ Uniform(1 - eps, 1 + eps)`` of parameter ``index`` (in ``p``'s real view; sharded like ``p``)."""
    target = real_view(p)
    generator = _generator(seed, index, _DIAGONAL_STREAM)
    uniform = torch.rand(target.shape, generator=generator, dtype=_draw_dtype(target.dtype))
    return shard_like(uniform.mul_(2 * eps).add_(1 - eps).to(device=target.device, dtype=target.dtype), target)


def check_options(options: dict[str, Any], where: str, prefix: str = "") -> None:
    """Validate syre hyperparameters (names without prefix); raises ValueError/TypeError naming the option.

    Messages name each option as ``prefix + name`` (``"teleopt_syre_"`` for the keys of a param group).
    A number of the wrong type is a ``TypeError``; a non-finite or out-of-range one a ``ValueError``.
    """
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"{where}: unknown syre option(s) {sorted(unknown)}; known: {list(OPTION_NAMES)}")
    for name in ("gamma", "sigma0", "diagonal_eps"):
        if name in options:
            _check_scale(name, options[name], where, prefix)
    for name in ("decoupled", "enabled", "exclude_1d"):
        if name in options and not isinstance(options[name], bool):
            raise TypeError(f"{where}: {prefix}{name} must be a bool, got {options[name]!r}")
    if options.get("fan_in") is not None:
        _check_fan_in(options["fan_in"], where, prefix)
    if "seed" in options and (not isinstance(options["seed"], int) or isinstance(options["seed"], bool)):
        raise TypeError(f"{where}: {prefix}seed must be an int, got {options['seed']!r}")


def _check_scale(name: str, value: Any, where: str, prefix: str = "") -> None:
    """gamma and sigma0 are finite reals >= 0; diagonal_eps lies in [0, 1) so that D is positive."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{where}: {prefix}{name} must be a finite real number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{where}: {prefix}{name} must be a finite real number, got {value!r}")
    if name == "diagonal_eps" and not 0 <= value < 1:
        raise ValueError(f"{where}: {prefix}diagonal_eps must lie in [0, 1) so that D is positive, got {value}")
    if value < 0:
        raise ValueError(f"{where}: {prefix}{name} must be >= 0, got {value}")


def _check_fan_in(value: Any, where: str, prefix: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{where}: {prefix}fan_in must be None or a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{where}: {prefix}fan_in must be a positive int, got {value}")


def check_scales(options: dict[str, Any], p: Tensor, where: str) -> None:
    """Anchors and decay of ``p`` under ``options`` (syre options) stay finite in its dtype, or ``ValueError``."""
    problem = _scale_problem(options["gamma"], options["sigma0"], options["diagonal_eps"], options["fan_in"], tuple(p.shape), p.dtype)
    if problem:
        raise ValueError(f"{where}: {problem}")


@functools.lru_cache(maxsize=4096)  # checked in every step: a few shapes and dtypes per model
def _scale_problem(
    gamma: float, sigma0: float, diagonal_eps: float, group_fan_in: int | None, shape: tuple[int, ...], dtype: torch.dtype
) -> str | None:
    """Why anchors or decay would overflow ``dtype``, or None.

    Anchor entries stay below ``16 std`` (:data:`_DRAW_BOUND`), which must be finite;
    the decay ``gamma * D * (w - theta_0)`` must be finite for ``|w - theta_0|`` up
    to ``16 * max(1, 32 std)`` (weights of magnitude up to 16 and the largest anchor).
    """
    std = anchor_std(sigma0, shape, group_fan_in)
    largest = torch.finfo(dtype.to_real() if dtype.is_complex else dtype).max
    if std * _DRAW_BOUND > largest:
        return (
            f"sigma0 gives anchors of standard deviation {std:.3g}, which overflow {dtype} "
            f"(largest finite value {largest:.3g}); choose a smaller sigma0"
        )
    if gamma * (1 + diagonal_eps) * _DRAW_BOUND * max(1.0, 2 * _DRAW_BOUND * std) > largest:
        return f"gamma={gamma:.3g} makes the decay overflow {dtype} (largest finite value {largest:.3g})"
    return None


# -- the decay kernel (one device/dtype bucket; Syre gathers the buckets) ---------------------------


def use_foreach(group: dict[str, Any], tensors: list[Tensor]) -> bool:
    """The base's choice: foreach/fused when it asked for them, torch's default (CUDA only) otherwise."""
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    if group.get("fused"):
        return True
    return all(t.device.type == "cuda" for t in tensors)


def decay_list(
    params: list[Tensor],
    grads: list[Tensor],
    anchors: list[Tensor],
    diagonals: list[Tensor] | None,
    coefficient: float,
    decoupled: bool,
    foreach: bool,
    scratch: list[Tensor] | None = None,
) -> list[Tensor]:
    """Apply the decay to one device/dtype bucket; returns the new gradients (coupled) or [].

    ``w - theta_0`` is formed first, so it is exactly 0 at the anchor (the fixed
    point stays exact even under Adam's normalisation); coupled mode then builds
    ``grad + coefficient * D * (w - theta_0)`` in the same buffer.  The buffers are
    ``scratch`` when given (reused across steps: on the CPU a fresh gradient-sized
    allocation per step costs more in page faults than the arithmetic), else new
    (one allocation per tensor, like torch's own coupled weight decay).
    """
    if foreach:
        if decoupled and diagonals is None:
            torch._foreach_lerp_(params, anchors, coefficient)
            return []
        if scratch is None:
            diffs = list(torch._foreach_sub(params, anchors))
        else:
            diffs = scratch
            torch._foreach_copy_(diffs, params)
            torch._foreach_sub_(diffs, anchors)
        if decoupled:
            assert diagonals is not None  # decoupled without diagonals returned above
            torch._foreach_addcmul_(params, diffs, diagonals, value=-coefficient)
            return []
        if diagonals is not None:
            torch._foreach_mul_(diffs, diagonals)
        torch._foreach_mul_(diffs, coefficient)
        torch._foreach_add_(diffs, grads)
        return diffs
    new_grads = []
    for i, (p, a) in enumerate(zip(params, anchors)):
        d = None if diagonals is None else diagonals[i]
        if decoupled and d is None:
            p.lerp_(a, coefficient)
            continue
        diff = p - a if scratch is None else torch.sub(p, a, out=scratch[i])
        if decoupled:
            assert d is not None  # decoupled without a diagonal continued above
            p.addcmul_(diff, d, value=-coefficient)
            continue
        if d is not None:
            diff.mul_(d)
        new_grads.append(diff.mul_(coefficient).add_(grads[i]))
    return new_grads


def warn_fixed_step_lbfgs(inner: torch.optim.Optimizer) -> None:
    """Warn when the innermost optimizer is an ``LBFGS`` without a line search.

    Syre enters every closure evaluation (LBFGS takes the steps of LBFGS on the decayed
    loss, eq. 6/7 of the syre paper), but a fixed-step LBFGS can jump to a loss many times
    its start on that objective where bare LBFGS happens not to; the strong-Wolfe line
    search removes the jump.
    """
    if isinstance(inner, torch.optim.LBFGS) and any(g.get("line_search_fn") is None for g in inner.param_groups):
        warnings.warn(
            "Syre: LBFGS without a line search (line_search_fn=None) takes fixed steps of lr, which can blow up "
            "on the decayed loss (as bare LBFGS on loss + gamma/2 |w - theta_0|^2 does); pass "
            "line_search_fn='strong_wolfe' to LBFGS",
            UserWarning,
            stacklevel=3,
        )


def install_grads(swapped: list[tuple[Tensor, Tensor | None]], ps: list[Tensor], new_grads: list[Tensor]) -> None:
    """Give each of ``ps`` its decayed gradient (a real view is viewed back as complex; a sharded
    gradient gets its layout back), recording ``(parameter, original gradient)`` in ``swapped``."""
    for p, g in zip(ps, new_grads):
        swapped.append((p, p.grad))
        g = torch.view_as_complex(g) if p.is_complex() else g
        p.grad = g if is_sharded(g) or p.grad is None else from_local_like(g, p.grad)


def add_penalty(value: Any, penalty: Tensor) -> Any:
    """A closure's loss plus the coupled groups' ``gamma / 2 |w - theta_0|_D^2`` (``None`` stays ``None``)."""
    if isinstance(value, Tensor):
        return value + penalty.to(device=value.device, dtype=value.dtype)
    return value if value is None else value + float(penalty)
