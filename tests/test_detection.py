"""find_symmetries on hand-written models and generated toy graphs (CONVENTIONS.md sec. 2-3).

Every detected site is checked on the model itself, in float64, in train and eval
mode, with randomised parameters, biases and BatchNorm statistics
(``teleopt.detection.verify.randomize_``):

* invariance of each site alone and of all sites at once, with random elements
  drawn by ``teleopt.testing.group_elements`` (scales in [1/4, 4], GL condition
  number < 10, permutations): relative output error <= 1e-10 for exact sites in train
  and eval mode (the kit's float64 default; they reach ~1e-15);
* the eps-approximate BatchNorm input scaling: its stated budget is 1e-3 in eval mode
  (per BN eps |1 - c^-2| / (2 running_var) <= 1.5e-4 with eps=1e-5, c in [1/4, 4],
  running_var >= 0.5; these small nets amplify it O(1)).  In train mode the same bound
  uses the batch variance, which has no lower bound, so there it is checked exactly:
  with one scale c for all channels, BN(c z) with eps c^2 equals BN(z) with eps, so
  with eps moved along the outputs agree to 1e-10 in train and eval mode;
* minimality: every member but one -> the output changes (no over-tying);
* no hidden state: the transformed state_dict loads into a fresh instance;
* gradient transport: autograd at g.w equals the declared covector rule;
* and the detections themselves: which sites exist, which must not.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import teleopt
from teleopt import Site
from teleopt.detection import DetectionError, SymmetryReport, find_symmetries
from teleopt.detection.verify import (
    assert_batchnorm_site_exact,
    assert_site_gradient_transport,
    assert_site_invariant,
    assert_site_minimal,
    assert_sites_invariant,
    model_outputs,
    randomize_,
)
from teleopt.testing import assert_close, group_elements

APPROX_RTOL = 1e-3  # see the module docstring


pytestmark = pytest.mark.usefixtures("one_thread")


# -- models ------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 7), nn.LeakyReLU(0.1), nn.Linear(7, 3))

    def forward(self, x):
        return self.net(x)


class BNCNN(nn.Module):
    """Conv-BN-LeakyReLU, a depthwise and a grouped conv, flatten into a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.dw, self.b2 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8)
        self.gc = nn.Conv2d(8, 12, 3, groups=4)
        self.fc = nn.Linear(12 * 4 * 4, 5)

    def forward(self, x):
        x = F.leaky_relu(self.b1(self.c1(x)), 0.2)
        x = F.relu(self.b2(self.dw(x)))
        x = F.relu(self.gc(x))
        return self.fc(x.flatten(1))


class MHABlock(nn.Module):
    """Pre-norm transformer block on nn.MultiheadAttention with a ReLU MLP."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 16), nn.Linear(16, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.embed(x)
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.fc2(F.relu(self.fc1(self.n2(x))))
        return self.head(x.mean(1))


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 3) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + 0.5 * self.lora_b(self.lora_a(x))


class LoRANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = LoRALinear(nn.Linear(6, 6))
        self.l2 = nn.Linear(6, 2)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class FunctionalLoRA(nn.Module):
    """A merged low-rank update W + B A (Zhao 2026, Ex. 1.2.13) written with F.linear."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 5), requires_grad=False)
        self.A = nn.Parameter(torch.randn(2, 5))
        self.B = nn.Parameter(torch.randn(6, 2))
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.relu(F.linear(x, self.weight + self.B @ self.A)))


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.l4(self.l3(torch.tanh(self.l2(torch.relu(self.l1(x))))))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.f1, self.f2, self.out = nn.Linear(3, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = h + torch.relu(self.f1(h))
        h = h + self.f2(h)
        return self.out(h)


class Concat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 5, 1)
        self.c = nn.Conv2d(9, 6, 1)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        y = torch.cat([torch.relu(self.a(x)), F.relu(self.b(x))], dim=1)
        return self.head(F.adaptive_avg_pool2d(torch.relu(self.c(y)), 1).flatten(1))


