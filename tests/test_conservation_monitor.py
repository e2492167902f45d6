"""ConservationMonitor: drift of conserved quantities during training (Zhao 2026, Sec. 2.5, App. A.4)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import teleopt
from teleopt.actions.feedforward import radial_rescaling
from teleopt.analysis.conserved import conserved_quantities, whitened_conserved_quantity
from teleopt.analysis.monitor import ConservationMonitor
from teleopt.datasets import digits_mlp, hidden_rescaling_sites, load_digits
from teleopt.registry import get_action
from teleopt.site import Site
from teleopt.teleport import SafetyConfig


@pytest.fixture(scope="module")
def digits():
    d = load_digits(seed=0)
    return d.x_train[:256].double(), d.y_train[:256]


def train(model, optimizer, x, y, steps):
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_one_sgd_step_drifts_by_exactly_lr_squared_q_of_the_gradient(digits):
    """The monitor's drift is ||Q_1 - Q_0|| / scale with Q_1 - Q_0 = lr^2 Q(grad) (Zhao 2026, Prop. A.4.1)."""
    x, y = digits
    model = digits_mlp(seed=1).double()
    sites = hidden_rescaling_sites(model)
    lr = 0.5
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    monitor = ConservationMonitor(model, sites)
    monitor.attach(opt)
    q0 = conserved_quantities(model, sites)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    q_grad = conserved_quantities({n: p.grad for n, p in model.named_parameters()}, sites)
    opt.step()
    (record,) = monitor.history
    for s in sites:
        predicted = lr**2 * float(q_grad[s.name].norm()) / q0.scale(s.name)
        # exact algebra up to float64 round-off of Q (~1e-16 of its scale)
        assert record.drift[s.name] == pytest.approx(predicted, rel=1e-6, abs=1e-14)
        assert record.drift[s.name] > 0
        assert record.step_drift[s.name] == record.drift[s.name]  # the first step: previous = reference


def test_drift_per_step_scales_with_the_learning_rate_squared(digits):
    """Halving lr quarters the drift of 20 SGD steps (to the extent the two trajectories agree)."""
    x, y = digits
    drifts = []
    for lr in (0.02, 0.01):
        model = digits_mlp(seed=2).double()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        monitor = ConservationMonitor(model, hidden_rescaling_sites(model))
        monitor.attach(opt)
        train(model, opt, x, y, 20)
        drifts.append(monitor.max_drift()["rescale_hidden1"])
        steps = [r.step_drift["rescale_hidden1"] for r in monitor.history]
        # the per-step changes add up to at least the net drift (triangle inequality; each is
        # normalised by the scale at its own start, which moves by < 1e-3 here)
        assert sum(steps) >= monitor.history[-1].drift["rescale_hidden1"] * (1 - 1e-3)
    # lr^2 per step, and the trajectories differ by O(lr): measured ratio 4.0 +- 0.1
    assert 3.5 < drifts[0] / drifts[1] < 4.5


def test_teleports_rebase_the_reference_and_record_the_jump(digits):
    """A teleport moves Q along the orbit on purpose: the monitor reports it as a jump, not as drift."""
    x, y = digits
    model = digits_mlp(seed=3).double()
    sites = hidden_rescaling_sites(model)
    # the watch restores a snapshot: its rollback discards the steps taken at the teleported point (the default
    # inverse move keeps them, and their drift at a 10x gradient, 5e-4 here, is not SGD's O(lr^2) between teleports)
    safety = SafetyConfig(watch_restore="snapshot")
    opt = teleopt.Teleport(torch.optim.SGD(model.parameters(), lr=0.05), model=model, sites=sites, every=4, safety=safety)
    attached = ConservationMonitor(model, sites)
    attached.attach(opt)
    manual = ConservationMonitor(model, sites)  # not told about teleports
    for _ in range(8):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        manual.update()
    moved = {r.step: r.accepted for r in opt.reports if r.accepted or r.reason.startswith("rolled back")}
    assert any(moved.values()), "this problem should teleport"
    jumps = {r.step - 1: r.teleport_jump for r in attached.history if r.teleport_jump}
    assert sorted(jumps) == sorted(moved)  # accepted teleports, and watch rollbacks that undo them
    assert all(max(jumps[step].values()) > 1e-2 for step, accepted in moved.items() if accepted)
    # between teleports: SGD's O(lr^2) drift only (lr^2 = 2.5e-3; 1.1e-4 measured: the teleport at step 4 runs
    # 3 watched steps before its rollback); the monitor that ignores teleports sees the orbit move
    assert max(attached.max_drift().values()) < 2e-4
    assert max(manual.max_drift().values()) > 1e-2


