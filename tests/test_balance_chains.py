"""The lean balance path on chains: scaling sites that share a tensor (rows of one, columns of the next).

In a ReLU MLP or a conv chain the hidden layers' positive scalings overlap: the middle layer's weight is scaled
on its rows by one site and on its columns by the next.  The engine solves such sites together by block-
coordinate sweeps (``WeightNormModel.solve``); the lean path must give its result (the same solver, factors on
a shared tensor composed).  Compared step by step with a twin whose companion is off, in float64: parameters,
gradients and optimizer moments to 1e-12 of their scale (the same solve and elements; the composed products
are rounded in another order, a few ulps per element).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from conftest import products_raise
from test_balance_companion import _close, _step_with_engine_twin, wrapped
from torch import Tensor, nn

from teleopt.site import Site
from teleopt.teleport import Teleport
from teleopt.teleport.companion import BalanceCompanion

pytestmark = pytest.mark.usefixtures("one_thread")

Made = tuple[nn.Module, list[Site] | str, Tensor, Tensor]


def mlp() -> Made:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 12), nn.ReLU(), nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=gen, dtype=torch.float64), torch.randn(16, 3, generator=gen, dtype=torch.float64)
    return model.double(), "auto", x, y


class ConvChain(nn.Module):
    """Three 3x3 convolutions with ReLUs between them and a spatial mean: two scaling sites sharing conv2."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(2, 5, 3), nn.Conv2d(5, 6, 3), nn.Conv2d(6, 3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.c3(torch.relu(self.c2(torch.relu(self.c1(x))))).mean((2, 3))


def conv_chain() -> Made:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 2, 9, 9, generator=gen, dtype=torch.float64), torch.randn(4, 3, generator=gen, dtype=torch.float64)
    return ConvChain().double(), "auto", x, y


def sgd(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=5e-2, momentum=0.9)


def _agree(model: nn.Module, opt: Teleport, twin: nn.Module, engine_opt: Teleport) -> None:
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert _close(p.detach(), q.detach()) <= 1e-12, name
        assert p.grad is not None and q.grad is not None and _close(p.grad, q.grad) <= 1e-12, name
        for key, value in opt.state[p].items():
            if isinstance(value, Tensor) and value.dtype.is_floating_point and value.ndim:
                assert _close(value, engine_opt.state[q][key]) <= 1e-12, (name, key)


@pytest.mark.parametrize("base", [None, sgd], ids=["adamw", "sgd-momentum"])
@pytest.mark.parametrize("make", [mlp, conv_chain], ids=["mlp", "conv-chain"])
def test_overlapping_scalings_teleport_lean_as_the_engine_does(make: Callable[[], Made], base) -> None:
    options = {} if base is None else {"base": base}
    model, opt, _ = wrapped(make, lean=True, **options)
    sites = opt.sites or []
    assert len(sites) >= 2 and {n for s in sites[:1] for n in s.tensor_names} & {n for s in sites[1:2] for n in s.tensor_names}
    _, _, x, y = make()
    lean, moved = 0, 0.0
    for _ in range(6):
        twin, engine_opt = _step_with_engine_twin(model, opt, x, y)
        a, b = opt.reports[-1], engine_opt.reports[-1]
        assert b.check != "none" and b.accepted and a.accepted, (a.reason, b.reason)
        if a.check == "none":
            lean, moved = lean + 1, max(moved, *a.coordinate_norms.values())
            assert a.state_decisions == b.state_decisions
            assert a.coordinate_norms == pytest.approx(b.coordinate_norms, rel=1e-12, abs=1e-15)
            for name, e in a.elements.items():
                assert _close(e, b.elements[name]) <= 1e-12, name
            assert a.grad_norm_before == pytest.approx(b.grad_norm_before, rel=1e-12)
            assert a.grad_norm_after == pytest.approx(b.grad_norm_after, rel=1e-12)
            assert a.objective_before == pytest.approx(b.objective_before, rel=1e-12)
            assert a.objective_after == pytest.approx(b.objective_after, rel=1e-12) and a.objective_after < a.objective_before
        _agree(model, opt, twin, engine_opt)
    assert lean >= 4, [(r.step, r.check, r.reason) for r in opt.reports]
    assert moved > 1e-4  # the lean teleports balanced something (a log-scale far above the 1e-12 compared)


def _readme(seed: int = 0) -> tuple[nn.Module, Teleport, Callable[[float], None]]:
    """The README configuration on a float64 ReLU MLP (balance every 200 steps from step 200)."""
    model, _, x, y = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = Teleport(
            torch.optim.Adam(model.parameters(), lr=1e-3),
            model,
            "auto",
            example_inputs=x[:2],
            loss_fn=nn.functional.mse_loss,
            batch_fn=lambda: (x, y),
        )

    def step(grad_scale: float = 1.0) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if grad_scale != 1.0:
            torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], grad_scale)
        opt.step()

    return model, opt, step


def test_the_readme_loop_on_an_mlp_runs_its_second_teleport_lean() -> None:
    model, opt, step = _readme()
    for _ in range(401):
        step()
    assert [r.step for r in opt.reports] == [200, 400]
    first, second = opt.reports
    assert first.check == "batch" and first.accepted
    assert second.check == "none" and second.accepted and "first teleport was checked (step 200)" in second.check_detail
    assert max(second.coordinate_norms.values()) > 1e-3
    plan = BalanceCompanion.of(opt).plan
    assert plan is not None and plan.chain is not None  # the hidden layers' sites share the middle weights


