"""Scaling sites that tile a tensor on the lean balance path: whole tensors moved by per-parameter factors.

With two key/value heads a Llama layer has two rotary Q/K scaling sites, one per head, each acting on its half of
``q_proj``'s rows (and ``k_proj``'s).  The plan (``teleopt.teleport.balance_plan``) then moves each projection, its
gradient and its Adam moments whole and in place, by the two sites' factors laid end to end along the rows, instead
of member by member.  These tests hold that to the engine's result in float64 (1e-12 of the scale, as
``tests/test_balance_companion.py``) and to all or nothing when the writes are interrupted.
"""

from __future__ import annotations

import pytest
import torch
from conftest import products_raise
from torch import Tensor, nn

from teleopt import Site
from teleopt.teleport.companion import BalanceCompanion

pytestmark = pytest.mark.usefixtures("one_thread")


def two_heads() -> tuple[nn.Module, list[Site] | str, Tensor, Tensor]:
    pytest.importorskip("transformers")
    from test_balance_companion import TinyLlama

    torch.manual_seed(0)
    model = TinyLlama(heads=4, kv_heads=2).double()  # 4 query heads on 2 key/value heads
    gen = torch.Generator().manual_seed(1)
    return model, "auto", torch.randint(0, 32, (3, 6), generator=gen), torch.randn(3, 6, 32, generator=gen, dtype=torch.float64)


def _lean_ready():
    from test_balance_companion import wrapped

    model, opt, step = wrapped(two_heads, lean=True)
    for _ in range(3):
        step()
    assert opt.reports[-1].check == "none", [(r.check, r.reason) for r in opt.reports]
    return model, opt, step


def test_two_rotary_sites_tile_q_and_k_and_their_lanes_move_whole_tensors() -> None:
    _, opt, _ = _lean_ready()
    plan = BalanceCompanion.of(opt).plan
    assert plan is not None
    tiled = [lane for lane in plan.lanes if lane.tiled is not None and any(len(slots) == 2 for slots, _ in lane.targets)]
    assert tiled, [(len(lane.slots), lane.tiled) for lane in plan.lanes]
    for lane in tiled:
        for slots, tensor in lane.targets:  # two sites, each on its half of the rows, in order; the target whole
            assert {s.site for s in slots} == {slots[0].site, slots[1].site} and slots[0].site != slots[1].site
            assert tensor.shape == slots[0].param.shape and tensor.data_ptr() == slots[0].param.data_ptr()


def test_tiled_lanes_move_parameters_and_moments_as_the_engine_does() -> None:
    from test_balance_companion import _close, _step_with_engine_twin

    model, opt, _ = _lean_ready()
    _, _, x, y = two_heads()
    lean = 0
    for _ in range(3):
        twin, engine_opt = _step_with_engine_twin(model, opt, x, y)
        a, b = opt.reports[-1], engine_opt.reports[-1]
        assert a.accepted and b.accepted and b.check != "none"
        lean += a.check == "none"
        assert a.coordinate_norms == pytest.approx(b.coordinate_norms, rel=1e-12)
        assert a.grad_norm_after == pytest.approx(b.grad_norm_after, rel=1e-12)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert _close(p.detach(), q.detach()) <= 1e-12, name
            assert p.grad is not None and q.grad is not None and _close(p.grad, q.grad) <= 1e-12, name
            for key, value in opt.state[p].items():
                if isinstance(value, Tensor):
                    assert _close(value, engine_opt.state[q][key]) <= 1e-12, (name, key)
    assert lean == 3
    assert max(opt.reports[-1].coordinate_norms.values()) > 1e-8  # the teleports moved something


def test_an_exception_at_the_products_leaves_tiled_tensors_bitwise_and_moves_the_copies_back(monkeypatch) -> None:
    # the in-place products raise after the copies (the GL sites' parts and gradients), which move back by the
    # inverse elements (a few ulps); the scaled tensors (q, k, the MLP's), their gradients (multiplied in place too:
    # no chain) and their moments are not written yet (bitwise)
    from test_balance_companion import _close

    model, opt, _ = _lean_ready()
    _, _, x, y = two_heads()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    params = [p.detach().clone() for p in model.parameters()]
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    with products_raise(monkeypatch):
        opt.step()
    moved = 0
    for (name, p), old, g, st in zip(model.named_parameters(), params, grads, state):
        scaled = any(part in name for part in ("q_proj", "k_proj", "up_proj", "down_proj"))
        assert torch.equal(p.detach(), old) if scaled else _close(p.detach(), old) <= 1e-14, name
        assert all(_close(opt.state[p][k], v) <= 1e-14 for k, v in st.items()), name
        assert not scaled or all(torch.equal(opt.state[p][k], v) for k, v in st.items()), name
        if g is not None:
            assert p.grad is not None and (torch.equal(p.grad, g) if scaled else _close(p.grad, g) <= 1e-14), name
            moved += not torch.equal(p.grad, g)
    assert moved  # the copies were made and moved back (not a fault before the writes)
