"""Teleports are exact in the precision the model trains in (float32, or bfloat16 under autocast).

A GL element multiplies some members by g and others by g^-T: their product is unchanged, but a
product computed from rounded factors errs by about u ||g X|| ||g^-T Y||.  The round-off
amplification iota = ||g X|| ||g^-T Y|| / ||Y^T X||_* (1 at the balanced point, the same
denominator on the whole orbit) is bounded per dtype in the search, so elements that would move
the training forward by more than its own round-off are shrunk before anything moves, and repeated
teleports cannot compound.  The check runs its forwards in full precision (autocast off, whatever
the caller's region) and, when the model trains under autocast, in that precision too, without
autocast's weight cache.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DIM, HEADS, SeparateQKVAttention
from torch import nn
from torch.nn import functional as F

import teleopt
from teleopt.groups import GeneralLinear
from teleopt.registry import get_action
from teleopt.site import Site
from teleopt.teleport import Schedule, coordinates
from teleopt.teleport.precision import Precision, PrecisionRecorder

Attention = SeparateQKVAttention


def _sites() -> list[Site]:
    qk, vo = get_action("attention_qk_gl", num_heads=HEADS), get_action("attention_vo_gl", num_heads=HEADS)
    return [Site(qk, ("q.weight", "q.bias", "k.weight", "k.bias"), name="qk"), Site(vo, ("v.weight", "v.bias", "o.weight"), name="vo")]


def _setup(seed: int = 0) -> tuple[nn.Module, teleopt.Teleport, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = Attention()
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(16, 6, DIM, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt = teleopt.Teleport(
        torch.optim.Adam(model.parameters(), 1e-3), model, _sites(), loss_fn=F.cross_entropy, example_inputs=x[:4], schedule=Schedule()
    )
    return model, opt, x, y


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _bf16(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        return model(x).float()


def _amplification(model: nn.Module, site: Site) -> torch.Tensor:
    """The round-off amplification of every block of ``site`` at the model's weights now."""
    params = site.tensors(model)
    group = site.action.group(params)
    stats = site.action.norm_statistics(group, params)
    iota = group.roundoff_amplification(stats, torch.zeros(group.coord_shape, dtype=torch.float64))
    return iota(torch.zeros(1, dtype=torch.float64))


def test_a_teleport_inside_an_autocast_region_moves_the_float32_weights_exactly():
    model, opt, x, y = _setup()
    with torch.no_grad():
        before = model(x)
    with torch.autocast("cpu", torch.bfloat16):
        F.cross_entropy(model(x), y).backward()
        report = opt.teleport()
        inside = model(x).detach().float()  # a forward after the teleport, in the same region
    assert report.accepted, report.reason
    assert report.grad_norm_after > report.grad_norm_before
    with torch.no_grad():
        after = model(x)
    # float32 round-off of the element (main: 8-10% with check_error 0.0, the check read autocast's cached copies)
    assert _relative(after, before) <= 1e-5
    # autocast's cache of the old weights never stands in for the new ones, in the region either
    assert torch.equal(inside, _bf16(model, x))
    assert "bfloat16 autocast" in report.check_detail


def test_the_precision_recorder_keeps_the_training_forward_not_an_evaluation():
    model, recorder = nn.Linear(3, 2), PrecisionRecorder()
    model.register_forward_pre_hook(recorder)
    x = torch.randn(2, 3)
    assert recorder.training() == Precision()
    with torch.autocast("cpu", torch.bfloat16):
        model(x)
    with torch.no_grad():
        model(x)  # an evaluation in float32 is not the training forward
    assert recorder.training() == Precision((("cpu", torch.bfloat16),))
    assert recorder.training().compute_dtype([model.weight]) == torch.bfloat16
    assert Precision().compute_dtype([model.weight]) == torch.float32


def test_bf16_teleports_back_to_back_stay_within_twice_the_round_off():
    model, opt, x, y = _setup()
    untouched = [p.detach().clone() for p in model.parameters()]
    probe = torch.randn(8, 6, DIM, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        f32 = model(probe)
    bf16_before = _bf16(model, probe)
    with torch.autocast("cpu", torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()  # the training forward ran under autocast; backward and teleports outside it
    reports = []
    for _ in range(5):
        params = [p.detach().clone() for p in model.parameters()]
        reports.append(opt.teleport(batch=(x, y)))
        if not reports[-1].accepted:  # declined before anything moved, never applied and rolled back
            assert reports[-1].reason.startswith("declined"), reports[-1].reason
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert reports[0].accepted and reports[0].grad_norm_after > reports[0].grad_norm_before
    r0 = _relative(bf16_before, f32)
    drift = _relative(_bf16(model, probe), bf16_before)
    assert drift <= 2 * r0, (drift, r0)  # main: 97x r0, the elements compounding
    for site in opt.sites or []:
        assert float(_amplification(model, site).max()) <= coordinates.ROUNDOFF_CAPS[torch.bfloat16] * (1 + 1e-9)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), untouched))
    assert "round-off bound" in reports[-1].reason


