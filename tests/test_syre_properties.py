"""Property tests of syre (Ziyin et al. 2025, Sec. 5): fixed point, contraction, no reflection symmetry, reproducible anchors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from teleopt.syre import Syre
from teleopt.testing import assert_close, seeds

SHAPES = [(4, 3), (2, 5, 3)]

BASES = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.0),
}


def random_params(seed: int, shapes=SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in shapes]


def pure_decay_steps(syre: Syre, params, steps: int) -> list[list[torch.Tensor]]:
    """Steps with a zero data gradient; returns the distance vectors p - anchor after each."""
    history = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.zeros_like(p)
        syre.step()
        history.append([(p - syre.anchor(p)).detach().clone() for p in params])
    return history


@settings(deadline=None, max_examples=30)
@given(
    seed=seeds(),
    gamma=st.floats(1e-3, 1.0),
    lr=st.floats(1e-3, 0.5),
    decoupled=st.booleans(),
    diagonal_eps=st.sampled_from([0.0, 0.3]),
    base=st.sampled_from(sorted(BASES)),
)
@example(seed=0, gamma=1.0, lr=0.5, decoupled=False, diagonal_eps=0.3, base="adam")
def test_the_anchor_is_the_fixed_point_of_the_decay(seed, gamma, lr, decoupled, diagonal_eps, base):
    params = random_params(seed)
    optimizer = BASES[base](params)
    for group in optimizer.param_groups:
        group["lr"] = lr
    syre = Syre(optimizer, gamma=gamma, sigma0=1.0, decoupled=decoupled, diagonal_eps=diagonal_eps, seed=seed)
    with torch.no_grad():
        for p in params:
            p.copy_(syre.anchor(p))
    for distances in pure_decay_steps(syre, params, 5):
        # Exactly: p - a = 0 makes the coupled gradient 0 and lerp(a, a, w) = a.
        assert all(torch.equal(d, torch.zeros_like(d)) for d in distances)


@settings(deadline=None, max_examples=30)
@given(
    seed=seeds(),
    gamma=st.floats(1e-3, 1.0),
    lr=st.floats(1e-3, 0.5),
    mode=st.sampled_from([("sgd", False), ("sgd", True), ("adamw", True)]),
    diagonal_eps=st.sampled_from([0.0, 0.3]),
)
@example(seed=1, gamma=1.0, lr=0.5, mode=("sgd", False), diagonal_eps=0.3)
def test_distance_to_the_anchor_contracts_under_pure_decay(seed, gamma, lr, mode, diagonal_eps):
    base, decoupled = mode
    params = random_params(seed)
    optimizer = BASES[base](params)
    for group in optimizer.param_groups:
        group["lr"] = lr
    syre = Syre(optimizer, gamma=gamma, sigma0=1.0, decoupled=decoupled, diagonal_eps=diagonal_eps, seed=seed + 1)
    start = [(p - syre.anchor(p)).detach().clone() for p in params]
    factors = [1 - lr * gamma * (torch.ones_like(d) if diagonal_eps == 0 else syre.diagonal(p)) for p, d in zip(params, start)]
    previous = sum(float(d.norm() ** 2) for d in start) ** 0.5
    for t, distances in enumerate(pure_decay_steps(syre, params, 6), start=1):
        norm = sum(float(d.norm() ** 2) for d in distances) ** 0.5
        assert norm < previous, f"|w - theta_0| did not contract at step {t}: {norm} >= {previous}"
        previous = norm
        for d, d0, f in zip(distances, start, factors):
            # (1 - lr gamma D)^t (w_0 - theta_0), computed with <= 6 roundings per entry: 1e-12 relative.
            assert_close(d, f**t * d0, 1e-12, what=f"w - theta_0 after {t} steps")


# -- no reflection symmetry left at the anchor (Ziyin et al. 2025, Theorems 1-3, Corollary 1) ----------


def relu_net(seed: int):
    """Two-layer ReLU regression; swapping hidden neurons 0 and 1 is a reflection symmetry R = I - 2P."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 3, generator=g, dtype=torch.float64)
    y = torch.randn(20, 2, generator=g, dtype=torch.float64)
    perm = torch.tensor([1, 0, 2, 3, 4])

    def loss(ws):
        return ((torch.relu(x @ ws[0].T) @ ws[1].T - y) ** 2).mean()

    def reflect(ws):
        return [ws[0][perm], ws[1][:, perm]]

    def project(ws):  # P = (I - R) / 2: the symmetry-broken subspace
        return [(w - r) / 2 for w, r in zip(ws, reflect(ws))]

    return loss, reflect, project


