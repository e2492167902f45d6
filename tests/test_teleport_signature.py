"""``Teleport``'s constructor: a short keyword list, and each moved keyword says where it went."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, StatePolicy, Teleport
from teleopt.teleport.config import MOVED_KEYWORDS

MAX_CONSTRUCTOR_PARAMETERS = 15  # optimizer, model, sites and every keyword (torch.optim.Adam takes 11)


def _model_and_sites() -> tuple[nn.Module, list[Site]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    return model, [Site(get_action("positive_rescaling", activation="relu"), ("0.weight", "0.bias", "2.weight"))]


def test_the_constructor_takes_at_most_15_parameters_and_no_catch_all():
    params = list(inspect.signature(Teleport.__init__).parameters.values())[1:]  # self is not counted
    assert len(params) <= MAX_CONSTRUCTOR_PARAMETERS, [p.name for p in params]
    assert not [p.name for p in params if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert not {p.name for p in params} & set(MOVED_KEYWORDS)


@pytest.mark.parametrize("keyword", sorted(MOVED_KEYWORDS))
def test_a_moved_keyword_raises_a_type_error_naming_where_it_went(keyword):
    model, sites = _model_and_sites()
    with pytest.raises(TypeError, match=rf"no longer takes {keyword}\b.*{keyword}= -> (schedule|search|state_policy|safety)=\w+\("):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites, **{keyword: None})


def test_an_unknown_keyword_is_still_pythons_type_error():
    model, sites = _model_and_sites()
    with pytest.raises(TypeError, match="unexpected keyword argument 'evry'"):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites, evry=3)  # type: ignore[call-arg]


def test_the_moved_settings_take_effect_from_their_config_objects():
    model, sites = _model_and_sites()
    x = torch.randn(5, 3, dtype=torch.float64)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        sites,
        schedule=Schedule(at=[2], warmup=1, max_teleports=1),
        search=SearchConfig(steps=3, lr=0.1, trust_region=0.5, path="fast", seed=7),
        safety=SafetyConfig(heldout_batch=(x, None)),
        state_policy=StatePolicy("transport", fallback="reset"),
        loss_fn=lambda out, _: out.square().mean(),
    )
    assert opt.schedule.at == frozenset({2}) and opt.schedule.warmup == 1 and opt.schedule.max_teleports == 1
    assert (opt.search.steps, opt.search.lr, opt.search.trust_region, opt.search.seed) == (3, 0.1, 0.5, 7)
    assert all(g["teleopt_teleport_trust_region"] == 0.5 for g in opt.param_groups)
    assert opt._heldout is not None and torch.equal(opt._heldout.inputs[0], x)
    assert opt.state_policy.fallback == StatePolicy(None, "reset").fallback != StatePolicy().fallback
    # the seed drives the generator saved in state_dict
    assert torch.equal(opt._generator.get_state(), torch.Generator().manual_seed(7).get_state())


def test_every_is_the_schedule_shortcut_and_not_given_with_a_schedule():
    model, sites = _model_and_sites()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites, every=4)
    assert opt.schedule.every == 4 and opt.schedule.warmup == 0
    with pytest.raises(ValueError, match="either schedule="):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites, every=4, schedule=Schedule(every=2))


def test_the_no_schedule_warning_points_at_the_users_line():
    model, sites = _model_and_sites()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites, objective="grad_norm")
    mine = [w for w in caught if "no schedule" in str(w.message)]
    assert len(mine) == 1 and mine[0].filename == __file__


def test_choosing_the_ascent_steps_keeps_the_ascent_at_any_value():
    """``SearchConfig(steps=100)`` is the ascent chosen, as any other value is: one meaning, no fork."""
    assert not SearchConfig().ascent_configured
    assert SearchConfig(steps=100).ascent_configured and SearchConfig(lr=0.2).ascent_configured
    assert SearchConfig().ascent().steps == 100 and SearchConfig().ascent().lr == 0.2
    assert SearchConfig(steps=7).ascent().steps == 7


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"steps": -1}, ValueError, "steps must be an int >= 0"),
        ({"lr": 0.0}, ValueError, "lr must be a positive finite number"),
        ({"seed": -1}, ValueError, "seed must be an int >= 0"),
        ({"seed": True}, ValueError, "seed must be an int >= 0"),
        ({"paper_compat": 1}, TypeError, "paper_compat must be a bool"),
    ],
)
def test_search_config_rejects_bad_moved_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        SearchConfig(**kwargs)


def test_a_held_out_batch_without_rows_is_refused_by_name():
    model, sites = _model_and_sites()
    with pytest.raises(ValueError, match="heldout_batch"):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites, safety=SafetyConfig(heldout_batch=(torch.zeros(0, 3), None)))