def test_float32_teleports_back_to_back_are_never_rolled_back_for_round_off():
    model, opt, x, y = _setup()
    F.cross_entropy(model(x), y).backward()
    reports = [opt.teleport(batch=(x, y)) for _ in range(6)]
    assert not [r.reason for r in reports if r.reason.startswith("rolled back")]
    assert sum(r.accepted for r in reports) >= 2
    for site in opt.sites or []:
        assert float(_amplification(model, site).max()) <= coordinates.ROUNDOFF_CAPS[torch.float32] * (1 + 1e-9)


def test_the_check_in_the_training_precision_rolls_back_what_the_bound_would_have_shrunk(monkeypatch):
    monkeypatch.setattr(coordinates, "ROUNDOFF_CAPS", {d: 1e12 for d in coordinates.ROUNDOFF_CAPS})
    model, opt, x, y = _setup()
    with torch.autocast("cpu", torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    reports = [opt.teleport(batch=(x, y)) for _ in range(3)]
    failed = [r for r in reports if not r.accepted]
    assert failed and "training precision (bfloat16 autocast on cpu)" in failed[0].reason, [r.reason for r in reports]


def test_round_off_amplification_is_one_at_the_balanced_point_and_orbit_invariant():
    gen = torch.Generator().manual_seed(0)
    group = GeneralLinear(4, 3)
    X, Y = torch.randn(12, 20, generator=gen, dtype=torch.float64), torch.randn(12, 30, generator=gen, dtype=torch.float64)
    stats = {1.0: group.norm_statistic(X, 0), -1.0: group.norm_statistic(Y, 0)}
    one = torch.ones(3, dtype=torch.float64)
    at_identity = group.roundoff_amplification(stats, torch.zeros(3, 4, 4, dtype=torch.float64))(one)
    assert bool((at_identity >= 1).all())
    balanced = group.roundoff_amplification(stats, group.balance(stats, None))(one)
    torch.testing.assert_close(balanced, torch.ones_like(balanced), rtol=0, atol=1e-10)
    xi = 0.5 * torch.randn(3, 4, 4, generator=gen, dtype=torch.float64)
    for coords in (xi + xi.mT, xi):  # the symmetric closed form and the matrix exponential
        moved = group.roundoff_amplification(stats, coords)(one)
        g = torch.linalg.matrix_exp(coords)
        Xg = group.act_on_axis(g, X, 0)
        Yg = group.act_on_axis(g, Y, 0, power=-1)
        there = {1.0: group.norm_statistic(Xg, 0), -1.0: group.norm_statistic(Yg, 0)}
        direct = group.roundoff_amplification(there, torch.zeros(3, 4, 4, dtype=torch.float64))(one)
        torch.testing.assert_close(moved, direct, rtol=1e-9, atol=0)


def test_groups_without_round_off_growth_have_no_amplification():
    from teleopt.groups import Orthogonal, PositiveScaling

    stats = {1.0: torch.ones(4, dtype=torch.float64), -1.0: torch.ones(4, dtype=torch.float64)}
    assert PositiveScaling(4).roundoff_amplification(stats, torch.zeros(4, dtype=torch.float64)) is None
    assert Orthogonal(4).roundoff_amplification(stats, torch.zeros(4, 4, dtype=torch.float64)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_within_roundoff_shrinks_each_block_to_its_bound(dtype):
    gen = torch.Generator().manual_seed(3)
    model = Attention()
    site = _sites()[0]
    params = site.tensors(model)
    group = site.action.group(params)
    xi = 2.0 * torch.randn(group.coord_shape, generator=gen, dtype=torch.float64)
    xi = xi + xi.mT
    (out,) = coordinates.within_roundoff([site], [group], [xi], [params], [dtype])
    stats = site.action.norm_statistics(group, params)
    iota = group.roundoff_amplification(stats, out)(torch.ones(HEADS, dtype=torch.float64))
    cap = coordinates.ROUNDOFF_CAPS[dtype]
    assert bool((iota <= cap * (1 + 1e-12)).all()) and bool((iota >= cap * 0.99).any())  # at the bound, not far inside
    scales = out.reshape(HEADS, -1).norm(dim=1) / xi.reshape(HEADS, -1).norm(dim=1)
    assert bool((scales <= 1).all()) and bool((scales > 0).all())