def dot(xs, ys) -> float:
    return float(sum((x * y).sum() for x, y in zip(xs, ys)))


def syre_objective(syre: Syre, params, loss, values) -> torch.Tensor:
    """l(w) + syre's penalty (gamma/2)|w - theta_0|^2 evaluated at ``values``."""
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    return loss(params) + syre.penalty()


@settings(deadline=None, max_examples=15)
@given(seed=seeds(), syre_seed=seeds(), gamma=st.floats(0.01, 1.0))
def test_syre_breaks_the_permutation_reflection(seed, syre_seed, gamma):
    loss, reflect, project = relu_net(seed)
    params = random_params(seed + 1, [(5, 3), (2, 5)])
    syre = Syre(torch.optim.SGD(params, lr=0.1), gamma=gamma, sigma0=1.0, seed=syre_seed)
    anchors = [syre.anchor(p) for p in params]
    w = [p.detach().clone() for p in params]
    with torch.no_grad():
        # The original loss has the reflection (a permutation: exact up to summation order, ~1e-16).
        assert_close(loss(reflect(w)), loss(w), 1e-12, what="l(Rw) vs l(w)")
        gap = syre_objective(syre, params, loss, w) - syre_objective(syre, params, loss, reflect(w))
    # (gamma/2)(|w - a|^2 - |Rw - a|^2) = -2 gamma (Pw).(Pa): nonzero unless Pa = 0 (probability 0).
    expected = -2 * gamma * dot(project(w), project(anchors))
    assert abs(float(gap) - expected) <= 1e-10 * abs(expected) + 1e-15
    scale = gamma * dot(project(w), project(w)) ** 0.5 * dot(project(anchors), project(anchors)) ** 0.5
    assert abs(expected) > 1e-9 * scale


@settings(deadline=None, max_examples=15)
@given(seed=seeds(), syre_seed=seeds(), gamma=st.floats(0.01, 1.0))
def test_collapsed_state_is_stationary_for_sgd_but_not_for_syre(seed, syre_seed, gamma):
    """Corollary 1: at a symmetric point Pw = 0 the data gradient has no P-component; syre's has gamma |P theta_0|."""
    loss, _, project = relu_net(seed)
    start = random_params(seed + 2, [(5, 3), (2, 5)])
    with torch.no_grad():  # collapse neuron 1 onto neuron 0
        start[0][1] = start[0][0]
        start[1][:, 1] = start[1][:, 0]
    collapsed = [p.detach().clone() for p in start]
    assert dot(project(collapsed), project(collapsed)) == 0.0

    bare_params = [torch.nn.Parameter(c.clone()) for c in collapsed]
    syre_params = [torch.nn.Parameter(c.clone()) for c in collapsed]
    bare = torch.optim.SGD(bare_params, lr=0.1)
    syre = Syre(torch.optim.SGD(syre_params, lr=0.1), gamma=gamma, sigma0=1.0, seed=syre_seed)
    anchors = [syre.anchor(p) for p in syre_params]
    for optimizer, ps in ((bare, bare_params), (syre, syre_params)):
        optimizer.zero_grad()
        loss(ps).backward()
        optimizer.step()
    with torch.no_grad():
        bare_moved = dot(project(bare_params), project(bare_params)) ** 0.5
        syre_moved = [pw.clone() for pw in project(syre_params)]
        expected = [0.1 * gamma * pa for pa in project(anchors)]
    # Identical neurons get identical gradients: plain SGD cannot leave the collapsed state.
    assert bare_moved <= 1e-15
    # syre moves along the broken direction: P w_1 = -lr gamma P(w - theta_0) = lr gamma P theta_0 (towards the anchor).
    for actual, target in zip(syre_moved, expected):
        assert_close(actual, target, 1e-10, what="P w after one syre step from the collapsed state")


