"""Safe in the training loops people write: what the teleport check cannot see is refused or warned.

Each test states one behaviour of the wrappers in an everyday loop shape: a forward
keyword the check never saw, inputs with no rows, option values written into a param
group after construction, a closure-evaluating base (LBFGS), an install without numpy,
a wrapper that can never teleport.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import teleopt
from teleopt import Syre, Teleport
from teleopt.detection.certify import certify_sites
from teleopt.teleport import SafetyConfig
from teleopt.teleport.schedule import Schedule

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent


class _ScaledNet(nn.Module):
    """``model(x)`` is a ReLU MLP (positive rescaling of the hidden units is exact); ``model(x, scale=s)``
    runs tanh(s h) instead, which that rescaling changes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(torch.relu(h) if scale is None else torch.tanh(h * scale))


def _data(seed: int = 0, rows: int = 16) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = _ScaledNet().double()
    return model, torch.randn(rows, 4, generator=g, dtype=torch.float64), torch.randn(rows, 3, generator=g, dtype=torch.float64)


def _messages(record: list[warnings.WarningMessage], text: str) -> list[str]:
    return [str(w.message) for w in record if text in str(w.message)]


# -- a forward keyword the check never saw ---------------------------------------------------------------------


def _train_with_keyword(example_kwargs: dict | None) -> tuple[list[str], float, Teleport]:
    """A balance teleport in a loop that calls ``model(x, scale=2.0)``: the warnings naming example_kwargs, the
    relative change of the trained forward's outputs over the teleport and the SGD step, and the wrapper."""
    model, x, y = _data()
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.01), model, example_inputs=x, example_kwargs=example_kwargs, objective="balance", every=1
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt.zero_grad()
        nn.functional.mse_loss(model(x, scale=2.0), y).backward()
        with torch.no_grad():
            before = model(x, scale=2.0)
        opt.step()  # the teleport, then the SGD update
        with torch.no_grad():
            change = float((model(x, scale=2.0) - before).norm() / before.norm())
    return _messages(record, "example_kwargs"), change, opt


def test_a_training_forward_keyword_missing_from_example_kwargs_is_warned_naming_the_fix():
    messages, change, opt = _train_with_keyword(None)
    assert len(messages) == 1
    assert "['scale']" in messages[0] and "example_kwargs={...}" in messages[0]
    # what the warning is about: the check (on x alone) accepted a teleport that moved the trained forward
    assert opt.reports[-1].accepted and change > 0.1


def test_the_same_keywords_given_as_example_kwargs_give_no_warning():
    with pytest.warns(UserWarning, match="found no continuous site"):  # detection saw tanh(s h): nothing is exact
        messages, _, opt = _train_with_keyword({"scale": 2.0})
    assert messages == [] and opt.sites == []


def test_the_keyword_check_keeps_the_training_forward_free_of_its_hook():
    model, x, y = _data()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, example_inputs=x, objective="balance", every=1)

    def hooks() -> list[str]:  # besides the keyword check, the autocast recorder stays (teleopt.teleport.precision)
        return sorted(type(h).__name__ for h in model._forward_pre_hooks.values() if type(h).__name__ != "PrecisionRecorder")

    assert len(hooks()) == 1  # armed for the next forward only
    model(x, scale=2.0)
    assert hooks() == []  # it recorded the keyword names and removed itself
    with pytest.warns(UserWarning, match="example_kwargs"):
        opt.teleport()
    assert len(hooks()) == 1  # armed again after the teleport


def test_output_selecting_keywords_such_as_labels_are_not_warned():
    model, x, _ = _data()

    class WithLabels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            return self.body(x)

    wrapped = WithLabels()
    opt = Teleport(torch.optim.SGD(wrapped.parameters(), lr=0.01), wrapped, example_inputs=x, objective="balance", every=1)
    wrapped(x, labels=torch.zeros(16))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt.teleport()
    assert _messages(record, "example_kwargs") == []


def test_an_input_given_by_keyword_instead_of_position_is_not_warned():
    model, x, _ = _data()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, example_inputs=x, objective="balance", every=1)
    model(x=x)  # the same argument of forward as example_inputs=x supplies
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt.teleport()
    assert _messages(record, "example_kwargs") == []


# -- inputs with no rows -------------------------------------------------------------------------------------------


def test_zero_row_example_inputs_are_refused_at_construction():
    model, _, _ = _data()
    empty = torch.zeros(0, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="example_inputs has a tensor with no rows"):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, example_inputs=empty, objective="balance")
    with pytest.raises(ValueError, match="example_kwargs has a tensor with no rows"):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, example_kwargs={"x": empty}, objective="balance")
    with pytest.raises(ValueError, match="heldout_batch has a tensor with no rows"):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, objective="balance", safety=SafetyConfig(heldout_batch=(empty, None)))


