"""The fast path agrees with the reference teleport (Algorithm 1 by ``torch.func``), in float64.

The reference (:func:`teleopt.teleport.reference.reference_teleport`) takes every
derivative through the model; the fast path evaluates ||grad L(g . w)||^2 and moves
``.grad`` in closed form (Zhao 2026, Prop. 4.5.1, eq. 4.19).  At the same element
both are the same function of float64 numbers computed in different orders, so
they agree to round-off: relative 1e-10 (teleopt.testing's default float64 rtol)
leaves four or five orders of margin over the ~1e-14 reached with scales in
[e^-1, e^1] and GL blocks of condition number <= e^2, while a wrong exponent,
a transposed element or a first-order inverse differs by 1e-3 or more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from teleopt import Site, get_action
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, SearchProblem, SearchResult, Teleport
from teleopt.teleport.reference import reference_teleport
from teleopt.testing import assert_close, seeds

RTOL = 1e-10
LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)


def mse(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).mean()


def rescaling_model(widths: Sequence[int], seed: int) -> tuple[nn.Sequential, list[Site]]:
    """A LeakyReLU MLP with one positive-rescaling site per hidden layer (the paper's MLP)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.LeakyReLU(0.1)] if i < len(widths) - 2 else [])
    sites = [Site(LEAKY, (f"{2 * i}.weight", f"{2 * i}.bias", f"{2 * i + 2}.weight")) for i in range(len(widths) - 2)]
    return nn.Sequential(*layers).double(), sites


def gl_model(widths: Sequence[int], seed: int) -> tuple[nn.Sequential, list[Site]]:
    """A linear hidden layer (GL between layers 0 and 2) followed by a rescaled LeakyReLU layer."""
    torch.manual_seed(seed)
    a, b, c, d = widths
    model = nn.Sequential(nn.Linear(a, b), nn.Identity(), nn.Linear(b, c), nn.LeakyReLU(0.1), nn.Linear(c, d)).double()
    return model, [Site(get_action("gl_linear"), ("0.weight", "0.bias", "2.weight")), Site(LEAKY, ("2.weight", "2.bias", "4.weight"))]


FAMILIES: dict[str, Callable[[Sequence[int], int], tuple[nn.Sequential, list[Site]]]] = {
    "rescalings": rescaling_model,
    "GL and rescaling": gl_model,
}


def batch(model: nn.Sequential, seed: int, n: int = 12) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    first, last = model[0], model[len(model) - 1]
    assert isinstance(first, nn.Linear) and isinstance(last, nn.Linear)
    x = torch.randn(n, first.in_features, generator=gen, dtype=torch.float64)
    return x, torch.randn(n, last.out_features, generator=gen, dtype=torch.float64)


def random_coords(model: nn.Module, sites: Sequence[Site], seed: int, scale: float) -> list[Tensor]:
    """Lie-algebra coordinates of size ``scale`` (spectral norm of GL blocks <= scale)."""
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    out = []
    for site in sites:
        shape = site.action.coord_shape(tuple(None if n is None else state[n] for n in site.members))
        assert shape is not None
        xi = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1
        out.append(scale * (xi / torch.linalg.matrix_norm(xi, 2) if xi.dim() == 2 else xi))
    return out


class Fixed:
    """A search strategy that returns the given coordinates (one teleport with a chosen element)."""

    def __init__(self, coords: Sequence[Tensor]) -> None:
        self.coords = [c.clone() for c in coords]

    def search(self, problem: SearchProblem) -> SearchResult:
        return SearchResult([c.clone() for c in self.coords])


class PlainAscent:
    """Algorithm 1's plain gradient ascent, on the fast path's own score (its closed-form objective)."""

    def __init__(self, steps: int, lr: float) -> None:
        self.steps, self.lr = steps, lr

    def search(self, problem: SearchProblem) -> SearchResult:
        xs = [c.clone() for c in problem.start]
        for _ in range(self.steps):
            leaves = [x.requires_grad_(True) for x in xs]
            with torch.enable_grad():
                grads = torch.autograd.grad(problem.score(leaves), leaves)
            xs = [x.detach() + self.lr * g for x, g in zip(xs, grads)]
        return SearchResult(xs)


def fast_teleport(model: nn.Module, sites: list[Site], data: tuple[Tensor, Tensor], strategy: object, sgd_lr: float) -> Teleport:
    """One teleporting ``step()`` on the fast path with ``strategy``, caps and watch off, from .grad at w."""
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=sgd_lr),
        model,
        sites,
        search=SearchConfig(trust_region=None, path="fast", strategy=strategy),  # type: ignore[arg-type]
        safety=SafetyConfig(max_predicted_decrease=None, watch_steps=0),
        example_inputs=data[0],
        schedule=Schedule(at=[0]),
    )
    model.zero_grad()
    mse(model(data[0]), data[1]).backward()
    opt.step()
    return opt