class ConvTranspose(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.up_g = nn.ConvTranspose2d(4, 6, 3, padding=1, groups=2)
        self.out = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        return self.out(torch.relu(self.up_g(torch.relu(self.up(torch.relu(self.down(x)))))))


class GroupNormNet(nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.c1, self.gn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(groups, 8), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c2(torch.relu(self.gn(self.c1(x))))


class Heads(nn.Module):
    """Transpose and reshape of hidden units into heads, ReLU per head, and back."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 12), nn.Linear(12, 3)

    def forward(self, x):
        B, N, _ = x.shape
        h = self.l1(x).reshape(B, N, 3, 4).transpose(1, 2)  # (B, heads, N, d)
        h = torch.relu(h).transpose(1, 2).reshape(B, N, 12)
        return self.l2(h)


class SqueezeExcite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.reduce, self.expand = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        s = self.expand(torch.relu(self.reduce(x.mean((2, 3), keepdim=True))))
        return self.out(x * torch.sigmoid(s))


class LayerScaleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.fc1, self.fc2 = nn.Linear(6, 10), nn.Linear(10, 6)
        self.gamma = nn.Parameter(torch.full((6,), 1e-4))
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = h + self.gamma * self.fc2(F.gelu(self.fc1(h)))
        return self.out(h)


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 2 * 6), nn.Linear(6, 3)

    def forward(self, x):
        a, b = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(a) * b)


class PReLUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.act, self.c2 = nn.Conv2d(3, 5, 3), nn.PReLU(5), nn.Conv2d(5, 2, 1)

    def forward(self, x):
        return self.c2(self.act(self.c1(x)))


class Shared(nn.Module):
    """One Linear applied twice (a shared module)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.relu(self.shared(h))
        h = torch.relu(self.shared(h))
        return self.out(h)


class SharedInTwoPlaces(nn.Module):
    """One Linear registered in two containers of the module tree (s1.0 and s2.2) and called in both."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(5, 5)
        self.inp = nn.Linear(3, 5)
        self.s1 = nn.Sequential(shared, nn.ReLU())
        self.s2 = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), shared, nn.ReLU())
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        return self.out(self.s2(self.s1(torch.relu(self.inp(x)))))


def _img(batch: int = 8, size: int = 8) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _vec(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


# name -> (factory, example input)
MODELS = {
    "mlp": (MLP, lambda: _vec(16, 5)),
    "bn_cnn": (BNCNN, lambda: _img(8, 6)),
    "mha_block": (MHABlock, lambda: _vec(4, 5, 4)),
    "lora": (LoRANet, lambda: _vec(8, 6)),
    "functional_lora": (FunctionalLoRA, lambda: _vec(8, 5)),
    "chain": (Chain, lambda: _vec(8, 4)),
    "residual": (Residual, lambda: _vec(8, 3)),
    "concat": (Concat, lambda: _img(4, 6)),
    "conv_transpose": (ConvTranspose, lambda: _img(4, 6)),
    "group_norm_2": (lambda: GroupNormNet(2), lambda: _img(4, 6)),
    "group_norm_1": (lambda: GroupNormNet(1), lambda: _img(4, 6)),
    "heads": (Heads, lambda: _vec(4, 5, 4)),
    "squeeze_excite": (SqueezeExcite, lambda: _img(4, 6)),
    "layer_scale": (LayerScaleBlock, lambda: _vec(8, 3)),
    "swiglu": (SwiGLU, lambda: _vec(8, 4)),
    "prelu": (PReLUNet, lambda: _img(4, 6)),
    "shared": (Shared, lambda: _vec(8, 3)),
    "shared_in_two_places": (SharedInTwoPlaces, lambda: _vec(8, 3)),
}


def _build(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    factory, inputs = MODELS[name]
    torch.manual_seed(seed)
    model = factory().double()
    randomize_(model, torch.Generator().manual_seed(seed))
    return model, inputs()


_REPORTS: dict[str, SymmetryReport] = {}


def _report(name: str, model: nn.Module, x: torch.Tensor) -> SymmetryReport:
    if name not in _REPORTS:
        _REPORTS[name] = find_symmetries(model, x)
    return _REPORTS[name]


def _non_identity(site: Site, g: torch.Tensor) -> torch.Tensor:
    """Minimality needs an element that moves every member: shift a permutation that drew the identity."""
    if not site.action.continuous and torch.equal(g, torch.arange(g.numel())):
        return torch.roll(g, 1)
    return g


def _draw(data, site: Site, model: nn.Module) -> torch.Tensor:
    """A random non-identity element (coordinates of norm >= 0.1; permutations moved off the identity)."""
    params = site.tensors(model)
    strategy = group_elements(site.action, params, min_norm=0.1) if site.action.continuous else group_elements(site.action, params)
    return _non_identity(site, data.draw(strategy, label=site.name))


def _rtol(site: Site) -> float | None:
    return None if site.action.exactness == "exact" else APPROX_RTOL


def _check(model: nn.Module, site: Site, g: torch.Tensor, x: torch.Tensor, refs: dict) -> float:
    """Exact sites in train and eval mode; approximate ones in eval mode, where running_var >= 0.5 bounds them."""
    modes = ("train", "eval") if site.action.exactness == "exact" else ("eval",)
    if modes not in refs:
        refs[modes] = model_outputs(model, x, modes)
    return assert_site_invariant(model, site, g, x, rtol=_rtol(site), modes=modes, reference=refs[modes])


# -- every site of every model ---------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
@settings(deadline=None, max_examples=2, suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(data=st.data())
def test_every_site_alone_and_all_at_once_in_train_and_eval(name, data):
    model, x = _build(name)
    report = _report(name, model, x)
    assert report.sites, f"{name}: no symmetry found"
    elements = [_draw(data, s, model) for s in report.sites]
    refs: dict = {}
    for site, g in zip(report.sites, elements):
        _check(model, site, g, x, refs)
    exact = [(s, g) for s, g in zip(report.sites, elements) if s.action.exactness == "exact"]
    assert_sites_invariant(model, [s for s, _ in exact], [g for _, g in exact], x)
    assert_sites_invariant(model, report.sites, elements, x, rtol=APPROX_RTOL, modes=("eval",))
    for site in report.sites:
        if site.action.exactness == "approximate":
            assert_batchnorm_site_exact(model, site, data.draw(st.sampled_from([0.3, 0.7, 1.9, 3.3])), x)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sites_are_minimal_and_leave_no_hidden_state(name):
    model, x = _build(name)
    report = _report(name, model, x)
    gen = torch.Generator().manual_seed(7)
    reference = model_outputs(model, x)
    factory, _ = MODELS[name]
    for site in report.sites:
        g = _non_identity(site, site.action.random_element(site.tensors(model), gen, 0.5))
        for member in dict.fromkeys(site.members):
            assert_site_minimal(model, site, g, x, member, reference=reference)
    # transform everything exact, then load the state_dict into a fresh instance of the class
    for site in report.sites:
        if site.action.exactness == "exact":
            site.apply_(model, site.action.random_element(site.tensors(model), gen, 0.5))
    torch.manual_seed(1)
    fresh = factory().double()
    fresh.load_state_dict(model.state_dict())
    assert_close(model_outputs(fresh, x), reference, 1e-10)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_transform_by_the_declared_rule(name):
    model, x = _build(name)
    report = _report(name, model, x)
    gen = torch.Generator().manual_seed(3)
    target = torch.linspace(-1, 1, model(x).numel(), dtype=torch.float64).reshape(model(x).shape)

    def loss(m: nn.Module) -> torch.Tensor:
        return 0.5 * ((m(x) - target) ** 2).sum()

    checked = 0
    for site in report.sites:
        if site.action.exactness == "exact" and site.action.has_gradient_transport:
            g = site.action.random_element(site.tensors(model), gen, 0.5)
            assert_site_gradient_transport(model, site, g, loss)
            checked += 1
    assert checked


# -- generated toy graphs ------------------------------------------------------------------------
# no plain ReLU here: a random narrow ReLU layer can be dead on every sample, which makes its
# parameters irrelevant and minimality vacuous (the hand-written models cover ReLU)
_ACTS = {"leaky": lambda: nn.LeakyReLU(0.2), "gelu": nn.GELU, "tanh": nn.Tanh, "identity": nn.Identity}


class Generated(nn.Module):
    """A random stack: each block is Linear + (norm) + activation, optionally residual."""

    def __init__(self, spec: list[tuple[int, str, str, bool]], d_in: int = 3, d_out: int = 2) -> None:
        super().__init__()
        self.layers, self.norms, self.acts, self.residual = nn.ModuleList(), nn.ModuleList(), nn.ModuleList(), []
        width = d_in
        for out, act, norm, residual in spec:
            residual = residual and out == width
            self.layers.append(nn.Linear(width, out))
            self.norms.append({"none": nn.Identity(), "layer": nn.LayerNorm(out), "batch": nn.BatchNorm1d(out)}[norm])
            self.acts.append(_ACTS[act]())
            self.residual.append(residual)
            width = out
        self.out = nn.Linear(width, d_out)

    def forward(self, x):
        for layer, norm, act, residual in zip(self.layers, self.norms, self.acts, self.residual):
            h = act(norm(layer(x)))
            x = x + h if residual else h
        return self.out(x)


def _sensitive(model: nn.Module, site: Site, x: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether every tensor of the site moves the output when perturbed."""
    for name in dict.fromkeys(site.members):
        t = dict(zip(site.members, site.tensors(model)))[name]
        saved = t.detach().clone()
        with torch.no_grad():
            t.add_(0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(0), dtype=t.dtype))
        moved = model_outputs(model, x)
        with torch.no_grad():
            t.copy_(saved)
        if not float((moved - reference).norm()) > 1e-8 * float(reference.norm()):
            return False
    return True


_BLOCK = st.tuples(
    st.sampled_from([3, 4, 5]), st.sampled_from(sorted(_ACTS)), st.sampled_from(["none", "none", "layer", "batch"]), st.booleans()
)


@settings(deadline=None, max_examples=8, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.lists(_BLOCK, min_size=1, max_size=4), data=st.data())
def test_generated_graphs_every_site_holds(spec, data):
    torch.manual_seed(0)
    model = randomize_(Generated(spec).double(), torch.Generator().manual_seed(0))
    x = _vec(16, 3)
    report = find_symmetries(model, x)
    elements = [_draw(data, s, model) for s in report.sites]
    refs: dict = {}
    for site, g in zip(report.sites, elements):
        _check(model, site, g, x, refs)
        if site.action.exactness == "approximate":
            assert_batchnorm_site_exact(model, site, 0.3, x)
    exact = [(s, g) for s, g in zip(report.sites, elements) if s.action.exactness == "exact"]
    reference = model_outputs(model, x)
    assert_sites_invariant(model, [s for s, _ in exact], [g for _, g in exact], x, reference=reference)
    for site in report.sites:  # no over-tying (where the output depends on the members at all:
        if not _sensitive(model, site, x, reference):  # a random stack can have a dead ReLU layer)
            continue
        g = _non_identity(site, site.action.random_element(site.tensors(model), torch.Generator().manual_seed(1), 0.5))
        for member in dict.fromkeys(site.members):
            assert_site_minimal(model, site, g, x, member, reference=reference)
    # a LeakyReLU/identity block without norm whose output no residual stream reuses
    # always has a continuous site on its rows (read by the next layer's columns)
    for i, (_, act, norm, _) in enumerate(spec):
        stream = model.residual[i] or (i + 1 < len(spec) and model.residual[i + 1])
        if norm == "none" and act in ("leaky", "identity") and not stream:
            writer = f"layers.{i}.weight"
            assert any(writer in s.tensor_names and s.action.continuous for s in report.sites), f"block {i} of {spec}"


# -- what is found, and what must not be --------------------------------------------------------------
def _names(report: SymmetryReport) -> dict[str, list[tuple[str, ...]]]:
    out: dict[str, list[tuple[str, ...]]] = {}
    for s in report.sites:
        out.setdefault(s.action.name, []).append(tuple(dict.fromkeys(s.tensor_names)))
    return out


def test_mlp_rescaling_and_permutation_sites_with_their_members():
    model, x = _build("mlp")
    report = find_symmetries(model, x)
    found = _names(report)
    assert sorted(found["positive_rescaling"]) == [
        ("net.0.weight", "net.0.bias", "net.2.weight"),
        ("net.2.weight", "net.2.bias", "net.4.weight"),
    ]
    assert len(found["hidden_permutation"]) == 2
    assert "gl_linear" not in found
    site = next(s for s in report.sites if s.action.name == "positive_rescaling")
    powers = {m.tensor_key: (m.axis, m.power) for m in site.action.members}
    assert powers == {"net.0.weight": (0, 1), "net.0.bias": (0, 1), "net.2.weight": (1, -1)}
    # only the output layer's bias is untouched by a continuous group
    assert set(report.frozen) == {"net.4.bias"} and "model output" in report.frozen["net.4.bias"]
    n = sum(p.numel() for p in model.parameters())
    assert report.coverage == pytest.approx((n - 3) / n)


def test_cnn_batchnorm_sites():
    model, x = _build("bn_cnn")
    report = find_symmetries(model, x)
    by_anchor = {s.name: s for s in report.sites}
    approx = [s for s in report.sites if s.action.exactness == "approximate"]
    # conv rows and bias, running mean (power 1) and running variance (power 2) of the BN they feed
    first = next(s for s in approx if "c1.weight" in s.tensor_names)
    powers = {m.tensor_key: m.power for m in first.action.members}
    assert powers == {"c1.weight": 1, "c1.bias": 1, "b1.running_mean": 1, "b1.running_var": 2}
    # exact scaling of the BN output (gamma, beta) through LeakyReLU into the depthwise conv's rows
    out_scaling = [s for s in report.sites if s.action.name == "positive_rescaling" and "b1.weight" in s.tensor_names]
    assert len(out_scaling) == 1 and set(out_scaling[0].tensor_names) == {"b1.weight", "b1.bias", "dw.weight"}
    # a grouped convolution reads its input channels through its groups
    grouped = next(
        s for s in report.sites if "gc.weight" in s.tensor_names and s.action.name == "positive_rescaling" and "b2.weight" in s.tensor_names
    )
    assert any(m.groups == 4 for m in grouped.action.members)
    # the Linear reading the flattened map acts on blocks of 16 columns per channel
    flat = next(s for s in report.sites if "fc.weight" in s.tensor_names and s.action.name == "positive_rescaling")
    assert next(m for m in flat.action.members if m.tensor_key == "fc.weight").inner == 16
    assert by_anchor


def test_attention_sites_of_nn_multiheadattention():
    model, x = _build("mha_block")
    found = _names(find_symmetries(model, x))
    assert found["attention_qk_gl"] == [("attn.in_proj_weight", "attn.in_proj_bias")]
    assert found["attention_vo_gl"] == [("attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight")]
    assert len(found["attention_head_permutation"]) == 1
    # LayerNorm output scaling reaches the projections; the MLP hidden units rescale through ReLU
    assert ("n1.weight", "n1.bias", "attn.in_proj_weight") in found["positive_rescaling"]
    assert ("fc1.weight", "fc1.bias", "fc2.weight") in found["positive_rescaling"]


def test_lora_factors_get_gl_and_the_frozen_base_is_left_alone():
    model, x = _build("lora")
    report = find_symmetries(model, x)
    gl = [s for s in report.sites if s.action.name == "gl_linear"]
    assert [tuple(s.tensor_names) for s in gl] == [("l1.lora_a.weight", "l1.lora_b.weight")]
    assert all("l1.base.weight" not in s.tensor_names for s in report.sites)
    assert "frozen" in report.frozen["l1.base.weight"]
    functional = find_symmetries(*_build("functional_lora"))
    assert [set(s.tensor_names) for s in functional.sites if s.action.name == "gl_linear"] == [{"A", "B"}]


def test_chain_gl_between_linear_maps_and_nothing_through_tanh_for_scaling():
    found = _names(find_symmetries(*_build("chain")))
    assert found["gl_linear"] == [("l3.weight", "l3.bias", "l4.weight")]
    assert not any("l2.weight" in m and "l3.weight" in m for m in found.get("positive_rescaling", []))
    assert any("l2.weight" in m and "l3.weight" in m for m in found["hidden_permutation"])


def test_residual_stream_ties_every_reader_and_writer():
    found = _names(find_symmetries(*_build("residual")))
    stream = [m for m in found["positive_rescaling"] if "out.weight" in m]
    assert stream == [("inp.weight", "inp.bias", "f1.weight", "f1.bias", "f2.weight", "f2.bias", "out.weight")]


def test_concat_gives_slices_of_the_reader():
    report = find_symmetries(*_build("concat"))
    slices = {}
    for s in report.sites:
        if s.action.name != "positive_rescaling":
            continue
        for m in s.action.members:
            if m.tensor_key == "c.weight" and m.axis == 1:
                slices[s.tensor_names[0]] = (m.start, m.stop)
    assert slices == {"a.weight": (0, 4), "b.weight": (4, 9)}


def test_group_norm_blocks_input_scaling_and_permutes_only_whole_groups():
    two = _names(find_symmetries(*_build("group_norm_2")))
    assert ("gn.weight", "gn.bias", "c2.weight") in two["positive_rescaling"]
    assert not any("c1.weight" in m for m in two.get("positive_rescaling", []) + two.get("hidden_permutation", []))
    one = _names(find_symmetries(*_build("group_norm_1")))
    assert any("c1.weight" in m and "gn.weight" in m for m in one["hidden_permutation"])


def test_heads_reshape_is_followed():
    # hidden units reshaped to (3 heads, 4 channels) and back: each factor scales through ReLU,
    # acting on the rows of l1 and the columns of l2 in blocks (the joint 12-dim scaling needs
    # a group acting on two axes at once, which detection does not build)
    report = find_symmetries(*_build("heads"))
    layouts = {}
    for s in report.sites:
        if s.action.name == "positive_rescaling":
            m = next(m for m in s.action.members if m.tensor_key == "l2.weight")
            layouts[s.action.group_name] = (m.outer, m.inner)
    assert layouts == {"R_{>0}^3": (1, 4), "R_{>0}^4": (3, 1)}


def test_squeeze_excite_ties_the_gate_branch_to_its_input_channels():
    found = _names(find_symmetries(*_build("squeeze_excite")))
    assert ("conv.weight", "conv.bias", "reduce.weight", "out.weight") in found["positive_rescaling"]
    assert ("reduce.weight", "reduce.bias", "expand.weight") in found["positive_rescaling"]
    assert not any("expand.bias" in m for m in found["positive_rescaling"])  # the sigmoid gate is fixed


def test_layer_scale_absorbs_scaling_of_the_projection_and_writes_the_stream():
    found = _names(find_symmetries(*_build("layer_scale")))
    scaling = [set(m) for m in found["positive_rescaling"]]
    assert {"fc2.weight", "fc2.bias", "gamma"} in scaling
    assert {"inp.weight", "inp.bias", "fc1.weight", "gamma", "out.weight"} in scaling
    assert not any("fc1.bias" in m for m in found["positive_rescaling"])  # GELU blocks scaling
    assert any("fc1.bias" in m for m in found["hidden_permutation"])


def test_swiglu_linear_half_scales_and_both_halves_permute():
    report = find_symmetries(*_build("swiglu"))
    scaling = [s for s in report.sites if s.action.name == "positive_rescaling"]
    assert len(scaling) == 1
    fc1 = next(m for m in scaling[0].action.members if m.tensor_key == "fc1.weight")
    assert (fc1.start, fc1.stop) == (6, 12)
    perm = [s for s in report.sites if s.action.name == "hidden_permutation"]
    assert len(perm) == 1 and sum(m.tensor_key == "fc1.weight" for m in perm[0].action.members) == 2


def test_prelu_slopes_are_permuted_not_scaled():
    report = find_symmetries(*_build("prelu"))
    scaling = next(s for s in report.sites if s.action.name == "positive_rescaling")
    perm = next(s for s in report.sites if s.action.name == "hidden_permutation")
    assert "act.weight" not in scaling.tensor_names and "act.weight" in perm.tensor_names


def test_no_site_touches_model_input_or_output():
    model = nn.Linear(4, 3).double()
    report = find_symmetries(model, _vec(2, 4))
    assert report.sites == [] and report.coverage == 0.0
    assert "model input" in report.frozen["weight"] and "model output" in report.frozen["weight"]


def test_gelu_blocks_scaling_and_layer_norm_blocks_input_scaling():
    model = nn.Sequential(nn.Linear(3, 6), nn.LayerNorm(6), nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 2)).double()
    found = _names(find_symmetries(model, _vec(4, 3)))
    assert found["positive_rescaling"] == [("1.weight", "1.bias", "2.weight")]
    assert ("2.weight", "2.bias", "4.weight") in found["hidden_permutation"]
    assert any("0.weight" in m and "1.weight" in m for m in found["hidden_permutation"])


