"""The shared wrapper contract (teleopt/wrapper.py) on the cases the conformance suite's bases do not reach.

Closure-only bases (``LBFGS``), torch's global step hooks, checkpoints saved by the
bare base before the wrapper was added, and malformed state dicts.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from teleopt import Site, get_action
from teleopt.syre import Syre
from teleopt.teleport import Schedule, SearchConfig, Teleport
from teleopt.wrapper import OptimizerWrapper, no_grad_step


class Delegating(OptimizerWrapper):
    """The smallest wrapper written against the documented step recipe."""

    prefix = "teleopt_delegating_"

    def __init__(self, optimizer, strength: float = 0.0) -> None:
        super().__init__(optimizer, {"strength": strength})

    @no_grad_step
    def step(self, closure=None):
        loss = self._closure_before_step(closure)
        return self._step_base(closure, loss)


def problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x, y = torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g)
    return model, x, y


def closure_of(optimizer, model, x, y):
    def closure():
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    return closure


def test_no_grad_step_turns_grad_mode_off_inside_and_restores_it_after():
    """A wrapper's step runs with grad mode off (as under ``@torch.no_grad()``): a base that updates its
    parameters in place without its own no_grad works, and the closure still records.  The mode the caller
    had comes back afterwards, also when the step raises."""

    class Plain(torch.optim.Optimizer):  # an update without torch.no_grad: it relies on the caller's
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.sub_(group["lr"] * p.grad)

    model, x, y = problem()
    opt = Delegating(Plain(model.parameters()))
    seen = []

    def closure():
        seen.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    for mode in (True, False):
        with torch.set_grad_enabled(mode):
            opt.step(closure)
            assert torch.is_grad_enabled() is mode
    assert seen == [True, True] and all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad_fn is None and p.is_leaf for p in model.parameters())

    @no_grad_step
    def failing(self):
        assert not torch.is_grad_enabled()
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        failing(None)
    assert torch.is_grad_enabled()
    assert Teleport.step.__doc__ and Teleport.step.__name__ == "step"  # functools.wraps keeps what docs read


# -- closure-only bases ----------------------------------------------------------------------


def test_step_needs_closure_reads_the_signature():
    from teleopt.wrapper import step_needs_closure

    p = [torch.nn.Parameter(torch.zeros(2))]
    assert step_needs_closure(torch.optim.LBFGS(p))
    assert not step_needs_closure(torch.optim.SGD(p, lr=0.1))
    assert Syre(Delegating(torch.optim.LBFGS(p)), gamma=0.0).base_needs_closure


@pytest.mark.parametrize(
    "wrap",
    [
        lambda opt, model: Syre(opt, gamma=0.0, exclude_1d=True),
        lambda opt, model: Delegating(opt),
        lambda opt, model: Syre(Delegating(opt), gamma=0.0, exclude_1d=True),
        lambda opt, model: Teleport(opt, model, [], schedule=Schedule()),
    ],
    ids=["syre", "delegating", "syre_of_delegating", "teleport_not_due"],
)
def test_an_lbfgs_base_gets_the_closure_and_is_followed_bitwise(wrap):
    bare_model, x, y = problem()
    wrapped_model, _, _ = problem()
    bare = torch.optim.LBFGS(bare_model.parameters(), lr=0.5, max_iter=5, line_search_fn="strong_wolfe")
    wrapper = wrap(torch.optim.LBFGS(wrapped_model.parameters(), lr=0.5, max_iter=5, line_search_fn="strong_wolfe"), wrapped_model)
    for _ in range(3):
        expected = bare.step(closure_of(bare, bare_model, x, y))
        got = wrapper.step(closure_of(wrapper, wrapped_model, x, y))
        assert torch.equal(got, expected)
    for a, b in zip(wrapped_model.parameters(), bare_model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="needs a closure"):
        wrapper.step()


def test_teleport_with_lbfgs_teleports_exactly_and_restarts_its_curvature_history():
    """A due teleport runs the closure once for fresh gradients, then LBFGS steps from a fresh history."""
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LeakyReLU(0.1), torch.nn.Linear(6, 2))
    x, y = torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g)
    site = Site(get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1), ("0.weight", "0.bias", "2.weight"))
    teleport = Teleport(
        torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5), model, [site], every=2, search=SearchConfig(trust_region=0.5)
    )
    after_teleport = []
    teleport.register_teleport_hook(lambda opt, report: after_teleport.append(model(x).detach()))
    losses = []
    for step in range(4):
        with torch.no_grad():
            before = model(x)
        losses.append(float(teleport.step(closure_of(teleport, model, x, y)).detach()))
        if step in (0, 2):  # the teleport ran before LBFGS's step and changed no output (float32: 1e-5)
            assert teleport.reports[-1].accepted and teleport.reports[-1].step == step
            torch.testing.assert_close(after_teleport[-1], before, rtol=1e-5, atol=1e-6)
    assert len(teleport.reports) == 2 and len(after_teleport) == 2
    state = teleport.state[next(iter(model.parameters()))]
    assert state["n_iter"] == 2 * 5  # restarted at step 2's teleport, then two steps of max_iter iterations
    assert losses[-1] < losses[0]


def test_coupled_syre_with_lbfgs_reaches_a_stationary_point_of_the_regularised_loss():
    model, x, y = problem()
    syre = Syre(
        torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=20, line_search_fn="strong_wolfe"), gamma=0.05, sigma0=0.5, exclude_1d=True
    )

    def objective():
        return ((model(x) - y) ** 2).mean() + syre.penalty().float()

    first = float(objective().detach())
    for _ in range(10):
        syre.step(closure_of(syre, model, x, y))
    assert float(objective().detach()) < 0.5 * first
    # eq. 6's objective is stationary, the data loss is not
    params = list(model.parameters())
    regularised = torch.autograd.grad(objective(), params)
    data = torch.autograd.grad(((model(x) - y) ** 2).mean(), params)
    assert max(float(g.abs().max()) for g in regularised) < 0.05 * max(float(g.abs().max()) for g in data)


def test_decoupled_syre_with_lbfgs_decays_once_then_lets_lbfgs_step():
    model, x, y = problem()
    reference, _, _ = problem()
    syre = Syre(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5), gamma=0.2, sigma0=0.5, decoupled=True, exclude_1d=True)
    bare = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=5)
    for _ in range(2):
        with torch.no_grad():
            for p, q in zip(reference.parameters(), model.parameters()):
                if q.dim() >= 2:
                    p.lerp_(syre.anchor(q), 0.5 * 0.2)
        expected = bare.step(closure_of(bare, reference, x, y))
        assert torch.equal(syre.step(closure_of(syre, model, x, y)), expected)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


# -- global step hooks -----------------------------------------------------------------------


@pytest.mark.parametrize("nest", [1, 2])
def test_global_step_hooks_fire_once_per_step_and_base_instance_hooks_still_fire(nest):
    model, x, y = problem()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    syre = Syre(base, gamma=0.1, exclude_1d=True)
    wrapper = syre if nest == 1 else Delegating(syre)
    seen = []
    handles = [
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append(("pre", type(opt).__name__))),
        register_optimizer_step_post_hook(lambda opt, args, kwargs: seen.append(("post", type(opt).__name__))),
        base.register_step_pre_hook(lambda opt, args, kwargs: seen.append(("base pre", type(opt).__name__))),
        base.register_step_post_hook(lambda opt, args, kwargs: seen.append(("base post", type(opt).__name__))),
    ]
    try:
        for _ in range(2):
            closure_of(wrapper, model, x, y)()
            wrapper.step()
    finally:
        for handle in handles:
            handle.remove()
    outer = type(wrapper).__name__
    assert seen == [("pre", outer), ("base pre", "SGD"), ("base post", "SGD"), ("post", outer)] * 2


def test_the_profiler_sees_the_wrapper_step_and_the_base_step():
    """The base's step keeps torch's profiler label; without a profiler the wrapper skips making it."""
    model, x, y = problem()
    syre = Syre(torch.optim.SGD(model.parameters(), lr=0.1), gamma=0.1, exclude_1d=True)
    closure_of(syre, model, x, y)()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        syre.step()
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#Syre.step") == 1 and names.count("Optimizer.step#SGD.step") == 1


def test_a_base_step_patched_by_a_scheduler_still_counts():
    model, x, y = problem()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)  # attached to the base, not the wrapper
    syre = Syre(base, gamma=0.1, exclude_1d=True)
    closure_of(syre, model, x, y)()
    syre.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], "the scheduler missed the base's step"
    assert base.param_groups[0]["lr"] == 0.05


# -- checkpoints of the bare base ------------------------------------------------------------


def relu_site():
    return Site(get_action("positive_rescaling", activation="relu"), ("0.weight", "0.bias", "2.weight"))


def relu_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


@pytest.mark.parametrize("kind", ["syre", "teleport", "syre_of_teleport"])
def test_a_checkpoint_of_the_bare_base_loads_and_keeps_the_wrapper_settings(kind):
    model = relu_model()
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    plain = torch.optim.Adam(model.parameters(), lr=1e-2)
    ((model(x) - y) ** 2).mean().backward()
    plain.step()
    saved = plain.state_dict()

    base = torch.optim.Adam(model.parameters(), lr=1e-2)
    if kind == "syre":
        wrapper = Syre(base, gamma=0.3, exclude_1d=True)
    elif kind == "teleport":
        wrapper = Teleport(base, model, [relu_site()], every=1000)
    else:
        wrapper = Syre(Teleport(base, model, [relu_site()], every=1000), gamma=0.3, exclude_1d=True)
    before = {k: v for k, v in wrapper.param_groups[0].items() if k.startswith("teleopt_")}
    wrapper.load_state_dict(saved)
    after = {k: v for k, v in wrapper.param_groups[0].items() if k.startswith("teleopt_")}
    assert after == before
    assert wrapper.param_groups[0]["lr"] == 1e-2 and torch.equal(wrapper.state[model[0].weight]["step"], torch.tensor(1.0))
    wrapper.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    wrapper.step()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda sd: sd.update(state=[]), "'state' must be a dict"),
        (lambda sd: sd.update(param_groups={}), "'param_groups' must be a list of dicts"),
        (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])), "2 param group"),
        (lambda sd: sd["state"].update({0: "x"}), "must be a dict"),
        (lambda sd: sd["state"].update({"a": {"teleopt_delegating_x": torch.zeros(1)}}), "keyed by parameter index"),
        (lambda sd: sd["state"].update({7: {"teleopt_delegating_x": torch.zeros(1)}}), "parameter 7"),
        (lambda sd: sd.update(teleopt_delegating=[1]), "must be a dict"),
        (lambda sd: sd["param_groups"][0].update(teleopt_delegating_strength=[1.0]), "plain scalars"),
    ],
)
def test_malformed_state_dicts_raise_value_error_and_change_nothing(mutate, match):
    model, x, y = problem()
    wrapper = Delegating(torch.optim.Adam(model.parameters(), lr=1e-2))
    closure_of(wrapper, model, x, y)()
    wrapper.step()
    sd = wrapper.state_dict()
    sd = {**sd, "state": dict(sd["state"]), "param_groups": [dict(g) for g in sd["param_groups"]]}
    mutate(sd)
    before = wrapper.state_dict()
    with pytest.raises(ValueError, match=match):
        wrapper.load_state_dict(sd)
    after = wrapper.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][0][k], before["state"][0][k]) for k in before["state"][0])


def test_state_keyed_by_parameter_names_loads_like_torch():
    """torch.distributed.checkpoint's get_optimizer_state_dict keys the state by parameter names, listed in
    each group's "params"; torch's own load_state_dict maps them by position, and so do the wrappers."""
    model, x, y = problem()
    wrapper = Syre(torch.optim.Adam(model.parameters(), lr=1e-2), gamma=0.3, exclude_1d=False, seed=5)
    closure_of(wrapper, model, x, y)()
    wrapper.step()
    sd = wrapper.state_dict()
    names = [n for n, _ in model.named_parameters()]
    by_name = {
        **sd,
        "state": {names[i]: entries for i, entries in sd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
    }
    fresh = Syre(torch.optim.Adam(model.parameters(), lr=1e-2), gamma=0.3, exclude_1d=False, seed=6)  # other anchors
    fresh.load_state_dict(by_name)
    for p in model.parameters():
        assert torch.equal(fresh.anchor(p), wrapper.anchor(p))
        assert torch.equal(fresh.state[p]["exp_avg"], wrapper.state[p]["exp_avg"])
