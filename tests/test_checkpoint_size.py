"""A checkpoint written inside a watch window grows by the watch's elements, stored once.

After an accepted teleport the default watch keeps the teleport's group elements (``InverseMove``) in the
wrapper's record.  That record must be written once: ``torch.save(opt.state_dict())`` and a
``torch.distributed.checkpoint`` save through torch's ``get_optimizer_state_dict`` each grow by the elements'
bytes plus a small constant (the record's plain data: site names, counters, pickle and archive headers).
A record written twice (at the top level and again, encoded, in the first param group) is more than twice that.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.teleport import Schedule, Teleport

HIDDEN = 64  # one GL(64) site: 64 * 64 float32 elements, 16 KiB
#: Bytes a saved record may add besides its elements: the site's plain data, the window and references,
#: pickle opcodes and the archive entry of the elements' storage (measured: 1.0 KiB; elements stored twice add 16 KiB more).
SLACK = 4 * 1024


def teleported() -> tuple[nn.Module, Teleport, int]:
    """A linear 16-64-4 network under ``Teleport`` with a GL(64) site (float32), before and after one accepted
    teleport: the model, the wrapper (its watch open) and the elements' bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, HIDDEN), nn.Linear(HIDDEN, 4))
    site = Site(get_action("gl_linear"), ("0.weight", "0.bias", "1.weight"))
    opt = Teleport(torch.optim.Adam(model.parameters(), lr=1e-3), model, [site], schedule=Schedule())
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return model, opt, HIDDEN * HIDDEN * 4


def torch_saved(state: dict) -> int:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.tell()


def dcp_saved(model: nn.Module, opt: Teleport, path: str) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def test_torch_save_of_state_dict_grows_by_the_watch_elements_once():
    model, opt, elements = teleported()
    before = torch_saved(opt.state_dict())
    opt.zero_grad()
    ((model(torch.randn(8, 16, generator=torch.Generator().manual_seed(2))) - 1) ** 2).mean().backward()
    assert opt.teleport().accepted and opt.record.watch is not None
    growth = torch_saved(opt.state_dict()) - before
    assert elements <= growth <= elements + SLACK, (growth, elements)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_distributed_checkpoint_grows_by_the_watch_elements_once(tmp_path):
    model, opt, elements = teleported()
    before = dcp_saved(model, opt, str(tmp_path / "before"))
    opt.zero_grad()
    ((model(torch.randn(8, 16, generator=torch.Generator().manual_seed(2))) - 1) ** 2).mean().backward()
    assert opt.teleport().accepted and opt.record.watch is not None
    growth = dcp_saved(model, opt, str(tmp_path / "after")) - before
    assert elements <= growth <= elements + SLACK, (growth, elements)
