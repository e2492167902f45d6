"""The wrapper conformance suite itself: a correct wrapper passes, each broken wrapper fails its check."""

from __future__ import annotations

import unittest

import pytest
import torch
from torch.optim import Optimizer

from teleopt.testing.conformance import (
    BASE_OPTIMIZERS,
    CHECKS,
    BaseOptimizer,
    WrapperConformance,
    available_bases,
    check_wrapper,
)
from teleopt.wrapper import OptimizerWrapper


class Delegating(OptimizerWrapper):
    """The smallest correct wrapper: one hyperparameter, delegates the step."""

    prefix = "teleopt_delegating_"

    def __init__(self, optimizer: Optimizer, strength: float = 0.0) -> None:
        super().__init__(optimizer, {"strength": strength})

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        self._base.step()
        return loss


class GradientScaling(Delegating):
    """Features on: scales gradients by (1 + strength) before the base step (restored afterwards)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        saved = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    saved.append((p, p.grad))
                    p.grad = p.grad * (1 + self.group_value(group, "strength"))
        self._base.step()
        for p, g in saved:
            p.grad = g
        return loss


def test_a_correct_wrapper_passes_everything():
    check_wrapper(lambda opt: GradientScaling(opt, 0.5), make_transparent=Delegating, bases=["adam", "sgd_momentum"])


@pytest.mark.parametrize("base", available_bases())
def test_every_shipped_base_passes_with_the_delegating_wrapper(base):
    WrapperConformance(Delegating, make_transparent=Delegating, base=base, n_groups=2).run_all()


def test_transparency_is_skipped_without_a_transparent_factory():
    with pytest.raises(unittest.SkipTest):
        WrapperConformance(Delegating).run("transparency")


# -- broken wrappers: each must fail the check that targets its bug ------------------------


class CopiedGroups(Delegating):
    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.param_groups = [dict(g) for g in optimizer.param_groups]  # davda54/sam#34


class Forwarding(Delegating):
    def __getattr__(self, name):
        return getattr(self.__dict__["_base"], name)


class DoubleStep(Delegating):
    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        self._base.step()
        self._base.step()
        return loss


class ClosureTwice(Delegating):
    @torch.no_grad()
    def step(self, closure=None):
        self._run_closure(closure)
        return super().step(closure)


class StateCopy(Delegating):
    @property
    def state(self):
        return dict(self._base.state)

    @state.setter
    def state(self, value):
        pass


class ForgetfulCounter(Delegating):
    """Skips every third base step, but its counter is not in state_dict (Lookahead lost slow weights: kozistr#306)."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.count = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        self.count += 1
        if self.count % 3:
            self._base.step()
        return loss


class OptimizerPickling(ForgetfulCounter):
    """Uses torch's own __getstate__, which drops the wrapper's attributes on deepcopy/pickle."""

    __getstate__ = Optimizer.__getstate__


class ClaimsAmpScaling(GradientScaling):
    _step_supports_amp_scaling = True


class LocalDefaults(Delegating):
    """Keeps its defaults to itself: groups added later miss the wrapper keys."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.defaults = dict(optimizer.defaults)
        del optimizer.defaults[self.prefix + "strength"]


class Ascending(Delegating):
    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.neg_()
        self._base.step()
        return loss


class NotTransparent(Delegating):
    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(1 + 1e-6)
        self._base.step()
        return loss


@pytest.mark.parametrize(
    ("wrapper", "check"),
    [
        (CopiedGroups, "shares_param_groups"),
        (CopiedGroups, "scheduler"),
        (Forwarding, "is_optimizer"),
        (DoubleStep, "hooks"),
        (DoubleStep, "transparency"),
        (ClosureTwice, "closure"),
        (StateCopy, "shares_state"),
        (ForgetfulCounter, "resume"),
        (OptimizerPickling, "deepcopy"),
        (OptimizerPickling, "pickle"),
        (ClaimsAmpScaling, "grad_scaler"),
        (ClaimsAmpScaling, "is_optimizer"),
        (LocalDefaults, "add_param_group"),
        (Ascending, "convergence"),
        (NotTransparent, "transparency"),
    ],
)
def test_a_broken_wrapper_fails_its_check(wrapper, check):
    suite = WrapperConformance(wrapper, make_transparent=wrapper, base="adam", n_groups=2)
    with pytest.raises(AssertionError):
        suite.run(check)


def test_failures_name_the_check_base_and_groups():
    with pytest.raises(AssertionError, match=r"\[hooks, base=sgd_momentum, groups=1\]"):
        WrapperConformance(DoubleStep, base="sgd_momentum").run("hooks")


def test_a_custom_base_optimizer():
    rmsprop = BaseOptimizer("rmsprop", lambda groups, lr: torch.optim.RMSprop(groups, lr=lr), 0.01, 0.01, 800)
    WrapperConformance(Delegating, make_transparent=Delegating, base=rmsprop, n_groups=2).run_all()


def test_an_unavailable_base_is_skipped():
    missing = BaseOptimizer("missing", BASE_OPTIMIZERS["adam"].make, 0.01, 0.1, 10, requires="no_such_module_xyz")
    assert not missing.available()
    with pytest.raises(unittest.SkipTest):
        WrapperConformance(Delegating, base=missing).run("resume")


def test_bad_arguments():
    with pytest.raises(TypeError, match="make_wrapper"):
        WrapperConformance(None)
    with pytest.raises(TypeError, match="make_transparent"):
        WrapperConformance(Delegating, make_transparent=3)
    with pytest.raises(ValueError, match="unknown base"):
        WrapperConformance(Delegating, base="nope")
    with pytest.raises(TypeError, match="BaseOptimizer"):
        WrapperConformance(Delegating, base=3)
    with pytest.raises(ValueError, match="n_groups"):
        WrapperConformance(Delegating, n_groups=3)
    with pytest.raises(ValueError, match="steps"):
        WrapperConformance(Delegating, steps=0)
    with pytest.raises(ValueError, match="unknown conformance check"):
        WrapperConformance(Delegating).run("nope")
    with pytest.raises(ValueError, match="activation must be one of"):
        WrapperConformance(Delegating, activation="gelu")


def test_a_positively_homogeneous_problem_for_symmetry_wrappers():
    check_wrapper(lambda opt: GradientScaling(opt, 0.5), make_transparent=Delegating, bases=["adam"], group_counts=(2,), activation="relu")


def test_checks_and_bases_are_listed():
    assert set(CHECKS) == {name[len("check_") :] for name in dir(WrapperConformance) if name.startswith("check_")}
    assert {"sgd_momentum", "adagrad", "adam", "adamw_foreach"} <= set(available_bases())
