"""The functional model of the base optimizers' next update matches a real step.

The preconditioned-norm and lookahead objectives and the stability cap rely on
``OptimizerModel.update`` predicting exactly what ``optimizer.step()`` will do.  In
float64 the prediction agrees with a real step to rounding (relative error
<= 1e-12: same arithmetic, different operation order).
"""

from __future__ import annotations

import pytest
import torch

from teleopt.teleport.optimizer_model import OptimizerModel, state_role
from teleopt.testing import assert_close

CONFIGS = [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, dampening=0.0)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.5, dampening=0.3, maximize=True)),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.2)),
    (torch.optim.RMSprop, dict(lr=0.01)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=0.01)),
    (torch.optim.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, foreach=True, amsgrad=True)),
]


@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=lambda c: c.__name__ if isinstance(c, type) else str(sorted(c)))
def test_update_matches_a_real_step(cls, kwargs):
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3, generator=gen, dtype=torch.float64))
    opt = cls([p], **kwargs)
    model = OptimizerModel(opt)
    for _ in range(3):  # build up some state, then predict the 4th step
        p.grad = torch.randn(5, 3, generator=gen, dtype=torch.float64)
        opt.step()
    p.grad = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    group, state = opt.param_groups[0], opt.state[p]
    predicted = model.update(group, p.detach(), p.grad, state)
    before = p.detach().clone()
    opt.step()
    assert_close(before - predicted, p.detach(), 1e-12, "predicted parameters after the step")


def test_fresh_state_prediction_matches_first_step():
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.randn(4, dtype=torch.float64)
    predicted = OptimizerModel(opt).update(opt.param_groups[0], p.detach(), p.grad, {})
    before = p.detach().clone()
    opt.step()
    assert_close(before - predicted, p.detach(), 1e-12, "first Adam step")


def test_unknown_optimizer_has_roles_but_no_update():
    torch_optimizer = pytest.importorskip("torch_optimizer")
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch_optimizer.Lamb([p])
    model = OptimizerModel(opt)
    assert not model.supported
    with pytest.raises(TypeError, match="Lamb"):
        model.update(opt.param_groups[0], p, torch.ones(3), {})
    assert state_role(opt, "exp_avg") == "first_moment"
    assert state_role(opt, "exp_avg_sq") == "second_moment"
    assert state_role(opt, "trust_ratio") == "derived"


def test_rmsprop_momentum_buffer_holds_updates():
    p = torch.nn.Parameter(torch.randn(3))
    assert state_role(torch.optim.RMSprop([p], momentum=0.9), "momentum_buffer") == "update"
    assert state_role(torch.optim.SGD([p], lr=0.1, momentum=0.9), "momentum_buffer") == "first_moment"