def check_agreement(opt: Teleport, model: nn.Module, ref, sites: list[Site]) -> None:
    report = opt.reports[-1]
    assert report.accepted and report.path == "fast" and report.shrink == 1.0, report.reason
    for site, element in zip(sites, ref.elements):
        assert_close(report.elements[site.name], element, rtol=RTOL)
    assert report.grad_norm_before is not None and report.grad_norm_after is not None
    assert report.grad_norm_before**2 == pytest.approx(ref.objective_before, rel=RTOL)
    assert report.grad_norm_after**2 == pytest.approx(ref.objective_after, rel=RTOL)
    gain = report.grad_norm_after**2 / report.grad_norm_before**2
    assert gain == pytest.approx(ref.objective_after / ref.objective_before, rel=RTOL)
    params = dict(model.named_parameters())
    for name, stepped in ref.stepped.items():  # g . w - lr grad L(g . w): the teleported point, then SGD
        assert_close(params[name].detach(), stepped, rtol=RTOL)


@settings(deadline=None, max_examples=6)
@given(
    family=st.sampled_from(sorted(FAMILIES)),
    widths=st.lists(st.integers(2, 5), min_size=4, max_size=4),
    seed=seeds(),
    scale=st.floats(0.0, 1.0),
)
@example(family="rescalings", widths=[3, 4, 4, 2], seed=0, scale=0.0)  # the identity
@example(family="GL and rescaling", widths=[3, 4, 5, 2], seed=1, scale=1.0)
def test_fast_path_agrees_with_the_reference_at_the_same_element(family, widths, seed, scale):
    """Objective before and after, gain, elements, and g . w - lr grad L(g . w) after one step."""
    model, sites = FAMILIES[family](widths, seed % 1000)
    data = batch(model, seed)
    coords = random_coords(model, sites, seed + 1, scale)
    ref = reference_teleport(model, sites, data, mse, coords=coords, sgd_lr=0.05)
    if scale == 0.0:  # the identity: declined ("no improvement found"), nothing moves
        opt = fast_teleport(model, sites, data, Fixed(coords), 0.05)
        assert not opt.reports[-1].accepted
        return
    check_agreement(fast_teleport(model, sites, data, Fixed(coords), 0.05), model, ref, sites)


@settings(deadline=None, max_examples=4)
@given(family=st.sampled_from(sorted(FAMILIES)), seed=seeds())
@example(family="GL and rescaling", seed=0)
def test_fast_path_ascent_agrees_with_the_reference_ascent(family, seed):
    """Five plain gradient-ascent steps on the fast path's closed-form objective reach the reference's
    coordinates (derivatives through the model), hence the same element, gain and stepped parameters."""
    model, sites = FAMILIES[family]([3, 4, 4, 2], seed % 1000)
    data = batch(model, seed)
    ref = reference_teleport(model, sites, data, mse, steps=5, lr=0.02, sgd_lr=0.05)
    assert ref.objective_after > ref.objective_before  # the ascent ascends
    check_agreement(fast_teleport(model, sites, data, PlainAscent(5, 0.02), 0.05), model, ref, sites)


def test_the_reference_leaves_the_model_unchanged_and_its_teleport_preserves_the_loss():
    model, sites = rescaling_model([3, 5, 4, 2], 0)
    data = batch(model, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = reference_teleport(model, sites, data, mse, coords=random_coords(model, sites, 1, 1.0))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name])
    moved = torch.func.functional_call(model, ref.params, (data[0],))
    assert_close(mse(moved, data[1]), mse(model(data[0]), data[1]), rtol=RTOL)
    assert ref.objective_after != pytest.approx(ref.objective_before, rel=1e-3)  # it did move


def test_the_reference_rejects_a_negative_step_count():
    model, sites = rescaling_model([3, 4, 4, 2], 0)
    with pytest.raises(ValueError, match="steps"):
        reference_teleport(model, sites, batch(model, 0), mse, steps=-1)
