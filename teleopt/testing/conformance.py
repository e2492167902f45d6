"""Conformance suite for drop-in ``torch.optim`` wrappers (CONVENTIONS.md sections 1 and 3).

A wrapper passes when it can replace its base optimizer anywhere: it is a real
``torch.optim.Optimizer`` sharing the base's ``param_groups`` list and ``state``,
it is bitwise transparent with its features off, it resumes exactly from a
``torch.save`` / ``torch.load(weights_only=True)`` round trip, step hooks fire once
per step, LR schedulers and ``GradScaler`` work through it, ``deepcopy`` and
``pickle`` keep it working, ``add_param_group`` gives new groups the wrapper's
defaults, and it still converges on Rosenbrock.

The suite knows nothing about a particular wrapper: you give it callables.

``make_wrapper(base) -> wrapper``
    wraps a freshly made base optimizer with the features on;
``make_transparent(base) -> wrapper`` (optional)
    wraps it with the features off (e.g. ``Syre(base, gamma=0.0)``); it must then
    follow the bare base's trajectory bit for bit.

Problems: a small tanh regression with a fixed sequence of mini-batches (weights
``(8, 4)``, ``(3, 8)`` and biases, one param group or two with different learning
rates; ``activation="relu"`` or ``"leaky_relu"`` makes its hidden layer positively
homogeneous, so a wrapper that needs a continuous symmetry, such as Teleport's
positive rescaling of the hidden units, has one) and, for convergence,
Rosenbrock's function on a ``(1, 2)`` tensor (two ``(1, 1)`` tensors with two groups).  A wrapper that needs per-parameter settings
(such as a fan-in for 1-D tensors) sets them in its factory.

Use it from pytest::

    import pytest
    from teleopt.testing.conformance import CHECKS, WrapperConformance, available_bases

    @pytest.mark.parametrize("check", CHECKS)
    @pytest.mark.parametrize("n_groups", [1, 2])
    @pytest.mark.parametrize("base", available_bases())
    def test_my_wrapper(base, n_groups, check):
        WrapperConformance(
            lambda opt: MyWrapper(opt, strength=0.1),
            make_transparent=lambda opt: MyWrapper(opt, strength=0.0),
            base=base,
            n_groups=n_groups,
        ).run(check)

or run everything at once with :func:`check_wrapper`.  A failed check raises
``AssertionError`` naming the check, base and group count; ``transparency`` without
``make_transparent`` raises ``unittest.SkipTest`` (a skip under pytest).  Bases are
:class:`BaseOptimizer` entries (``BASE_OPTIMIZERS``: SGD with momentum, Adagrad,
Adam, AdamW with ``foreach=True``, torch-optimizer's Yogi when installed); pass your
own to cover another optimizer.
"""

from __future__ import annotations

import copy
import io
import pickle
import unittest
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from teleopt.testing.bases import BASE_OPTIMIZERS, BaseOptimizer, available_bases

__all__ = [
    "BaseOptimizer",
    "BASE_OPTIMIZERS",
    "CHECKS",
    "WrapperConformance",
    "available_bases",
    "check_wrapper",
]

WrapperFactory = Callable[[Optimizer], Optimizer]


CHECKS: tuple[str, ...] = (
    "is_optimizer",
    "shares_param_groups",
    "shares_state",
    "closure",
    "transparency",
    "resume",
    "hooks",
    "scheduler",
    "grad_scaler",
    "deepcopy",
    "pickle",
    "add_param_group",
    "convergence",
)


def _assert_same(actual: Any, expected: Any, what: str) -> None:
    """Recursive bitwise equality of (nested) state: tensors by ``torch.equal`` plus dtype, the rest by ``==``."""
    if isinstance(expected, Tensor):
        if not isinstance(actual, Tensor):
            raise AssertionError(f"{what}: expected a tensor, got {type(actual).__name__}")
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise AssertionError(f"{what}: {actual.dtype} {tuple(actual.shape)} != expected {expected.dtype} {tuple(expected.shape)}")
        if not torch.equal(actual.detach().cpu(), expected.detach().cpu()):
            diff = (actual.detach().cpu().double() - expected.detach().cpu().double()).abs().max()
            raise AssertionError(f"{what}: tensors differ (max abs difference {float(diff):.3e})")
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            keys = set(actual) if isinstance(actual, dict) else type(actual).__name__
            raise AssertionError(f"{what}: keys {keys} != expected {set(expected)}")
        for key in expected:
            _assert_same(actual[key], expected[key], f"{what}[{key!r}]")
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise AssertionError(f"{what}: {actual!r} != expected {expected!r}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{what}[{i}]")
        return
    if actual != expected:
        raise AssertionError(f"{what}: {actual!r} != expected {expected!r}")


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "tanh": torch.tanh,
    "relu": torch.relu,
    "leaky_relu": lambda z: torch.nn.functional.leaky_relu(z, 0.1),
}


