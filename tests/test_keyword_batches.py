"""Teleport batches with keyword inputs (transformers-style ``model(**batch)``) and dropout in train mode.

``as_batch`` keeps a mapping of inputs as keyword arguments; a ``FunctionalModel``
draws the same random numbers in every pass and leaves the global generator as
it was, so a loss check on a model in train mode with dropout compares like with
like; an output with a ``.loss`` needs no ``loss_fn``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import teleopt
from teleopt.functional import Batch, FunctionalModel, as_batch
from teleopt.teleport import Schedule

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class _Output:  # the shape of a transformers ModelOutput: logits and, given labels, the loss
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class _KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 3)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None, scale: float = 1.0) -> _Output:
        logits = self.fc2(self.drop(torch.relu(self.fc1(features)))) * scale
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return _Output(logits, loss)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"features": torch.randn(16, 6, generator=g), "labels": torch.randint(0, 3, (16,), generator=g)}


def test_as_batch_keeps_keyword_inputs():
    batch = _batch()
    assert as_batch((batch, None)) == Batch((), None, batch)
    assert as_batch(batch) == Batch((), None, batch)  # a mapping alone: model(**batch)
    x = torch.ones(2, 6)
    assert as_batch((x, None, {"scale": 2.0})) == Batch((x,), None, {"scale": 2.0})
    with pytest.raises(TypeError, match="string keys"):
        as_batch(({1: torch.ones(1)}, None))
    with pytest.raises(TypeError, match="no separate kwargs"):
        as_batch((batch, None, {"scale": 2.0}))


def test_functional_model_same_masks_and_untouched_rng():
    torch.manual_seed(0)
    model = _KeywordNet().train()
    fmodel = FunctionalModel(model, None)
    batch = as_batch((_batch(), None))
    state = torch.get_rng_state()
    first, second = fmodel.loss({}, batch), fmodel.loss({}, batch)
    assert torch.equal(first, second)  # the same dropout masks
    assert torch.equal(torch.get_rng_state(), state)  # the training run's random stream is untouched
    assert torch.equal(first, model(**_batch()).loss)  # ... and they are the masks the live model draws next
    assert torch.equal(fmodel.output({}, batch).logits, fmodel.output({}, batch).logits)


def test_teleport_checks_a_keyword_batch_in_train_mode():
    """With batch_fn giving a dict and dropout active, the loss check passes (before: rolled back)."""
    torch.manual_seed(0)
    model = _KeywordNet().train()
    site = teleopt.Site(teleopt.get_action("positive_rescaling", activation="relu"), ("fc1.weight", "fc1.bias", "fc2.weight"))
    probe = _batch(1)
    opt = teleopt.Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, [site], every=2, batch_fn=lambda: (probe, None))
    for step in range(4):
        opt.zero_grad()
        model(**_batch(step)).loss.backward()
        opt.step()
    assert [r.accepted for r in opt.reports] == [True, True], [r.reason for r in opt.reports]
    assert all(r.loss_drift is not None and r.loss_drift <= 1e-5 for r in opt.reports)


def test_auto_sites_from_keyword_example_inputs():
    torch.manual_seed(0)
    model = _KeywordNet()
    opt = teleopt.Teleport(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "auto", example_inputs={"features": torch.randn(4, 6)}, schedule=Schedule()
    )
    assert opt.sites and {s.action.name for s in opt.sites} == {"positive_rescaling"}