@settings(deadline=None, max_examples=15)
@given(seed=seeds(), syre_seed=seeds())
def test_eq7_diagonal_removes_rotation_reflections_that_eq6_keeps(seed, syre_seed):
    """l(W) = (|W|^2 - 1)^2 is invariant under every reflection I - 2vv^T (Ziyin et al. 2025, Sec. 5.2)."""
    g = torch.Generator().manual_seed(seed)

    def loss(ws):
        return (ws[0].pow(2).sum() - 1) ** 2

    objectives = {}
    for name, eps in (("eq6", 0.0), ("eq7", 0.5)):
        params = random_params(seed + 3, [(2, 3)])
        syre = Syre(torch.optim.SGD(params, lr=0.1), gamma=0.5, sigma0=1.0, diagonal_eps=eps, seed=syre_seed)
        objectives[name] = (syre, params)
    anchor = objectives["eq6"][0].anchor(objectives["eq6"][1][0]).reshape(-1)
    w = torch.randn(6, generator=g, dtype=torch.float64)
    v = torch.randn(6, generator=g, dtype=torch.float64)
    v = v - (v @ anchor) / (anchor @ anchor) * anchor  # a reflection that fixes the anchor
    v = v / v.norm()
    reflected = w - 2 * (v @ w) * v

    def value(name, vec):
        syre, params = objectives[name]
        with torch.no_grad():
            return float(syre_objective(syre, params, loss, [vec.reshape(2, 3)]))

    # eq. 6: the decay |w - a|^2 is invariant under reflections fixing a, so this symmetry survives.
    assert abs(value("eq6", reflected) - value("eq6", w)) <= 1e-12 * abs(value("eq6", w))
    # eq. 7: (gamma/2)(Rw - a)^T D (Rw - a) differs unless v is an eigenvector of D (Theorem 2).
    syre7, params7 = objectives["eq7"]
    d = syre7.diagonal(params7[0]).reshape(-1)
    anchor7 = syre7.anchor(params7[0]).reshape(-1)
    expected = 0.25 * (((reflected - anchor7) ** 2 * d).sum() - ((w - anchor7) ** 2 * d).sum())
    expected += loss([reflected]) - loss([w])
    gap = value("eq7", reflected) - value("eq7", w)
    assert abs(gap - float(expected)) <= 1e-10 * abs(float(expected))
    assert abs(gap) > 1e-6 * abs(value("eq7", w))


# -- reproducible anchors ---------------------------------------------------------------------

_DRAW_ANCHORS = textwrap.dedent(
    """
    import sys, torch
    from teleopt.syre import Syre
    torch.manual_seed(int(sys.argv[2]))       # a different global RNG state in each process
    torch.set_num_threads(int(sys.argv[3]))   # and a different thread count
    shapes = [(5, 3), (4, 5, 3, 3), (7, 2), (300, 200)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    syre = Syre(torch.optim.SGD(params, lr=0.1), gamma=0.1, diagonal_eps=0.1, seed=1234)
    torch.save([syre.anchor(p) for p in params] + [syre.diagonal(p) for p in params], sys.argv[1])
    """
)


def test_anchors_are_identical_across_processes(tmp_path):
    paths = [tmp_path / "a.pt", tmp_path / "b.pt"]
    runs = [
        subprocess.Popen([sys.executable, "-c", _DRAW_ANCHORS, str(path), str(global_seed), str(threads)], stderr=subprocess.PIPE)
        for path, global_seed, threads in zip(paths, (1, 2), (1, 2))
    ]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err.decode()
    a, b = (torch.load(path, weights_only=True) for path in paths)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # ... and identical to this process's draw.
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(5, 3), (4, 5, 3, 3), (7, 2), (300, 200)]]
    syre = Syre(torch.optim.SGD(params, lr=0.1), gamma=0.1, diagonal_eps=0.1, seed=1234)
    assert all(torch.equal(x, y) for x, y in zip(a, [syre.anchor(p) for p in params] + [syre.diagonal(p) for p in params]))
