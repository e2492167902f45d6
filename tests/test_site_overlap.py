"""One site per symmetry: overlapping continuous sites are merged or composed under one trust region.

With separate q/k/v/o projections, detection's generic rule proposes ``gl_linear`` sites on the
same axes as the attention rule's ``attention_qk_gl`` / ``attention_vo_gl``.  A GL site contained in
another (``gl_linear`` on v rows and o columns, one GL(d_head) shared by the heads, inside the
per-head V/O group) is merged into it; sites that still share an axis are composed: each searches
within a fraction of the trust region, so the combined move of every axis stays within one radius
(singular values of the combined map in [e^-r, e^r]).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import replace

import torch
from conftest import DIM, SeparateQKVAttention
from torch import nn
from torch.nn import functional as F

import teleopt
from teleopt.detection.overlap import footprint, merge_overlapping
from teleopt.teleport import Schedule

Attention = SeparateQKVAttention


def _detected(seed: int = 0) -> tuple[nn.Module, torch.Tensor, teleopt.SymmetryReport]:
    torch.manual_seed(seed)
    model = Attention()
    x = torch.randn(8, 6, DIM, generator=torch.Generator().manual_seed(seed + 1))
    return model, x, teleopt.find_symmetries(model, x)


def test_a_gl_site_contained_in_the_attention_group_is_merged_into_it():
    _, _, report = _detected()
    names = {s.name for s in report.sites}
    assert "attention_vo_gl@matmul_1" in names and "gl_linear@v" not in names
    merged = [e for e in report.skipped if e.where == "gl_linear@v"]
    assert merged and merged[0].reason.startswith("merged into attention_vo_gl@matmul_1")


def test_no_two_continuous_sites_share_an_axis_without_one_trust_region():
    model, _, report = _detected()
    load: dict[tuple[str, int], float] = defaultdict(float)
    for site in report.sites:
        if not site.action.continuous:
            continue
        for name, axis, _, _ in set(footprint(model, site) or []):
            load[(name, axis)] += site.info.get("trust_fraction", 1.0)
    assert load and max(load.values()) <= 1.0 + 1e-12, dict(load)
    composed = [s.name for s in report.sites if "trust_fraction" in s.info]
    assert composed == ["attention_qk_gl@matmul_1", "gl_linear@k"]  # k's bias: not contained, composed instead


def test_merging_keeps_sites_on_different_axes_and_is_idempotent():
    model, _, report = _detected()
    again, notes = merge_overlapping(model, report.sites)
    assert not notes and [s.name for s in again] == [s.name for s in report.sites]
    assert "gl_linear@o" in {s.name for s in report.sites}  # o rows vs the V/O group's o columns: another axis


def _largest_row_moves(model: nn.Module, sites: list, elements: dict, names: tuple[str, ...]) -> list[float]:
    """The largest singular value of the combined map on the rows of each named projection (every element
    acting on identity matrices), checked to lie in [e^-r, e^r] for the default radius r = log 4."""
    radius = math.log(4)
    probe = copy.deepcopy(model).double()
    with torch.no_grad():
        for name in names:
            getattr(probe, name).weight.copy_(torch.eye(DIM, dtype=torch.float64))
        for site in sites:
            site.apply_(probe, elements[site.name])
    moved = []
    for name in names:
        sv = torch.linalg.svdvals(getattr(probe, name).weight.detach())
        assert float(sv.max()) <= math.exp(radius) * (1 + 1e-9) and float(sv.min()) >= math.exp(-radius) * (1 - 1e-9), (name, sv)
        moved.append(float(sv.max()))
    return moved


def _teleported(model: nn.Module, x: torch.Tensor, sites: list) -> tuple[teleopt.Teleport, teleopt.teleport.TeleportReport]:
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(5))
    opt = teleopt.Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, sites, loss_fn=F.cross_entropy, schedule=Schedule())
    F.cross_entropy(model(x), y).backward()
    tele = opt.teleport(batch=(x, y))
    assert tele.accepted, tele.reason
    return opt, tele


def test_the_combined_move_of_each_axis_stays_within_one_trust_region():
    model, x, report = _detected()
    opt, tele = _teleported(model, x, report.continuous_sites)
    assert max(_largest_row_moves(model, opt.sites or [], tele.elements, ("q", "k", "v"))) > 1.5  # a real move


def test_given_sites_that_share_an_axis_are_composed_not_dropped():
    model, x, report = _detected()
    vo = next(s for s in report.sites if s.action.name == "attention_vo_gl")
    sites = [vo, replace(vo, name="vo_twin", info={})]
    opt, tele = _teleported(model, x, sites)
    assert [s.info.get("trust_fraction") for s in opt.sites or []] == [0.5, 0.5]
    assert max(_largest_row_moves(model, opt.sites or [], tele.elements, ("v",))) > 1.2
