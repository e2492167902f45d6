"""A lean balance teleport's GL lanes in few kernels, with the engine's values.

Every-step balance costs what its kernels cost: a lane's parameter parts, gradient parts and each kind of transported
moment are stacked and multiplied by their block matrices in one batched product per kind (not one per part); a
bucket's block matrices are stacked once per power; the near-balance step leaves each element and contragredient
in the cache, and its exponential pair is the matrix exponential and its inverse to float64 round-off.  The moved
values stay those of the engine (float64, 1e-12 of their scale, as ``tests/test_balance_companion.py``).
"""

from __future__ import annotations

import pytest
import torch
from test_balance_companion import LORA, _close, _step_with_engine_twin, attention, lora_like, wrapped
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from teleopt import Site
from teleopt.groups.expm import expm_pair_horner
from teleopt.teleport import lean_moves
from teleopt.teleport.companion import BalanceCompanion

PRODUCTS = {torch.ops.aten.bmm.default, torch.ops.aten.mm.default, torch.ops.aten.baddbmm.default, torch.ops.aten.addmm.default}


class _Products(TorchDispatchMode):
    """Counts matrix products."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func in PRODUCTS
        return func(*args, **(kwargs or {}))


class TwoPairs(nn.Module):
    """Two low-rank pairs B A side by side whose B have different shapes: their A rows share a lane, their B
    columns take one lane each."""

    def __init__(self) -> None:
        super().__init__()
        self.A1, self.A2 = (nn.Parameter(torch.randn(3, 8)) for _ in range(2))
        self.B1, self.B2 = nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x @ self.A1.T @ self.B1.T, x @ self.A2.T @ self.B2.T], -1)


def two_pairs() -> tuple[nn.Module, list[Site], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=gen, dtype=torch.float64), torch.randn(16, 9, generator=gen, dtype=torch.float64)
    return TwoPairs().double(), [Site(LORA, ("B1", "A1")), Site(LORA, ("B2", "A2"))], x, y


@pytest.mark.parametrize("make", [lora_like, attention, two_pairs], ids=["lora-like", "attention", "two-pairs"])
def test_each_gl_lane_moves_each_kind_of_tensor_in_one_product(make, monkeypatch) -> None:
    # parameters and gradients before the writes (their norms after the move are read), each moment kind at the
    # write (lean_moves.write): one batched product per kind and lane, never every kind's moved copy at once
    model, opt, step = wrapped(make, lean=True, near=True)
    for _ in range(3):
        step()
    counts: list[int] = []
    original = lean_moves.moves

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with _Products() as products:
            writes = original(*args, **kwargs)
        counts.append(products.count)
        return writes

    monkeypatch.setattr(lean_moves, "moves", counted)
    step()
    plan = BalanceCompanion.of(opt).plan
    assert plan is not None and opt.reports[-1].check == "none" and opt.reports[-1].accepted
    lanes = sum(lane.matrix for lane in plan.lanes)
    assert lanes >= 2 and counts == [2 * lanes], (counts, lanes)  # AdamW: parameters and gradient per lane


def test_each_buckets_block_matrices_are_stacked_once_per_power(monkeypatch) -> None:
    # the bucket's elements are stacked once per power (one call for all its sites) and each lane takes its
    # sites' rows: no stack per lane, no block_matrices per site
    from teleopt.groups.matrix import GeneralLinear

    model, opt, step = wrapped(two_pairs, lean=True, near=True)
    for _ in range(3):
        step()
    calls: list[tuple[str, float]] = []
    single, many = GeneralLinear.block_matrices, GeneralLinear.block_matrices_many

    def one(self, g, power):  # noqa: ANN001, ANN202
        calls.append(("one", power))
        return single(self, g, power)

    def stacked(self, gs, power):  # noqa: ANN001, ANN202
        calls.append((f"many of {len(gs)}", power))
        return many(self, gs, power)

    monkeypatch.setattr(GeneralLinear, "block_matrices", one)
    monkeypatch.setattr(GeneralLinear, "block_matrices_many", stacked)
    step()
    plan = BalanceCompanion.of(opt).plan
    assert plan is not None and opt.reports[-1].check == "none" and opt.reports[-1].accepted
    assert sorted(len(lane.sites) for lane in plan.lanes) == [1, 1, 2]
    assert sorted(calls) == [("many of 2", -1.0), ("many of 2", 1.0)], calls


@pytest.mark.parametrize("make", [lora_like, attention, two_pairs], ids=["lora-like", "attention", "two-pairs"])
def test_the_fused_lanes_move_parameters_and_moments_as_the_engine_does(make) -> None:
    model, opt, step = wrapped(make, lean=True)  # the closed form every step: the engine's elements
    _, _, x, y = make()
    for _ in range(3):
        step()
    twin, engine_opt = _step_with_engine_twin(model, opt, x, y)
    assert opt.reports[-1].check == "none" and engine_opt.reports[-1].check != "none"
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert _close(a.detach(), b.detach()) <= 1e-12, name
        for key in ("exp_avg", "exp_avg_sq") if a in opt.state else ():
            assert _close(opt.state[a][key], engine_opt.state[b][key]) <= 1e-12, (name, key)
    lean, engine = opt.reports[-1], engine_opt.reports[-1]
    assert abs(lean.objective_after - engine.objective_after) <= 1e-12 * engine.objective_after
    assert abs(lean.grad_norm_after - engine.grad_norm_after) <= 1e-12 * engine.grad_norm_after


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 0.05, 0.5, 3.0])
def test_the_horner_exponential_pair_is_the_matrix_exponential_and_its_inverse(scale: float) -> None:
    # the same Taylor degree and scaling as expm_pair (below float64's unit round-off relative to exp(X)), so
    # both agree with matrix_exp to a few ulps; 3.0 takes the squaring branch
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 7, generator=gen, dtype=torch.float64)
    x = scale * x / x.norm(dim=(-2, -1), keepdim=True)
    plus, minus = expm_pair_horner(x, float(x.abs().sum(-2).amax()))
    ref = torch.linalg.matrix_exp(x)
    assert float((plus - ref).abs().max() / ref.abs().max()) <= 2e-14
    assert float((minus @ plus - torch.eye(7, dtype=torch.float64)).abs().max()) <= 5e-14
    with pytest.raises(ValueError, match="batch"):
        expm_pair_horner(x[0], 1.0)


class _Ops(TorchDispatchMode):
    """Counts every aten call."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("n", [5, 20], ids=["horner", "paterson-stockmeyer"])
