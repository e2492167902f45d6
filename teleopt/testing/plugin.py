"""pytest plugin of teleopt.testing (entry point ``pytest11: teleopt``).

Loaded by pytest in every project that installs teleopt, so it must stay cheap:
it imports neither torch nor hypothesis at import time and loads no hypothesis
profile (profiles are the project's choice).  It provides

* the marker ``teleopt_invariance`` (tests that check a symmetry);
* the fixture ``torch_generator``: a CPU ``torch.Generator`` seeded from the test's
  node id, so every test draws the same numbers on every run and machine;
* the fixture ``float64``: makes float64 torch's default dtype for the test.
"""

from __future__ import annotations

import zlib

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "teleopt_invariance: checks that a group action is a symmetry (teleopt.testing)")


@pytest.fixture
def torch_generator(request: pytest.FixtureRequest):
    """A CPU torch.Generator seeded from the test's node id."""
    import torch

    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def float64():
    """Run the test with torch's default dtype set to float64."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield torch.float64
    finally:
        torch.set_default_dtype(previous)
