"""Assertions that a group action is a symmetry (Zhao 2026, Sec. 1.1, Prop. 4.5.1).

All comparisons are norm-relative: ``|actual - expected| <= rtol * |expected|`` in
the Frobenius norm over the whole tensor, so outputs near zero do not fail an exact
symmetry (element-wise rtol does).  Failure messages name the quantity, give the
relative error and show the worst entry.

Default tolerances and the norm-relative comparison live in :mod:`teleopt.numerics`
(one table for the whole library) and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.base import ExampleProblem, GroupAction, Params
from teleopt.numerics import assert_close, default_rtol, relative_error

__all__ = [
    "relative_error",
    "assert_close",
    "assert_invariant",
    "assert_group_axioms",
    "assert_gradient_transport",
    "check_action",
    "default_rtol",
]


def _rtol(rtol: float | None, params: Params) -> float:
    if rtol is not None:
        return rtol
    ref = next(p for p in params if p is not None)
    return default_rtol(ref.dtype)


def assert_invariant(
    action: GroupAction,
    g: Tensor,
    params: Params,
    fn: Callable[[Params, Any], Tensor],
    data: Any = None,
    rtol: float | None = None,
) -> float:
    """Assert fn(g . w, data) == fn(w, data) (output or loss invariance); returns the relative error.

    For data-dependent actions ``data`` is the batch the symmetry holds on and is
    passed to ``act`` as well.
    """
    moved = action.act(g, params, data)
    with torch.no_grad():
        before, after = fn(params, data), fn(moved, data)
    return assert_close(after, before, _rtol(rtol, params), f"{action.name}: invariance of the output")


def _assert_params_close(actual: Params, expected: Params, rtol: float, what: str, names: tuple[str, ...]) -> float:
    """Compare parameter tuples as one vector (a member whose value is ~0, e.g. the gradient of a
    key bias, which softmax ignores, is judged against the scale of the whole tuple)."""
    pairs = [(a, e, n) for a, e, n in zip(actual, expected, names) if not (a is None and e is None)]
    for a, e, n in pairs:
        if (a is None) != (e is None) or a.shape != e.shape:  # type: ignore[union-attr]
            return assert_close(a, e, rtol, f"{what} [{n}]")
    flat_a = torch.cat([a.detach().reshape(-1).to(torch.float64) for a, _, _ in pairs])  # type: ignore[union-attr]
    flat_e = torch.cat([e.detach().reshape(-1).to(torch.float64) for _, e, _ in pairs])  # type: ignore[union-attr]
    err = relative_error(flat_a, flat_e)
    if not err <= rtol or not bool(torch.isfinite(flat_a).all()):
        worst = max(pairs, key=lambda t: float((t[0].detach() - t[1].detach()).norm()))  # type: ignore[union-attr]
        scale = float(flat_e.norm()) or 1.0
        try:
            assert_close(worst[0], worst[1], 0.0 if err > rtol else rtol, f"{what} [{worst[2]}]")
        except AssertionError as detail:
            raise AssertionError(
                f"{what}: relative error {err:.3e} > rtol {rtol:.1e} (scale {scale:.3e}); worst member: {detail}"
            ) from None
    return err


def assert_group_axioms(
    action: GroupAction,
    params: Params,
    g1: Tensor,
    g2: Tensor,
    data: Any = None,
    rtol: float | None = None,
) -> float:
    """Assert e . w = w, g1 . (g2 . w) = (g1 g2) . w and g^{-1} . (g . w) = w; returns the worst error."""
    tol = _rtol(rtol, params)
    names = action.member_names
    errs = [
        _assert_params_close(action.act(action.identity(params), params, data), params, tol, f"{action.name}: identity axiom", names),
        _assert_params_close(
            action.act(g1, action.act(g2, params, data), data),
            action.act(action.compose(g1, g2), params, data),
            tol,
            f"{action.name}: composition axiom",
            names,
        ),
        _assert_params_close(
            action.act(action.inverse(g1), action.act(g1, params, data), data), params, tol, f"{action.name}: inverse axiom", names
        ),
    ]
    return max(errs)


def _gradients(loss_fn: Callable[[Params, Any], Tensor], params: Params, data: Any) -> Params:
    leaves = tuple(None if p is None else p.detach().clone().requires_grad_(True) for p in params)
    present = [p for p in leaves if p is not None]
    grads = iter(torch.autograd.grad(loss_fn(leaves, data), present, allow_unused=True))
    out: list[Tensor | None] = []
    for p in leaves:
        if p is None:
            out.append(None)
        else:
            gr = next(grads)
            out.append(torch.zeros_like(p) if gr is None else gr)
    return tuple(out)


def assert_gradient_transport(
    action: GroupAction,
    g: Tensor,
    params: Params,
    loss_fn: Callable[[Params, Any], Tensor],
    data: Any = None,
    rtol: float | None = None,
) -> float:
    """Assert grad L(g . w) == transport_gradient(g, grad L(w)) against autograd (Zhao 2026, eq. 4.19)."""
    grad_here = _gradients(loss_fn, params, data)
    moved = tuple(None if p is None else p.detach() for p in action.act(g, params, data))
    grad_there = _gradients(loss_fn, moved, data)
    transported = action.transport_gradient_at(g, grad_here, params)
    return _assert_params_close(transported, grad_there, _rtol(rtol, params), f"{action.name}: gradient transport", action.member_names)


def check_action(
    action: GroupAction,
    seed: int = 0,
    trials: int = 5,
    dtype: torch.dtype = torch.float64,
    rtol: float | None = None,
    scale: float = 0.5,
    problem: ExampleProblem | None = None,
) -> dict[str, float]:
    """Run every check on the action's example problem with ``trials`` random elements.

    A quick non-hypothesis entry point for users (``check_action(my_action)`` in a
    test); returns the worst relative error of each property.  Approximate actions
    need an explicit ``rtol`` (their stated budget).
    """
    if action.exactness == "approximate" and rtol is None:
        raise ValueError(f"{action.name} is approximate: pass rtol=<its stated error budget>")
    gen = torch.Generator().manual_seed(seed)
    problem = action.example(gen, dtype) if problem is None else problem
    params, data = problem.params, problem.data
    worst = {"invariance": 0.0, "axioms": 0.0}
    for _ in range(trials):
        g1 = action.random_element(params, gen, scale)
        g2 = action.random_element(params, gen, scale)
        worst["invariance"] = max(worst["invariance"], assert_invariant(action, g1, params, problem.fn, data, rtol))
        worst["axioms"] = max(worst["axioms"], assert_group_axioms(action, params, g1, g2, data, rtol))
        if action.has_gradient_transport and action.exactness == "exact":
            err = assert_gradient_transport(action, g1, params, problem.loss, data, rtol)
            worst["gradient_transport"] = max(worst.get("gradient_transport", 0.0), err)
    return worst