# -- timm attention variants: degrade, never a wrong site ---------------------------------------------
def _timm_attention(**kwargs):
    timm_attention = pytest.importorskip("timm.layers.attention")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = timm_attention.Attention(8, num_heads=2, qkv_bias=True, **kwargs)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.attn(x))

    torch.manual_seed(0)
    model = randomize_(Block().double(), torch.Generator().manual_seed(0))
    return model, _vec(2, 5, 8)


@pytest.mark.parametrize("fused", [True, False])
def test_timm_attention_fused_or_explicit(fused, monkeypatch):
    model, x = _timm_attention()
    model.attn.fused_attn = fused
    report = find_symmetries(model, x)
    found = _names(report)
    assert found["attention_qk_gl"] == [("attn.qkv.weight", "attn.qkv.bias")]
    assert found["attention_vo_gl"] == [("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight")]
    qk = next(s for s in report.sites if s.action.name == "attention_qk_gl")
    parts = {(m.tensor_key, m.start, m.stop, m.power) for m in qk.action.members}
    assert parts == {("attn.qkv.weight", 0, 8, 1), ("attn.qkv.bias", 0, 8, 1), ("attn.qkv.weight", 8, 16, -1)}
    gen = torch.Generator().manual_seed(2)
    for s in report.sites:
        assert_site_invariant(model, s, s.action.random_element(s.tensors(model), gen, 0.5), x, rtol=_rtol(s))


