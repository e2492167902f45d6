"""Checking detected sites on the model itself: invariance, minimality, gradient transport.

The checks of CONVENTIONS.md sec. 3, for a model and its sites rather than an
action's example problem (those live in ``teleopt.testing``): the output is
compared in train *and* eval mode (BatchNorm statistics and dropout masks
restored between runs), norm-relatively, after acting in place with
``Site.apply_``; the model is restored afterwards.  Use them in your CI on the
model you train::

    report = teleopt.find_symmetries(model, x)
    for site in report.sites:
        g = site.action.random_element(site.tensors(model), generator)
        assert_site_invariant(model, site, g, x)

Needs the ``testing`` extra (``teleopt.testing``); ``find_symmetries`` itself does not.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor, nn

from teleopt.actions.base import required
from teleopt.numerics import assert_close, default_rtol, relative_error
from teleopt.site import Site

__all__ = [
    "model_outputs",
    "assert_site_invariant",
    "assert_sites_invariant",
    "assert_site_minimal",
    "assert_site_gradient_transport",
    "assert_batchnorm_site_exact",
    "randomize_",
]

Output = Callable[[Any], Tensor]


def _as_tuple(inputs: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    return (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)


@contextmanager
def _restored(model: nn.Module, tensors: Sequence[Tensor] = ()):
    """Restore the given tensors, all buffers and the train/eval flags on exit."""
    saved = [(t, t.detach().clone()) for t in list(tensors) + list(model.buffers())]
    flags = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, v in saved:
                t.copy_(v)
        for m, f in flags:
            m.training = f


def model_outputs(
    model: nn.Module, inputs: Tensor | Sequence[Tensor], modes: Sequence[str] = ("train", "eval"), output: Output | None = None
) -> Tensor:
    """The model's outputs in each mode, flattened and concatenated (same dropout masks, statistics restored)."""
    outs = []
    for mode in modes:
        if mode not in ("train", "eval"):
            raise ValueError(f"modes must be 'train' or 'eval', got {mode!r}")
        with _restored(model), torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model.train(mode == "train")
            y = model(*_as_tuple(inputs))
            outs.append((output(y) if output is not None else y).reshape(-1))
    return torch.cat(outs)


def _unique(site: Site, model: nn.Module, g: Tensor) -> dict[str, Tensor]:
    """Transformed value of every distinct tensor of the site."""
    new = site.act(model, g)
    return {name: required(v, name) for name, v in zip(site.members, new) if name is not None}


def assert_site_invariant(
    model: nn.Module,
    site: Site,
    g: Tensor,
    inputs: Tensor | Sequence[Tensor],
    rtol: float | None = None,
    modes: Sequence[str] = ("train", "eval"),
    output: Output | None = None,
    reference: Tensor | None = None,
) -> float:
    """Assert that acting with ``g`` on the site leaves the outputs unchanged; returns the relative error.

    ``rtol`` defaults to :func:`teleopt.numerics.default_rtol` of the parameters' dtype for
    exact sites; approximate sites need their stated budget.  ``reference`` is
    ``model_outputs(model, inputs, modes, output)`` if already computed.
    """
    return assert_sites_invariant(model, [site], [g], inputs, rtol, modes, output, reference)


def assert_sites_invariant(
    model: nn.Module,
    sites: Sequence[Site],
    elements: Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    rtol: float | None = None,
    modes: Sequence[str] = ("train", "eval"),
    output: Output | None = None,
    reference: Tensor | None = None,
) -> float:
    """Assert invariance when all ``sites`` act at once (in order), each with its element."""
    if len(sites) != len(elements):
        raise ValueError(f"got {len(sites)} sites but {len(elements)} elements")
    if rtol is None:
        if any(s.action.exactness != "exact" for s in sites):
            raise ValueError("approximate sites need an explicit rtol (their stated budget)")
        rtol = default_rtol(next(iter(model.parameters())).dtype)
    live = [t for s in sites for t in s.tensors(model) if t is not None]
    before = model_outputs(model, inputs, modes, output) if reference is None else reference
    with _restored(model, live):
        for s, g in zip(sites, elements):
            s.apply_(model, g)
        after = model_outputs(model, inputs, modes, output)
    names = ", ".join(s.name for s in sites[:3]) + (" ..." if len(sites) > 3 else "")
    return assert_close(after, before, rtol, f"invariance of the output under {names}")


def assert_site_minimal(  # noqa: PLR0913  public: assert_site_invariant's arguments, a member and a threshold
    model: nn.Module,
    site: Site,
    g: Tensor,
    inputs: Tensor | Sequence[Tensor],
    left_out: str,
    min_change: float = 1e-8,
    modes: Sequence[str] = ("train", "eval"),
    output: Output | None = None,
    reference: Tensor | None = None,
) -> float:
    """Assert that acting on every member but ``left_out`` changes the output (the site is not over-tied)."""
    if left_out not in site.members:
        raise ValueError(f"{left_out!r} is not a member of {site.name}")
    live = dict(zip(site.members, site.tensors(model)))
    before = model_outputs(model, inputs, modes, output) if reference is None else reference
    new = _unique(site, model, g)
    with _restored(model, [t for t in live.values() if t is not None]):
        with torch.no_grad():
            for name, value in new.items():
                if name != left_out:
                    required(live[name], name).copy_(value)
        after = model_outputs(model, inputs, modes, output)
    err = relative_error(after, before)
    if not err > min_change:
        raise AssertionError(
            f"{site.name}: acting on every member but {left_out} leaves the output unchanged "
            f"(relative change {err:.2e}): the site is over-tied"
        )
    return err