def test_a_near_steps_elements_and_contragredients_need_no_further_kernel(n: int) -> None:
    # balance_near_many leaves exp(xi) and exp(-xi)^T in the active cache for every site: the lean path's exp
    # and block matrices then read them (no matrix_exp, no solve, not even a transpose per site)
    from teleopt.groups import GroupCache
    from teleopt.groups.matrix import GeneralLinear

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, n, 2 * n, generator=gen, dtype=torch.float64)
    a = x @ x.mT
    stats = [{1.0: a[i], -1.0: a[i] + 0.01 * torch.eye(n, dtype=torch.float64)} for i in range(3)]
    group = GeneralLinear(n, blocks=2)
    with GroupCache().active():
        coords = group.balance_near_many(stats, limit=0.1)
        assert coords is not None
        with _Ops() as ops:
            elements = [group.exp(xi) for xi in coords]
            stacked = group.block_matrices_many(elements, -1)
        assert stacked is not None and tuple(stacked.shape) == (3, 2, n, n)
        assert ops.count == 2, ops.count  # the stack and its reshape (a view)
    for xi, g, c in zip(coords, elements, stacked.unbind(0)):
        assert float((g - torch.linalg.matrix_exp(xi)).abs().max()) <= 1e-14
        assert float((c.mT @ g - torch.eye(n, dtype=torch.float64)).abs().max()) <= 1e-14