def test_qk_norm_removes_only_the_query_key_group():
    model, x = _timm_attention(qk_norm=True, norm_layer=nn.LayerNorm)
    report = find_symmetries(model, x)
    found = _names(report)
    assert "attention_qk_gl" not in found and "attention_vo_gl" in found
    assert any(e.kind == "attention" and "LayerNorm" in e.reason for e in report.skipped)
    gen = torch.Generator().manual_seed(2)
    for s in report.sites:
        assert_site_invariant(model, s, s.action.random_element(s.tensors(model), gen, 0.5), x)


class RotaryAttention(nn.Module):
    """q and k rotated by a fixed position-dependent map (as RoPE): GL on (Q, K) no longer holds."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)
        self.register_buffer("cos", torch.rand(5, 4))

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = q * self.cos, k * self.cos
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(B, N, C))


class AlibiAttention(nn.Module):
    """A per-head additive bias on the scores (as ALiBi): head permutations no longer hold."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)
        self.register_buffer("bias", torch.randn(2, 5, 5))

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1) * 0.5 + self.bias).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


def test_rotary_like_attention_degrades_to_value_output_gl():
    model = randomize_(RotaryAttention().double(), torch.Generator().manual_seed(0))
    x = _vec(2, 5, 8)
    report = find_symmetries(model, x)
    found = _names(report)
    assert "attention_qk_gl" not in found and "attention_vo_gl" in found
    gen = torch.Generator().manual_seed(1)
    for s in report.sites:
        assert_site_invariant(model, s, _non_identity(s, s.action.random_element(s.tensors(model), gen, 0.5)), x)