def test_zero_row_inputs_are_refused_by_detection_and_certification():
    model, x, _ = _data()
    empty = torch.zeros(0, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="example_inputs has a tensor with no rows"):
        teleopt.find_symmetries(model, empty)
    with pytest.raises(ValueError, match="example_inputs has a tensor with no rows"):
        teleopt.find_symmetries(model, (x, empty))
    sites = teleopt.find_symmetries(model, x).sites
    with pytest.raises(ValueError, match="no rows"):
        certify_sites(model, sites, (empty,))


def test_a_zero_row_forward_does_not_become_the_probe_inputs():
    model, x, _ = _data()
    sites = [s for s in teleopt.find_symmetries(model, x).sites if s.action.continuous]
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, sites, objective="balance", every=1)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    model(torch.zeros(0, 4, dtype=torch.float64))  # before any forward with rows: nothing to probe on
    report = opt.teleport()
    assert not report.accepted and "nothing to check" in report.reason
    model(x)
    model(torch.zeros(0, 4, dtype=torch.float64))  # the probe stays the last forward with rows
    report = opt.teleport()
    assert report.accepted and report.check == "probe"


def test_zero_row_teleport_batches_are_refused():
    model, x, y = _data()
    sites = [s for s in teleopt.find_symmetries(model, x).sites if s.action.continuous]
    empty = (torch.zeros(0, 4, dtype=torch.float64), torch.zeros(0, 3, dtype=torch.float64))
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, sites, loss_fn=nn.functional.mse_loss, schedule=Schedule())
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match="batch has a tensor with no rows"):
        opt.teleport(batch=empty)
    with pytest.raises(ValueError, match="heldout_batch has a tensor with no rows"):
        opt.teleport(batch=(x, y), heldout_batch=empty)
    scheduled = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.01), model, sites, loss_fn=nn.functional.mse_loss, batch_fn=lambda: empty, every=1
    )
    with pytest.raises(ValueError, match=r"the batch of batch_fn\(\) has a tensor with no rows"):
        scheduled.step()


# -- syre options written into a param group later -------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("sigma0", math.nan, ValueError),
        ("sigma0", math.inf, ValueError),
        ("sigma0", -0.5, ValueError),
        ("gamma", math.nan, ValueError),
        ("gamma", -math.inf, ValueError),
        ("diagonal_eps", math.nan, ValueError),
        ("diagonal_eps", 1.5, ValueError),
        ("sigma0", "0.1", TypeError),
    ],
)
@pytest.mark.parametrize("steps_before", [0, 1])  # anchors not drawn yet, and drawn
def test_bad_syre_values_written_into_a_param_group_fail_at_step_before_any_change(key, value, error, steps_before):
    g = torch.Generator().manual_seed(0)
    w, v = (nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64)) for _ in range(2))
    syre = Syre(torch.optim.Adam([{"params": [w]}, {"params": [v]}], lr=0.1), gamma=0.1)
    for _ in range(steps_before):
        w.grad, v.grad = torch.ones_like(w), torch.ones_like(v)
        syre.step()
    syre.param_groups[1][Syre.prefix + key] = value
    w.grad, v.grad = torch.ones_like(w), torch.ones_like(v)
    before = [t.detach().clone() for t in (w, v, w.grad, v.grad)]
    state = {k: t.clone() for k, t in syre.state[v].items()} if steps_before else {}
    with pytest.raises(error, match=rf"param group 1: teleopt_syre_{key} must"):
        syre.step()
    assert all(torch.equal(a, b) for a, b in zip((w, v, w.grad, v.grad), before))
    assert {k: t for k, t in syre.state[v].items()}.keys() == state.keys()
    assert all(torch.equal(syre.state[v][k], t) for k, t in state.items())


# -- Syre around LBFGS ----------------------------------------------------------------------------------------------