class _Regression:
    """Two-layer regression (tanh by default) with a fixed sequence of mini-batches (the suite's training problem)."""

    batches = 4
    batch_size = 8

    def __init__(self, dtype: torch.dtype, seed: int, activation: str = "tanh") -> None:
        self.activation = _ACTIVATIONS[activation]
        generator = torch.Generator().manual_seed(seed)

        def draw(*shape: int, scale: float = 1.0) -> Tensor:
            return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)

        self.init = [draw(8, 4, scale=0.5), draw(8, scale=0.1), draw(3, 8, scale=0.35), draw(3, scale=0.1)]
        n = self.batches * self.batch_size
        self.x = draw(n, 4)
        self.y = torch.sin(self.x @ draw(4, 3))

    def params(self) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(t.clone()) for t in self.init]

    @staticmethod
    def groups(params: Sequence[Tensor], n_groups: int) -> list[dict[str, Any]]:
        if n_groups == 1:
            return [{"params": list(params)}]
        return [{"params": list(params[:2])}, {"params": list(params[2:])}]

    def loss(self, params: Sequence[Tensor], t: int) -> Tensor:
        w1, b1, w2, b2 = params[:4]
        rows = slice((t % self.batches) * self.batch_size, (t % self.batches + 1) * self.batch_size)
        prediction = self.activation(self.x[rows] @ w1.T + b1) @ w2.T + b2
        loss = ((prediction - self.y[rows]) ** 2).mean()
        for extra in params[4:]:  # parameters added with add_param_group: a quadratic pull towards 1
            loss = loss + ((extra - 1) ** 2).sum()
        return loss


def _rosenbrock(params: Sequence[Tensor]) -> Tensor:
    xy = torch.cat([p.reshape(-1) for p in params])
    return (1 - xy[0]) ** 2 + 100 * (xy[1] - xy[0] ** 2) ** 2