def test_alibi_like_bias_removes_head_permutations_but_keeps_gl():
    model = randomize_(AlibiAttention().double(), torch.Generator().manual_seed(0))
    x = _vec(2, 5, 8)
    report = find_symmetries(model, x)
    found = _names(report)
    assert "attention_qk_gl" in found and "attention_vo_gl" in found
    assert not any(s.action.group_name == "S_2" for s in report.sites)  # no permutation of the 2 heads
    gen = torch.Generator().manual_seed(1)
    for s in report.sites:
        assert_site_invariant(model, s, _non_identity(s, s.action.random_element(s.tensors(model), gen, 0.5)), x)


# -- report, options, in-place action, serialisation ----------------------------------------------
def test_report_table_and_round_trip_by_name():
    model, x = _build("bn_cnn")
    report = find_symmetries(model, x)
    text = str(report)
    assert "batchnorm_scaling" in text and "approximate" in text and "coverage" in text
    again = SymmetryReport.from_dict(report.to_dict())
    assert [s.name for s in again.sites] == [s.name for s in report.sites]
    gen = torch.Generator().manual_seed(0)
    for a, b in zip(report.sites, again.sites):
        g = a.action.random_element(a.tensors(model), gen, 0.5)
        for u, v in zip(a.act(model, g), b.act(model, g)):
            assert torch.equal(u, v)
    assert report[report.sites[0].name] is report.sites[0]
    with pytest.raises(KeyError):
        report["nope"]