def _lbfgs_run(gamma: float, sigma0: float | None, steps: int = 6) -> tuple[list[float], list[torch.Tensor]]:
    """LBFGS (lr 0.5, max_iter 5) on a float64 4-8-3 ReLU MLP: through ``Syre(gamma, sigma0)``, or (``sigma0=None``)
    bare on the loss plus (gamma / 2) ||W||^2 of the weight matrices (Syre's exclude_1d leaves the biases out)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x, y = torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randn(16, 3, generator=g, dtype=torch.float64)
    base = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixed-step warning: this loop pins the arithmetic, not the advice
        opt = base if sigma0 is None else Syre(base, gamma=gamma, sigma0=sigma0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if sigma0 is None:
            loss = loss + 0.5 * gamma * sum((p * p).sum() for p in model.parameters() if p.dim() >= 2)
        loss.backward()
        return loss

    losses = [float(opt.step(closure).detach()) for _ in range(steps)]
    return losses, [p.detach().clone() for p in model.parameters()]


def test_syre_around_lbfgs_with_plain_decay_takes_the_steps_of_lbfgs_on_the_decayed_loss():
    losses, params = _lbfgs_run(1e-3, 0.0)
    ref_losses, ref_params = _lbfgs_run(1e-3, None)
    # the decay enters every closure evaluation: the same arithmetic, so the same trajectory to rounding
    assert losses == pytest.approx(ref_losses, rel=1e-12, abs=0)
    assert all(torch.allclose(p, q, rtol=1e-12, atol=1e-14) for p, q in zip(params, ref_params))


def test_syre_around_lbfgs_stays_finite_and_close_to_bare_lbfgs():
    losses, _ = _lbfgs_run(1e-3, 0.01)
    bare, _ = _lbfgs_run(0.0, None)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0]
    # a 1e-3 decay towards a small anchor moves the loss by little (the penalty is about 1e-2 here)
    assert all(abs(a - b) <= 0.1 * b for a, b in zip(losses, bare))


def _iris_lbfgs(seed: int, sigma0: float | None, line_search_fn: str | None) -> list[float]:
    """Eight LBFGS steps (lr 0.5, max_iter 5) on scikit-learn's iris, unscaled, with a float64 4-8-3 ReLU MLP:
    through ``Syre(gamma=1e-3, sigma0)``, or bare (``sigma0=None``); the data loss after each step."""
    from sklearn.datasets import load_iris

    data = load_iris()
    x, y = torch.tensor(data.data, dtype=torch.float64), torch.tensor(data.target)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    base = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, line_search_fn=line_search_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = base if sigma0 is None else Syre(base, gamma=1e-3, sigma0=sigma0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    losses = []
    for _ in range(8):
        opt.step(closure)
        with torch.no_grad():
            losses.append(float(nn.functional.cross_entropy(model(x), y)))
    return losses


def test_syre_around_a_fixed_step_lbfgs_warns_and_names_the_line_search():
    model = nn.Linear(4, 3)
    with pytest.warns(UserWarning, match="line_search_fn='strong_wolfe'"):
        Syre(torch.optim.LBFGS(model.parameters(), lr=0.5), gamma=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with a line search there is nothing to warn about
        Syre(torch.optim.LBFGS(model.parameters(), lr=0.5, line_search_fn="strong_wolfe"), gamma=1e-3)


def test_the_fixed_step_lbfgs_blow_up_is_lbfgs_own_and_the_line_search_removes_it():
    # The loop: a fixed-step LBFGS under Syre jumps to a loss hundreds of times its start while bare
    # LBFGS does not.  The decay is exact (the test above: the same steps as LBFGS on the decayed loss), so the
    # jump is fixed-step LBFGS's own on that objective; with the strong-Wolfe line search, Syre trains like
    # bare LBFGS on every seed, with plain decay and with a random anchor.
    fixed = _iris_lbfgs(0, 0.0, None)
    assert max(fixed) > 100 * fixed[0]
    for seed in range(4):
        bare = _iris_lbfgs(seed, None, "strong_wolfe")
        for sigma0 in (0.0, 0.01):
            searched = _iris_lbfgs(seed, sigma0, "strong_wolfe")
            assert max(searched) < 1.0 and searched[-1] < 0.1, (seed, sigma0, searched)
            assert abs(searched[-1] - bare[-1]) < 0.05, (seed, sigma0, searched[-1], bare[-1])


# -- no numpy -------------------------------------------------------------------------------------------------------


def test_the_core_import_and_discover_run_without_numpy():
    script = (
        "import sys\n"
        "sys.modules['numpy'] = None  # an install without numpy: every import of it fails\n"
        "import torch, teleopt\n"
        "from teleopt.discovery import problems\n"
        "action = teleopt.discover(problems.two_layer(), steps=2, batch_size=4, progress=False, seed=0)\n"
        "print(type(action).__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("LearnedAction")


# -- a wrapper that can never teleport -----------------------------------------------------------------------------


def test_auto_sites_with_no_continuous_site_warn_at_construction():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))  # GELU: no rescaling passes it
    x = torch.randn(4, 4)
    with pytest.warns(UserWarning, match="found no continuous site it can teleport") as record:
        opt = Teleport(torch.optim.AdamW(model.parameters()), model, example_inputs=x, objective="balance")
    assert len(_messages(record.list, "found no continuous site")) == 1
    assert "every teleport would be declined" in _messages(record.list, "found no continuous site")[0]
    assert opt.teleport().reason == "declined: no active continuous sites"


def test_auto_sites_all_left_out_under_adamw_warn_with_the_reasons():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))  # only the norm's gain rescales
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        Teleport(torch.optim.AdamW(model.parameters()), model, example_inputs=torch.randn(4, 4), objective="balance")
    messages = _messages(record, "found no continuous site")
    assert len(messages) == 1 and "normalisation-affine" in messages[0]


def test_a_teleport_without_a_schedule_warns_at_construction_unless_it_is_chosen():
    model, x, _ = _data()
    sites = [s for s in teleopt.find_symmetries(model, x).sites if s.action.continuous]
    with pytest.warns(UserWarning, match="no schedule"):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, sites, objective="grad_norm")  # no default schedule
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, sites)  # the default: balance on its schedule
        Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, sites, schedule=Schedule())
        Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, sites, every=10)
        Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, sites, objective="balance")