def _params_of(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class WrapperConformance:
    """The checks of CONVENTIONS.md section 3 for one wrapper, base optimizer and group count.

    Parameters
    ----------
    make_wrapper:
        ``base optimizer -> wrapper`` with the features on.
    make_transparent:
        ``base optimizer -> wrapper`` with the features off (needed by ``transparency``).
    base:
        A name in ``BASE_OPTIMIZERS`` or a :class:`BaseOptimizer`.
    n_groups:
        1 or 2 param groups (the second with half the learning rate).
    steps:
        Steps per trajectory segment (resume compares ``2 * steps`` uninterrupted steps
        with ``steps`` + save/load + ``steps``).
    dtype:
        Parameter dtype of the regression problem (float32 by default, as in training).
    seed:
        Seed of the problem's data and initial weights.
    activation:
        Hidden activation of the regression problem: ``"tanh"`` (default), ``"relu"``
        or ``"leaky_relu"`` (slope 0.1).
    """

    def __init__(
        self,
        make_wrapper: WrapperFactory,
        *,
        make_transparent: WrapperFactory | None = None,
        base: str | BaseOptimizer = "adam",
        n_groups: int = 1,
        steps: int = 4,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        activation: str = "tanh",
    ) -> None:
        if not callable(make_wrapper):
            raise TypeError("WrapperConformance: make_wrapper must be callable (base optimizer -> wrapper)")
        if make_transparent is not None and not callable(make_transparent):
            raise TypeError("WrapperConformance: make_transparent must be callable or None")
        if isinstance(base, str):
            if base not in BASE_OPTIMIZERS:
                raise ValueError(f"WrapperConformance: unknown base {base!r}; known: {sorted(BASE_OPTIMIZERS)}")
            base = BASE_OPTIMIZERS[base]
        if not isinstance(base, BaseOptimizer):
            raise TypeError(f"WrapperConformance: base must be a name or a BaseOptimizer, got {type(base).__name__}")
        if n_groups not in (1, 2):
            raise ValueError(f"WrapperConformance: n_groups must be 1 or 2, got {n_groups!r}")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"WrapperConformance: steps must be a positive int, got {steps!r}")
        self.make_wrapper = make_wrapper
        self.make_transparent = make_transparent
        self.base = base
        self.n_groups = n_groups
        self.steps = steps
        if activation not in _ACTIVATIONS:
            raise ValueError(f"WrapperConformance: activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.problem = _Regression(dtype, seed, activation)

    # -- running ------------------------------------------------------------------------
    def run(self, check: str) -> None:
        """Run one check by name (see ``CHECKS``)."""
        if check not in CHECKS:
            raise ValueError(f"unknown conformance check {check!r}; known: {list(CHECKS)}")
        if not self.base.available():
            raise unittest.SkipTest(f"base optimizer {self.base.name!r} needs {self.base.requires!r}")
        try:
            getattr(self, f"check_{check}")()
        except AssertionError as error:
            raise AssertionError(f"[{check}, base={self.base.name}, groups={self.n_groups}] {error}") from error

    def run_all(self, checks: Sequence[str] = CHECKS) -> None:
        """Run several checks (``transparency`` is skipped when ``make_transparent`` is None)."""
        for check in checks:
            try:
                self.run(check)
            except unittest.SkipTest:
                continue

    # -- helpers ------------------------------------------------------------------------
    def _bare(self, params: Sequence[Tensor]) -> Optimizer:
        base = self.base.make(_Regression.groups(params, self.n_groups), self.base.lr)
        if self.n_groups == 2:
            base.param_groups[1]["lr"] = 0.5 * self.base.lr
        return base

    def _wrapped(self, params: Sequence[Tensor], factory: WrapperFactory | None = None) -> tuple[Optimizer, Optimizer]:
        base = self._bare(params)
        wrapper = (factory or self.make_wrapper)(base)
        return base, wrapper

    def _train(self, optimizer: Optimizer, params: Sequence[Tensor], start: int, steps: int) -> None:
        for t in range(start, start + steps):
            optimizer.zero_grad()
            self.problem.loss(params, t).backward()
            optimizer.step()

    # -- checks -------------------------------------------------------------------------
    def check_is_optimizer(self) -> None:
        """A real Optimizer (Optimizer.__init__ ran), without attribute forwarding to the base."""
        base, wrapper = self._wrapped(self.problem.params())
        assert isinstance(wrapper, Optimizer), f"{type(wrapper).__name__} is not a torch.optim.Optimizer"
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "defaults"):
            assert name in vars(wrapper), f"Optimizer.__init__ did not run: {name} missing"
        base.teleopt_conformance_probe = True  # type: ignore[attr-defined]  # a probe no optimizer defines
        assert not hasattr(wrapper, "teleopt_conformance_probe"), (
            "unknown attributes are forwarded to the base (a fused base's _step_supports_amp_scaling would leak)"
        )
        # With a fused base (which does claim it) this catches a leaked flag; with any base, a
        # wrapper claiming it must handle grad_scale/found_inf itself (grad_scaler checks that).
        assert not getattr(wrapper, "_step_supports_amp_scaling", False), (
            "the wrapper claims _step_supports_amp_scaling; GradScaler would skip unscaling"
        )

    def check_shares_param_groups(self) -> None:
        """``param_groups`` is the base's list, before and after steps and load_state_dict; groups hold the defaults."""
        params = self.problem.params()
        base, wrapper = self._wrapped(params)
        assert wrapper.param_groups is base.param_groups, "wrapper.param_groups is not the base's list"
        for number, group in enumerate(base.param_groups):
            missing = set(wrapper.defaults) - set(group)
            assert not missing, f"param group {number} lacks the wrapper defaults {sorted(missing)}"
        self._train(wrapper, params, 0, self.steps)
        assert wrapper.param_groups is base.param_groups, "param_groups diverged after step()"
        wrapper.load_state_dict(wrapper.state_dict())
        assert wrapper.param_groups is base.param_groups, "param_groups diverged after load_state_dict()"
        wrapper.param_groups[0]["lr"] = 0.123
        assert base.param_groups[0]["lr"] == 0.123, "a change of wrapper.param_groups did not reach the base"

    def check_shares_state(self) -> None:
        """``state`` is the base's real state and cannot be wiped by assignment."""
        params = self.problem.params()
        base, wrapper = self._wrapped(params)
        self._train(wrapper, params, 0, self.steps)
        assert wrapper.state is base.state, "wrapper.state is not the base's state"
        assert len(base.state) > 0, "the base has no state after training"
        try:
            wrapper.state = {}  # type: ignore[assignment]  # a plain dict on purpose: it must not replace the state
        except (AttributeError, TypeError):
            pass
        assert wrapper.state is base.state and len(base.state) > 0, "assigning wrapper.state replaced the base's state"
        wrapper.load_state_dict(wrapper.state_dict())
        assert wrapper.state is base.state, "wrapper.state is not the base's state after load_state_dict()"

    def check_closure(self) -> None:
        """``step(closure)`` runs the closure once with gradients enabled and returns its value."""
        params = self.problem.params()
        _, wrapper = self._wrapped(params)
        calls = []

        def closure() -> Tensor:
            calls.append(torch.is_grad_enabled())
            wrapper.zero_grad()
            loss = self.problem.loss(params, 0)
            loss.backward()
            return loss

        # torch annotates closures as returning float; they return the loss tensor
        result = wrapper.step(cast("Callable[[], float]", closure))
        assert calls == [True], f"closure calls (grad enabled each time): {calls}, expected [True]"
        assert isinstance(result, Tensor) and torch.isfinite(result), f"step(closure) returned {result!r}"
        assert wrapper.step() is None, "step() without a closure should return None"

    def check_transparency(self) -> None:
        """With the features off the wrapper follows the bare base bit for bit (parameters and state)."""
        if self.make_transparent is None:
            raise unittest.SkipTest("no make_transparent factory given")
        bare_params, wrapped_params = self.problem.params(), self.problem.params()
        bare = self._bare(bare_params)
        base, wrapper = self._wrapped(wrapped_params, self.make_transparent)
        self._train(bare, bare_params, 0, 2 * self.steps)
        self._train(wrapper, wrapped_params, 0, 2 * self.steps)
        for i, (a, e) in enumerate(zip(wrapped_params, bare_params)):
            _assert_same(a.detach(), e.detach(), f"parameter {i}")
        _assert_same(base.state_dict()["state"], bare.state_dict()["state"], "base state")

    def _saved_and_loaded(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    def check_resume(self) -> None:
        """save -> torch.load(weights_only=True) -> load into a fresh wrapper continues exactly."""
        straight = self.problem.params()
        _, wrapper = self._wrapped(straight)
        self._train(wrapper, straight, 0, 2 * self.steps)

        first = self.problem.params()
        _, interrupted = self._wrapped(first)
        self._train(interrupted, first, 0, self.steps)
        loaded = self._saved_and_loaded(interrupted.state_dict())
        resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first]
        fresh_base, resumed = self._wrapped(resumed_params)
        resumed.load_state_dict(loaded)
        assert resumed.param_groups is fresh_base.param_groups, "param_groups diverged after load_state_dict()"
        self._train(resumed, resumed_params, self.steps, self.steps)
        for i, (a, e) in enumerate(zip(resumed_params, straight)):
            _assert_same(a.detach(), e.detach(), f"parameter {i} after resume")
        _assert_same(resumed.state_dict(), wrapper.state_dict(), "state_dict after resume")

    def check_hooks(self) -> None:
        """Step hooks of wrapper and base fire once per step; state_dict hooks once per call."""
        params = self.problem.params()
        base, wrapper = self._wrapped(params)
        counts = dict.fromkeys(("pre", "post", "base_pre", "base_post", "sd_pre", "sd_post", "load_pre", "load_post"), 0)

        def counter(key: str) -> Callable[..., None]:
            def hook(*args: Any) -> None:
                counts[key] += 1

            return hook

        wrapper.register_step_pre_hook(counter("pre"))
        wrapper.register_step_post_hook(counter("post"))
        base.register_step_pre_hook(counter("base_pre"))
        base.register_step_post_hook(counter("base_post"))
        wrapper.register_state_dict_pre_hook(counter("sd_pre"))
        wrapper.register_state_dict_post_hook(counter("sd_post"))
        wrapper.register_load_state_dict_pre_hook(counter("load_pre"))
        wrapper.register_load_state_dict_post_hook(counter("load_post"))
        self._train(wrapper, params, 0, self.steps)
        wrapper.load_state_dict(wrapper.state_dict())
        expected = {
            "pre": self.steps,
            "post": self.steps,
            "base_pre": self.steps,
            "base_post": self.steps,
            "sd_pre": 1,
            "sd_post": 1,
            "load_pre": 1,
            "load_post": 1,
        }
        assert counts == expected, f"hook calls {counts} != expected {expected}"

    def check_scheduler(self) -> None:
        """An LR scheduler accepts the wrapper, changes the base's lr, and sees the wrapper's steps."""
        params = self.problem.params()
        base, wrapper = self._wrapped(params)
        initial = [group["lr"] for group in base.param_groups]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scheduler = torch.optim.lr_scheduler.StepLR(wrapper, step_size=1, gamma=0.5)
            for t in range(2):
                wrapper.zero_grad()
                self.problem.loss(params, t).backward()
                wrapper.step()
                scheduler.step()
        order = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
        assert not order, f"the scheduler did not see the wrapper's step: {order}"
        lrs = [group["lr"] for group in base.param_groups]
        assert lrs == [0.25 * lr for lr in initial], f"base lrs {lrs} != 0.25 x {initial}"

    def check_grad_scaler(self) -> None:
        """GradScaler: finite steps match unscaled training bitwise; a step with inf gradients changes nothing.

        The loss scale is a power of two, so scaling and unscaling are exact in IEEE
        arithmetic at these magnitudes: unscaled gradients equal plain ones bit for bit.
        """
        plain = self.problem.params()
        _, reference = self._wrapped(plain)
        self._train(reference, plain, 0, 2)

        params = self.problem.params()
        _, wrapper = self._wrapped(params)
        device = params[0].device.type
        scaler = torch.amp.GradScaler(device, init_scale=2.0**8)
        for t in range(2):
            wrapper.zero_grad()
            scaler.scale(self.problem.loss(params, t)).backward()
            scaler.step(wrapper)
            scaler.update()
        for i, (a, e) in enumerate(zip(params, plain)):
            _assert_same(a.detach(), e.detach(), f"parameter {i} through GradScaler")
        before_params = [p.detach().clone() for p in params]
        before_state = copy.deepcopy(wrapper.state_dict())
        wrapper.zero_grad()
        scaler.scale(self.problem.loss(params, 2)).backward()
        grad = params[0].grad
        assert grad is not None, "backward() left parameter 0 without a gradient"
        grad[0, 0] = float("inf")
        scaler.step(wrapper)
        scaler.update()
        assert scaler.get_scale() == 2.0**7, "GradScaler did not register the inf gradient"
        for i, (p, before) in enumerate(zip(params, before_params)):
            _assert_same(p.detach(), before, f"parameter {i} after a step with inf gradients")
        _assert_same(wrapper.state_dict(), before_state, "state_dict after a step with inf gradients")

    def _check_copy(self, duplicate: Callable[[Optimizer], Optimizer], how: str) -> None:
        reference = self.problem.params()
        _, straight = self._wrapped(reference)
        self._train(straight, reference, 0, 2 * self.steps)

        params = self.problem.params()
        _, wrapper = self._wrapped(params)
        self._train(wrapper, params, 0, self.steps)
        clone = duplicate(wrapper)
        assert type(clone) is type(wrapper), f"{how} changed the type to {type(clone).__name__}"
        dropped = sorted(set(vars(wrapper)) - set(vars(clone)))
        assert not dropped, f"{how} dropped the attributes {dropped} (override __getstate__/__setstate__)"
        clone_params = _params_of(clone)
        assert all(c is not p for c, p in zip(clone_params, params)), f"{how} shares parameters with the original"
        assert clone.param_groups is not wrapper.param_groups, f"{how} shares param_groups with the original"
        self._train(clone, clone_params, self.steps, self.steps)
        self._train(wrapper, params, self.steps, self.steps)
        for i, (c, p, e) in enumerate(zip(clone_params, params, reference)):
            _assert_same(c.detach(), e.detach(), f"parameter {i} of the {how} copy")
            _assert_same(p.detach(), e.detach(), f"parameter {i} of the original after the {how} copy trained")
        _assert_same(clone.state_dict(), straight.state_dict(), f"state_dict of the {how} copy")

    def check_deepcopy(self) -> None:
        """A deepcopy is an independent wrapper that continues the trajectory exactly."""
        self._check_copy(copy.deepcopy, "deepcopy")

    def check_pickle(self) -> None:
        """A pickled and unpickled wrapper continues the trajectory exactly."""
        self._check_copy(lambda w: pickle.loads(pickle.dumps(w)), "pickle")

    def check_add_param_group(self) -> None:
        """add_param_group reaches the base with the wrapper defaults; the new group trains and resumes."""
        params = self.problem.params()
        base, wrapper = self._wrapped(params)
        reference_keys = set(base.param_groups[0])
        wrapper_values = {k: v for k, v in wrapper.defaults.items() if k in reference_keys}
        self._train(wrapper, params, 0, 1)
        extra = torch.nn.Parameter(torch.zeros(2, 3, dtype=params[0].dtype))
        wrapper.add_param_group({"params": [extra]})
        assert wrapper.param_groups is base.param_groups, "param_groups diverged after add_param_group()"
        new = base.param_groups[-1]
        assert len(base.param_groups) == self.n_groups + 1 and new["params"] == [extra], "the group did not reach the base"
        assert set(new) == reference_keys, f"new group keys differ: {sorted(set(new) ^ reference_keys)}"
        for key, value in wrapper_values.items():
            assert new[key] == value, f"new group has {key}={new[key]!r}, default {value!r}"
        all_params = [*params, extra]
        self._train(wrapper, all_params, 1, self.steps)
        assert not torch.equal(extra.detach(), torch.zeros_like(extra)), "the added parameter was not updated"
        loaded = self._saved_and_loaded(wrapper.state_dict())
        resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in all_params]
        _, resumed = self._wrapped(resumed_params[:-1])
        resumed.add_param_group({"params": [resumed_params[-1]]})
        resumed.load_state_dict(loaded)
        self._train(resumed, resumed_params, 1 + self.steps, self.steps)
        self._train(wrapper, all_params, 1 + self.steps, self.steps)
        for i, (a, e) in enumerate(zip(resumed_params, all_params)):
            _assert_same(a.detach(), e.detach(), f"parameter {i} after resuming with the added group")

    def check_convergence(self) -> None:
        """Smoke test: the wrapper brings Rosenbrock's function down like the bare base does."""
        start = torch.tensor([[-1.5, 2.0]], dtype=torch.float64)

        def run(factory: WrapperFactory | None) -> tuple[float, float]:
            if self.n_groups == 1:
                params = [torch.nn.Parameter(start.clone())]
                groups = [{"params": params}]
            else:
                params = [torch.nn.Parameter(start[:, :1].clone()), torch.nn.Parameter(start[:, 1:].clone())]
                groups = [{"params": [params[0]]}, {"params": [params[1]]}]
            optimizer = self.base.make(groups, self.base.rosenbrock_lr)
            if factory is not None:
                optimizer = factory(optimizer)
            initial = float(_rosenbrock(params).detach())
            for _ in range(self.base.rosenbrock_steps):
                optimizer.zero_grad()
                _rosenbrock(params).backward()
                optimizer.step()
            return initial, float(_rosenbrock(params).detach())

        initial, bare_final = run(None)
        target = self.base.rosenbrock_tol * initial
        assert bare_final <= target, f"bare {self.base.name} reached {bare_final:.3e} > {target:.3e}: fix the BaseOptimizer settings"
        _, final = run(self.make_wrapper)
        assert final <= target, (
            f"the wrapper reached {final:.3e} on Rosenbrock (bare {self.base.name}: {bare_final:.3e}, target {target:.3e})"
        )


def check_wrapper(
    make_wrapper: WrapperFactory,
    *,
    make_transparent: WrapperFactory | None = None,
    bases: Sequence[str | BaseOptimizer] | None = None,
    group_counts: Sequence[int] = (1, 2),
    checks: Sequence[str] = CHECKS,
    activation: str = "tanh",
) -> None:
    """Run the whole suite: every check x base (default: :func:`available_bases`) x group count."""
    for base in available_bases() if bases is None else bases:
        for n_groups in group_counts:
            WrapperConformance(
                make_wrapper, make_transparent=make_transparent, base=base, n_groups=n_groups, activation=activation
            ).run_all(checks)