def test_options_select_sites():
    mlp, v = _build("mlp")
    assert any(not s.action.continuous for s in find_symmetries(mlp, v).sites)
    assert all(s.action.continuous for s in find_symmetries(mlp, v, include_discrete=False).sites)
    model, x = _build("bn_cnn")
    assert any(s.action.exactness == "approximate" for s in find_symmetries(model, x).sites)
    assert all(s.action.exactness == "exact" for s in find_symmetries(model, x, include_approximate=False).sites)
    ce = find_symmetries(model, x, loss="cross_entropy")
    translation = [s for s in ce.sites if s.action.name == "softmax_translation"]
    assert [s.tensor_names for s in translation] == [("fc.weight", "fc.bias")]
    g = translation[0].action.random_element(translation[0].tensors(model), torch.Generator().manual_seed(0))
    assert_site_invariant(model, translation[0], g, x, output=lambda y: torch.log_softmax(y, -1))


def test_sites_act_in_place_and_optimizers_keep_their_parameters():
    model, x = _build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids = [id(p) for p in model.parameters()]
    site = find_symmetries(model, x).sites[0]
    site.apply_(model, site.action.random_element(site.tensors(model), torch.Generator().manual_seed(0), 0.5))
    assert [id(p) for p in model.parameters()] == ids
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters()))
    model(x).sum().backward()
    opt.step()