def assert_site_gradient_transport(
    model: nn.Module,
    site: Site,
    g: Tensor,
    loss_fn: Callable[[nn.Module], Tensor],
    rtol: float | None = None,
) -> float:
    """Assert grad L at g.w equals ``site.action.transport_gradient(g, grad L at w)`` (Zhao 2026, eq. 4.19)."""
    if not site.action.has_gradient_transport:
        raise ValueError(f"{site.name}: {site.action.name} has no closed-form gradient transport")
    live = {n: required(t, n) for n, t in zip(site.members, site.tensors(model)) if n is not None}
    names = list(dict.fromkeys(live))

    trained = [n for n in names if live[n].requires_grad]

    def grads() -> dict[str, Tensor]:
        with _restored(model):
            loss = loss_fn(model)
            out = dict(zip(trained, torch.autograd.grad(loss, [live[n] for n in trained], allow_unused=True)))
        return {n: torch.zeros_like(live[n]) if out.get(n) is None else out[n] for n in names}  # buffers: no gradient

    here = grads()
    at = tuple(None if n is None else live[n].detach() for n in site.members)
    transported = site.action.transport_gradient_at(g, tuple(None if n is None else here[n] for n in site.members), at)
    with _restored(model, list(live.values())):
        site.apply_(model, g)
        there = grads()
    expected = torch.cat([there[n].reshape(-1) for n in names])
    by_name = dict(zip(site.members, transported))
    actual = torch.cat([required(by_name[n], n).reshape(-1) for n in names])
    tol = default_rtol(expected.dtype) if rtol is None else rtol
    return assert_close(actual, expected, tol, f"{site.name}: gradient transport")


def assert_batchnorm_site_exact(
    model: nn.Module,
    site: Site,
    c: float,
    inputs: Tensor | Sequence[Tensor],
    rtol: float | None = None,
    reference: Tensor | None = None,
) -> float:
    """Check an eps-approximate BatchNorm input site exactly (Zhao 2026, Ex. 1.2.7).

    BN(c z) computed with eps * c^2 equals BN(z) with eps, in train mode (batch
    statistics) and in eval mode (running mean times c, running variance times c^2).
    So with one scale ``c`` for every channel, acting on a copy of the model and
    multiplying the eps of the site's BatchNorms (``site.info["batchnorm"]``) by c^2
    must leave the outputs unchanged to the exact tolerance: this tests the site's
    members and powers without the eps error, whatever the batch variance.
    """
    if site.action.exactness != "approximate" or not site.info.get("batchnorm"):
        raise ValueError(f"{site.name} is not an approximate BatchNorm input site")
    reference = model_outputs(model, inputs) if reference is None else reference
    moved = copy.deepcopy(model)
    n = site.action.group(site.tensors(moved)).dim
    site.apply_(moved, torch.full((n,), float(c), dtype=next(iter(moved.parameters())).dtype))
    for path in site.info["batchnorm"]:
        bn = cast(nn.modules.batchnorm._NormBase, moved.get_submodule(path))  # the site's info names BatchNorms
        bn.eps = bn.eps * c**2
    tol = default_rtol(reference.dtype) if rtol is None else rtol
    return assert_close(model_outputs(moved, inputs), reference, tol, f"{site.name} with eps * c^2")


@torch.no_grad()
def randomize_(model: nn.Module, generator: torch.Generator, bias_scale: float = 0.5) -> nn.Module:
    """Randomise every parameter and BatchNorm statistic so that no symmetry bug can hide (CONVENTIONS.md sec. 3).

    Weights get variance 1/fan_in (activations stay of order one through depth),
    biases and other vectors are nonzero, multiplicative vectors (norm weights,
    LayerScale, PReLU slopes) are 1 +- ``bias_scale``, running means are nonzero and
    running variances in [0.5, 1.5].  Returns the model.
    """
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
        if p.ndim >= 2 and name.endswith("weight"):
            value = noise / max(1, p[0].numel()) ** 0.5
        elif p.ndim == 1 and not name.endswith("bias"):
            value = 1.0 + bias_scale * noise
        else:
            value = bias_scale * noise
        p.copy_(value.to(p.dtype))
    for name, b in model.named_buffers():
        if not b.is_floating_point():
            continue
        if name.endswith("running_var"):
            b.copy_((torch.rand(b.shape, generator=generator, dtype=torch.float64) + 0.5).to(b.dtype))
        elif name.endswith("running_mean"):
            b.copy_((bias_scale * torch.randn(b.shape, generator=generator, dtype=torch.float64)).to(b.dtype))
    return model