def _inverse(model: nn.Module, opt: Teleport, elements: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every parameter and Adam moment moved back by the inverse of ``elements``: per ReLU site, its writer's
    rows (and bias) divided by c, its reader's columns multiplied by c; moments as covectors (c^-1, c^-2)."""
    params = dict(model.named_parameters())
    out = {n: p.detach().clone() for n, p in params.items()}
    out |= {f"{n}.{k}": v.clone() for n, p in params.items() for k, v in opt.state[p].items() if isinstance(v, Tensor) and v.ndim}
    for site in opt.sites or []:
        c = elements[site.name]
        for name, member in zip(site.members, site.action.members):
            assert name is not None
            shape = [1] * params[name].ndim
            shape[member.axis] = -1
            f = c.reshape(shape) ** float(member.power)
            out[name] = out[name] / f
            out[f"{name}.exp_avg"] = out[f"{name}.exp_avg"] * f
            out[f"{name}.exp_avg_sq"] = out[f"{name}.exp_avg_sq"] * f**2
    return out


def test_a_watch_rollback_of_a_lean_chain_teleport_restores_the_weights_and_moments() -> None:
    model, opt, step = _readme()
    for _ in range(401):
        step()
    teleport = opt.reports[-1]
    assert teleport.check == "none" and teleport.accepted and len(teleport.elements) >= 2
    expected = _inverse(model, opt, teleport.elements)
    step(grad_scale=1e3)  # ||grad||^2 a million times the watch's reference: the update is skipped, the teleport undone
    assert opt.reports[-1].path == "watch" and opt.record.rollbacks == 1, [(r.step, r.path, r.reason) for r in opt.reports]
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert _close(p.detach(), expected[name]) <= 1e-14, name  # a product by c, then by 1/c: a few ulps
        for key in ("exp_avg", "exp_avg_sq"):
            assert _close(opt.state[p][key], expected[f"{name}.{key}"]) <= 1e-14, (name, key)


def _before_a_lean_chain_teleport() -> tuple[nn.Module, Teleport, list[Tensor], list[Tensor], list[dict[str, Tensor]]]:
    """An MLP whose chain teleports lean, its gradients filled before the next (lean) teleport, and copies of its
    parameters, gradients and optimizer state."""
    model, opt, step = wrapped(mlp, lean=True)
    for _ in range(3):
        step()
    assert opt.reports[-1].check == "none"
    _, _, x, y = mlp()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    return model, opt, params, grads, state


def test_an_exception_during_the_writes_of_a_chain_teleport_moves_the_gradients_back(monkeypatch) -> None:
    # the in-place products raise: the gradients, multiplied in place with the parameters and moments (no copy),
    # were not written yet, nor were the parameters and moments (bitwise)
    model, opt, params, grads, state = _before_a_lean_chain_teleport()
    with products_raise(monkeypatch):
        opt.step()
    for p, old, g, st in zip(model.parameters(), params, grads, state):
        assert torch.equal(p.detach(), old)
        assert p.grad is not None and _close(p.grad, g) <= 1e-14
        assert all(torch.equal(opt.state[p][k], v) for k, v in st.items())


class PairAndChain(nn.Module):
    """A low-rank pair B A on a frozen layer (a GL site) feeding a ReLU MLP whose two scaling sites share fc2."""

    def __init__(self, d: int = 8, r: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.A, self.B = nn.Parameter(torch.randn(r, d) / d**0.5), nn.Parameter(torch.randn(d, r) / r**0.5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, 10), nn.Linear(10, 9), nn.Linear(9, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.base(x) + x @ self.A.T @ self.B.T)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(h)))))


def test_a_chain_beside_a_gl_site_is_left_to_the_engine() -> None:
    # the lean path solves chains only when every site is a scaling: the engine takes (and checks) every teleport
    from test_balance_companion import LORA, RELU

    def make() -> Made:
        torch.manual_seed(0)
        sites = [
            Site(LORA, ("B", "A")),
            Site(RELU, ("fc1.weight", "fc1.bias", "fc2.weight")),
            Site(RELU, ("fc2.weight", "fc2.bias", "fc3.weight")),
        ]
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 8, generator=gen, dtype=torch.float64), torch.randn(16, 3, generator=gen, dtype=torch.float64)
        return PairAndChain().double(), sites, x, y

    _, opt, step = wrapped(make, lean=True)
    for _ in range(5):
        step()
    assert all(r.check != "none" and r.accepted for r in opt.reports), [(r.check, r.reason) for r in opt.reports]
    assert BalanceCompanion.of(opt).plan is None


def test_an_interrupt_between_the_products_of_a_chain_teleport_divides_them_out(monkeypatch) -> None:
    # a shared tensor takes one factor per in-place product: an interrupt after the first leaves rows scaled and
    # columns not, a changed model, unless the products made are divided out again (a few ulps)
    model, opt, params, _, state = _before_a_lean_chain_teleport()
    real, calls = torch._foreach_mul_, []

    def once_then_interrupt(*args: object, **kwargs: object) -> None:  # the writes' first product, then an interrupt
        import inspect

        caller = inspect.stack()[1].function
        calls.append(caller)
        if caller == "write" and calls.count("write") > 1:
            raise KeyboardInterrupt
        real(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_mul_", once_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.undo()
    assert calls.count("write") == 2  # the first product was made
    for p, old, st in zip(model.parameters(), params, state):
        assert _close(p.detach(), old) <= 1e-14
        assert all(_close(opt.state[p][k], v) <= 1e-14 for k, v in st.items())  # Adam's step counter: equal