def test_shared_module_is_reported_and_its_sites_hold():
    model, x = _build("shared")
    report = find_symmetries(model, x)
    assert any(e.kind == "module" and e.where == "shared" and "2 times" in e.reason for e in report.skipped)
    gen = torch.Generator().manual_seed(0)
    for s in report.sites:
        assert_site_invariant(model, s, s.action.random_element(s.tensors(model), gen, 0.5), x)


def test_module_registered_in_two_places_is_reported_and_tied_across_both_calls():
    # state_dict names the shared tensors twice (s1.0.* and s2.2.*); the sites above check every
    # site of this model (invariance, minimality, fresh-instance reload, gradients); here: the report
    model, x = _build("shared_in_two_places")
    report = find_symmetries(model, x)
    assert any(e.kind == "module" and e.where == "s1.0" and "2 times" in e.reason for e in report.skipped)
    # the shared rows are read by s2.0 (after the first call) and write the input of out (after the
    # second): one scaling site ties the first call's input to its output through both calls
    found = _names(report)
    assert ("inp.weight", "inp.bias", "s1.0.weight", "s2.0.weight", "s2.0.bias") in found["positive_rescaling"]
    assert ("s1.0.weight", "s1.0.bias", "s2.0.weight", "out.weight") in found["positive_rescaling"]
    assert all("s2.2.weight" not in s.tensor_names for s in report.sites)  # one name per tensor


def test_tied_embedding_and_classifier():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 6)
            self.mid = nn.Linear(6, 6)

        def forward(self, idx):
            h = torch.relu(self.mid(self.emb(idx)))
            return F.linear(h, self.emb.weight)

    model = randomize_(Tied().double(), torch.Generator().manual_seed(0))
    idx = torch.randint(0, 7, (3, 4), generator=torch.Generator().manual_seed(0))
    report = find_symmetries(model, idx)
    gen = torch.Generator().manual_seed(0)
    for s in report.sites:
        assert_site_invariant(model, s, s.action.random_element(s.tensors(model), gen, 0.5), idx)
    assert any(e.kind == "parameter" and e.where == "emb.weight" for e in report.skipped)


class Constants(nn.Module):
    """Plain tensor attributes and tensors built in forward are fixed operands (fx stores them as constants)."""

    def __init__(self, shift: bool) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 4), nn.Linear(4, 2)
        self.scale = torch.rand(4, dtype=torch.float64) + 0.5  # not a parameter or buffer
        self.shift = shift

    def forward(self, x):
        h = self.l1(x) * self.scale
        if self.shift:
            h = h + torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
        return self.l2(torch.relu(h))


@pytest.mark.parametrize("shift", [False, True])
def test_constant_operands_are_fixed_and_not_left_on_the_model(shift):
    model = randomize_(Constants(shift).double(), torch.Generator().manual_seed(0))
    x = _vec(4, 3)
    attrs = set(vars(model))
    found = _names(find_symmetries(model, x))
    assert set(vars(model)) == attrs  # fx's _tensor_constant attributes are removed again
    if shift:  # adding a fixed vector breaks both scaling and permutations of those channels
        assert found == {}
    else:  # a fixed per-channel factor commutes with scaling, but is not permuted with its channels
        assert found["positive_rescaling"] == [("l1.weight", "l1.bias", "l2.weight")]
        assert "hidden_permutation" not in found


def test_multihead_attention_returning_per_head_weights_keeps_no_head_permutation():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8 + 5, 2)

        def forward(self, x):
            out, w = self.attn(x, x, x, average_attn_weights=False)  # w: (B, heads, N, N)
            return self.head(torch.cat([out, w[:, 0]], dim=-1))

    model = randomize_(M().double(), torch.Generator().manual_seed(0))
    x = _vec(2, 5, 8)
    report = find_symmetries(model, x)
    found = _names(report)
    assert "attention_head_permutation" not in found and "attention_qk_gl" in found
    assert any("per-head attention weights" in e.reason for e in report.skipped)
    gen = torch.Generator().manual_seed(0)
    for s in report.sites:
        assert_site_invariant(model, s, s.action.random_element(s.tensors(model), gen, 0.5), x)


# -- fail closed and bad input ---------------------------------------------------------------------------
class UnknownOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        h = torch.cumsum(h, dim=-1)  # an op detection has no rule for
        return self.l3(torch.relu(self.l2(h)))