class RadialNet(nn.Module):
    """U sigma(V x + b) with the radial rescaling activation of Zhao 2026, Ex. 1.2.6 (O(h) symmetry)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, 12)
        self.out = nn.Linear(12, 10, bias=False)

    def forward(self, x):
        return self.out(radial_rescaling(self.hidden(x)))


@pytest.mark.parametrize("optimizer, invariant", [("sgd", True), ("adam", False)])
def test_angular_momentum_residual_separates_sgd_from_adam(digits, optimizer, invariant):
    """Theorem 2.5.6 holds for every (S)GD update of an O(h)-invariant loss; Adam's per-coordinate steps break it."""
    x, y = digits
    torch.manual_seed(0)
    model = RadialNet().double()
    site = Site(get_action("radial_orthogonal"), ("hidden.weight", "hidden.bias", "out.weight"), name="radial")
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd" else torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = ConservationMonitor(model, [site])
    monitor.attach(opt)
    train(model, opt, x, y, 5)
    residual = monitor.max_angular_momentum()["radial"]
    if invariant:
        assert residual < 1e-12  # round-off: the update is -lr grad and <grad, A . theta> = 0 exactly
    else:
        assert residual > 1e-3  # measured ~0.1


def run_whitened(inputs, every=2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, 3, bias=False)).double()
    y = torch.randn(6, 3, dtype=torch.float64)

    def q(m):
        return whitened_conserved_quantity(m[2].weight, m[0].weight, "tanh")

    with pytest.warns(UserWarning, match="cannot monitor 1 site"):
        signs = Site(get_action("sign_flip"), ("0.weight", None, "2.weight"), name="signs")
        monitor = ConservationMonitor(model, [signs], quantities={"eq2.17": q}, every=every)
    assert "signs" in monitor.unavailable
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(6):
        opt.zero_grad()
        (0.5 * ((model(inputs) - y) ** 2).sum()).backward()
        opt.step()
        monitor.update()
    return monitor


def test_extra_quantities_and_plain_update():
    """eq. 2.17 for a tanh net, tracked as a user quantity with update() (no attach) every 2nd step:
    conserved up to GD's O(lr^2) with whitened input, not with a generic one."""
    whitened = run_whitened(torch.eye(6, dtype=torch.float64))
    generic = run_whitened(torch.randn(6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    assert [r.step for r in whitened.history] == [2, 4, 6]
    # measured 2.5e-5 vs 1.2e-2: the O(lr^2) discretisation drift against an O(lr) violation
    assert 0 < whitened.max_drift()["eq2.17"] < 1e-2 * generic.max_drift()["eq2.17"]
    json.dumps(whitened.to_dict())


def test_detach_and_bad_input(digits):
    x, y = digits
    model = digits_mlp(seed=4).double()
    sites = hidden_rescaling_sites(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = ConservationMonitor(model, sites)
    handle = monitor.attach(opt)
    train(model, opt, x, y, 2)
    handle.remove()
    train(model, opt, x, y, 2)
    assert len(monitor.history) == 2
    with pytest.raises(TypeError, match="nn.Module"):
        ConservationMonitor("model", sites)
    with pytest.raises(ValueError, match="every"):
        ConservationMonitor(model, sites, every=0)
    with pytest.raises(TypeError, match="Optimizer"):
        monitor.attach("sgd")
    with pytest.raises(TypeError, match="callable"):
        ConservationMonitor(model, sites, quantities={"q": 1.0})
    with pytest.raises(ValueError, match="clash"):
        ConservationMonitor(model, sites, quantities={"rescale_hidden1": lambda m: torch.zeros(1)})
    perm = Site(get_action("hidden_permutation"), ("0.weight", None, "2.weight"), name="perm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="nothing to monitor.*discrete"):
            ConservationMonitor(model, [perm])