def test_unknown_op_freezes_the_axes_it_touches_and_is_reported():
    model = randomize_(UnknownOp().double(), torch.Generator().manual_seed(0))
    x = _vec(4, 4)
    report = find_symmetries(model, x)
    assert any(e.kind == "op" and "cumsum" in e.reason for e in report.skipped)
    assert not any("l1.weight" in s.tensor_names and "l2.weight" in s.tensor_names for s in report.sites)
    assert any(set(s.tensor_names) == {"l2.weight", "l2.bias", "l3.weight"} for s in report.sites)
    assert "cumsum" in report.frozen["l1.bias"]


def test_a_failing_rule_fails_closed(monkeypatch):
    from teleopt.detection import rules

    def broken(ctx):
        raise IndexError("unexpected arguments")

    monkeypatch.setenv("TELEOPT_DETECTION_STRICT", "0")  # report, do not raise (tests/conftest.py sets strict mode)
    monkeypatch.setitem(rules.RULES, "leaky_relu", broken)
    model, x = _build("mlp")
    report = find_symmetries(model, x)
    assert any(e.kind == "internal_error" and "raised IndexError" in e.reason for e in report.skipped)
    found = _names(report)
    assert found["positive_rescaling"] == [("net.0.weight", "net.0.bias", "net.2.weight")]  # the ReLU layer only
    gen = torch.Generator().manual_seed(0)
    for s in report.sites:
        assert_site_invariant(model, s, s.action.random_element(s.tensors(model), gen, 0.5), x)


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.l(x)
        return -self.l(x)


class WithUntraceableChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.child, self.l2, self.l3 = nn.Linear(4, 4), Untraceable(), nn.Linear(2, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(self.child(torch.relu(self.l1(x))))))


def test_untraceable_model_raises_a_clear_error():
    # a root without submodules cannot be analysed at all
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 4))

        def forward(self, x):
            return x @ self.w.T if x.sum() > 0 else -(x @ self.w.T)

    with pytest.raises(DetectionError, match="could not trace Bare.forward with torch.fx"):
        find_symmetries(Bare(), torch.randn(2, 4))
    assert issubclass(DetectionError, ValueError)
    # a root with submodules falls back to analysing them one by one and says why
    report = find_symmetries(Untraceable(), torch.randn(2, 4))
    assert any(e.where == "" and "could not trace Untraceable.forward with torch.fx" in e.reason for e in report.skipped)
    assert report.sites == []  # l alone: its input and output are fixed


def test_untraceable_submodule_is_kept_opaque_and_frozen():
    model = randomize_(WithUntraceableChild().double(), torch.Generator().manual_seed(0))
    x = _vec(3, 4)
    report = find_symmetries(model, x)
    assert any(e.kind == "module" and e.where == "child" and "opaque" in e.reason for e in report.skipped)
    assert all("child.l.weight" not in s.tensor_names and "l1.weight" not in s.tensor_names for s in report.sites)
    assert any(set(s.tensor_names) == {"l2.weight", "l2.bias", "l3.weight"} for s in report.sites)


def test_wrong_example_inputs_are_reported_clearly():
    model = MLP()
    with pytest.raises(ValueError, match=r"example inputs do not fit the model: .*net\.0.*mat1 and mat2"):
        find_symmetries(model, torch.randn(2, 6))
    with pytest.raises(ValueError, match="takes 1 positional inputs, but 2"):
        find_symmetries(model, (torch.randn(2, 5), torch.randn(2, 5)))


@pytest.mark.parametrize(
    "name, inputs, match",
    [
        ("bn_cnn", _img(4, 6)[:, :1], r"example inputs do not fit the model: .*c1.*channels"),  # 1 channel, not 3
        ("bn_cnn", _img(4, 6)[0], r"example inputs do not fit the model: .*expected 4D input"),  # no batch axis
        ("bn_cnn", _img(4, 6).long(), r"example inputs do not fit the model: .*c1.*long"),  # integer image
        ("mha_block", _vec(4, 5, 6), r"example inputs do not fit the model: .*embed"),  # 6 features, not 4
    ],
)
def test_wrong_example_inputs_of_conv_and_attention_models_raise_a_detection_error(name, inputs, match):
    model, _ = _build(name)
    with pytest.raises(DetectionError, match=match) as info:
        find_symmetries(model, inputs)
    assert "While executing" not in str(info.value) and "\n" not in str(info.value)  # one line, no fx node dump


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        find_symmetries(lambda x: x, torch.randn(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="example_inputs"):
        find_symmetries(MLP(), [1, 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="loss must be one of"):
        find_symmetries(MLP(), torch.randn(2, 5), loss="mse")  # type: ignore[arg-type]


def test_detection_does_not_change_the_model():
    model, x = _build("bn_cnn")
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = set(vars(model))
    rng = torch.get_rng_state()
    find_symmetries(model, x)
    assert model.training and set(vars(model)) == attrs
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_public_name():
    assert teleopt.find_symmetries is find_symmetries
    assert math.isfinite(find_symmetries(MLP(), torch.randn(2, 5)).seconds)
