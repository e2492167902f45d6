"""The lean balance path (``teleopt.teleport.companion``): the engine's result without its passes.

``Teleport(..., objective="balance", every=1)`` runs each scheduled teleport on a cached plan: one batched
closed-form solve per kind of site, every write computed first and made at once, no forward or backward.
These tests hold it to the engine's result in float64 (parameters and Adam moments to 1e-12 of their scale:
both paths compute the same statistics, balanced points and transport rules, in another order of summation),
to its check policy (the first teleport of every plan is checked, lean, with the engine's output check; later
ones run unchecked only after that check accepted) and to its cache (rebuilt when the sites' param groups change).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from teleopt import AxisAction, Member, Site, get_action
from teleopt.teleport import Teleport
from teleopt.teleport.companion import BalanceCompanion

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = AxisAction("lora_gl", "general", (Member("B", 1, -1), Member("A", 0, 1)), reference="Zhao 2026, Ex. 1.2.13")
RELU = get_action("positive_rescaling", activation="relu")
TANH_AS_RELU = get_action("positive_rescaling", activation="relu")  # bound to a tanh layer below: not a symmetry


class LoRALike(nn.Module):
    """Two frozen linear layers with trainable low-rank pairs B A added (as peft's LoRA), tanh between, and a
    trainable ReLU head whose hidden units carry a positive scaling."""

    def __init__(self, d: int = 12, r: int = 3, hidden: int = 10) -> None:
        super().__init__()
        self.base1, self.base2 = nn.Linear(d, d), nn.Linear(d, d)
        for p in [*self.base1.parameters(), *self.base2.parameters()]:
            p.requires_grad_(False)
        self.A1, self.A2 = (nn.Parameter(torch.randn(r, d) / d**0.5) for _ in range(2))
        self.B1, self.B2 = (nn.Parameter(torch.randn(d, r) / r**0.5) for _ in range(2))
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.base1(x) + x @ self.A1.T @ self.B1.T)
        h = torch.tanh(self.base2(h) + h @ self.A2.T @ self.B2.T)
        return self.fc2(torch.relu(self.fc1(h)))


def lora_like() -> tuple[nn.Module, list[Site] | str, Tensor, Tensor]:
    torch.manual_seed(0)
    model = LoRALike().double()
    sites = [Site(LORA, ("B1", "A1")), Site(LORA, ("B2", "A2")), Site(RELU, ("fc1.weight", "fc1.bias", "fc2.weight"))]
    gen = torch.Generator().manual_seed(1)
    return model, sites, torch.randn(16, 12, generator=gen, dtype=torch.float64), torch.randn(16, 3, generator=gen, dtype=torch.float64)


class ResidualAttention(nn.Module):
    """Multi-head self-attention (separate q, k, v, o) in a post-norm residual block, and a linear head: the
    residual stream fixes o's rows, so its sites (Q/K and V/O GL per head) share no tensor axis."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 4)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape

        def split(z: Tensor) -> Tensor:
            return z.reshape(b, t, self.heads, -1).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        return self.head(self.norm(x + self.o((att @ v).transpose(1, 2).reshape(b, t, d)))).mean(1)


def attention() -> tuple[nn.Module, list[Site] | str, Tensor, Tensor]:
    torch.manual_seed(0)
    model = ResidualAttention().double()
    gen = torch.Generator().manual_seed(1)
    return model, "auto", torch.randn(4, 5, 16, generator=gen, dtype=torch.float64), torch.randn(4, 4, generator=gen, dtype=torch.float64)


class TinyLlama(nn.Module):
    """A 1-layer Llama-architecture LM (transformers; ``heads`` query heads on ``kv_heads`` key/value heads)
    returning its logits: ``"auto"`` finds rotary Q/K scalings,
    V/O GL, an MLP rescaling and the gained residual rotation, which the closed form leaves at the identity."""

    def __init__(self, heads: int = 2, kv_heads: int = 1) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
            intermediate_size=24, max_position_embeddings=16,
        )  # fmt: skip
        self.lm = transformers.LlamaForCausalLM(config)

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(ids, use_cache=False).logits


def llama() -> tuple[nn.Module, list[Site] | str, Tensor, Tensor]:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = TinyLlama().double()
    gen = torch.Generator().manual_seed(1)
    return model, "auto", torch.randint(0, 32, (3, 6), generator=gen), torch.randn(3, 6, 32, generator=gen, dtype=torch.float64)


def wrapped(make: Callable[[], tuple[nn.Module, list[Site] | str, Tensor, Tensor]], lean: bool, **options: object):
    model, sites, x, y = make()
    groups = options.pop("groups", None)
    near = bool(options.pop("near", False))  # off: every lean teleport takes the closed form (the engine's result)
    make_base = options.pop("base", lambda params: torch.optim.AdamW(params, lr=1e-2))
    assert callable(make_base)
    base = make_base(groups(model) if callable(groups) else [p for p in model.parameters() if p.requires_grad])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sites left out of "auto" detection
        opt = Teleport(base, model, sites, objective="balance", every=1, example_inputs=x[:2], **options)
    BalanceCompanion.of(opt).enabled = lean
    BalanceCompanion.of(opt).near = near

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return model, opt, step


def _close(a: Tensor, b: Tensor) -> float:
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-300)
    return float((a - b).abs().max()) / scale


def _step_with_engine_twin(model: nn.Module, opt: Teleport, x: Tensor, y: Tensor) -> tuple[nn.Module, Teleport]:
    """One step of the lean wrapper and of a copy of it (taken before the step) whose companion is off: the engine."""
    twin, engine_opt = copy.deepcopy((model, opt))
    BalanceCompanion.of(engine_opt).enabled = False
    for m, o in ((model, opt), (twin, engine_opt)):
        o.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        o.step()
    return twin, engine_opt


@pytest.mark.parametrize("make", [lora_like, attention, llama], ids=["lora-like", "attention", "llama"])
def test_the_lean_path_moves_parameters_and_moments_as_the_engine_does(make) -> None:
    # each step from one state twice: the lean wrapper, and a copy of it whose companion is off (the engine).
    # Compared step by step from a common state, not over a run: a parameter with a structurally zero gradient
    # (k's bias under softmax) takes Adam steps of round-off noise, which no two summation orders share.
    model, opt, step = wrapped(make, lean=True)
    _, _, x, y = make()
    lean, moved = 0, 0.0
    for _ in range(7):
        twin, engine_opt = _step_with_engine_twin(model, opt, x, y)
        a, b = opt.reports[-1], engine_opt.reports[-1]
        assert b.check != "none" and a.accepted == b.accepted
        if a.check == "none":
            lean, moved = lean + 1, max(moved, *a.coordinate_norms.values())
            # the engine also counts the state of the members it moves by the identity (sites the closed form leaves
            # alone: the gained residual rotation); the lean path leaves those untouched
            alone = any(not isinstance(site.action, AxisAction) for site in a.sites)
            assert alone or a.state_decisions == b.state_decisions
            assert a.coordinate_norms == pytest.approx(b.coordinate_norms, rel=1e-12)
            assert a.grad_norm_after == pytest.approx(b.grad_norm_after, rel=1e-12)
            assert a.objective_after == pytest.approx(b.objective_after, rel=1e-12) and a.objective_after < a.objective_before
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert _close(p.detach(), q.detach()) <= 1e-12, name
            for key, value in opt.state[p].items():
                if isinstance(value, Tensor):
                    assert _close(value, engine_opt.state[q][key]) <= 1e-12, (name, key)
    assert lean >= 4, [(r.step, r.check, r.reason) for r in opt.reports]
    assert moved > 1e-6  # the lean teleports balanced something (not a comparison of idle teleports)


def test_the_first_teleport_of_a_plan_is_checked_and_the_later_ones_run_unchecked() -> None:
    _, opt, step = wrapped(lora_like, lean=True)
    for _ in range(6):
        step()
    checks = [r.check for r in opt.reports]
    first = checks.index("none")
    assert first >= 1 and all(c != "none" for c in checks[:first]) and all(c == "none" for c in checks[first:]), checks
    assert opt.reports[first - 1].accepted  # the plan's first teleport, checked (lean, the engine's check)
    assert "lean balance, checked" in opt.reports[first - 1].check_detail
    assert "first teleport was checked" in opt.reports[first].check_detail


def test_a_plan_whose_checked_teleport_is_rolled_back_never_runs_lean() -> None:
    # a "scaling" across tanh hidden units: not a symmetry, so the output check rolls every one back
    def make() -> tuple[nn.Module, list[Site] | str, Tensor, Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        with torch.no_grad():
            model[0].weight.mul_(torch.linspace(0.2, 3.0, 8, dtype=torch.float64).unsqueeze(1))
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randn(8, 2, generator=gen, dtype=torch.float64)
        return model, [Site(TANH_AS_RELU, ("0.weight", "0.bias", "2.weight"))], x, y

    _, opt, step = wrapped(make, lean=True)
    for _ in range(5):
        step()
    assert all(r.check != "none" for r in opt.reports)
    assert not any(r.accepted for r in opt.reports), [r.reason for r in opt.reports]


def test_the_plan_is_built_once_and_rebuilt_when_a_param_group_changes() -> None:
    def groups(model: nn.Module) -> list[dict[str, object]]:
        return [
            {"params": [model.A1, model.B1, model.A2, model.B2]},
            {"params": list(model.fc1.parameters()) + list(model.fc2.parameters())},
        ]

    _, opt, step = wrapped(lora_like, lean=True, groups=groups)
    companion = BalanceCompanion.of(opt)
    for _ in range(4):
        step()
    builds = companion.builds
    for _ in range(4):
        step()
    assert companion.builds == builds  # cached: no rebuild while nothing changes
    assert opt.reports[-1].check == "none"
    # a trust region the balanced points of the scaling site lie outside of: rebuilt, and the engine decides
    opt.param_groups[1]["teleopt_teleport_trust_region"] = 0.5
    step()
    assert companion.builds == builds + 1
    assert companion.plan is not None and 0.5 in companion.plan.radii
    # teleports disabled for the head's group: rebuilt without its site, which the report lists as skipped
    opt.param_groups[1]["teleopt_teleport_enabled"] = False
    step()
    assert companion.builds == builds + 2
    assert companion.plan is not None and [s.name for s in companion.plan.sites] == [s.name for s in opt.sites or []][:2]
    for _ in range(2):
        step()
    report = opt.reports[-1]
    assert report.check == "none" and report.accepted
    assert any("disabled" in why for why in report.skipped.values())


def test_a_copy_of_the_wrapper_builds_its_own_plan() -> None:
    model, opt, step = wrapped(lora_like, lean=True)
    for _ in range(4):
        step()
    assert BalanceCompanion.of(opt).plan is not None
    clone = copy.deepcopy(opt)
    assert BalanceCompanion.of(clone).plan is None and BalanceCompanion.of(clone).enabled


def test_new_storage_for_a_member_drops_the_plan_and_the_engine_takes_that_teleport() -> None:
    model, opt, step = wrapped(lora_like, lean=True)
    for _ in range(4):
        step()
    companion = BalanceCompanion.of(opt)
    builds = companion.builds
    assert opt.reports[-1].check == "none"
    with torch.no_grad():
        model.A1.data = model.A1.data.clone()  # the plan's views are of the old storage
    step()
    assert opt.reports[-1].check != "none" and opt.reports[-1].accepted  # the engine moved the live tensors
    step()  # replanned (the first teleport of the new plan is checked)
    assert companion.builds == builds + 1
    for _ in range(2):
        step()
    assert opt.reports[-1].check == "none" and opt.reports[-1].accepted


@pytest.mark.parametrize("make", [lora_like, attention], ids=["lora-like", "attention"])
def test_the_readme_configuration_runs_its_later_balance_teleports_lean_and_as_the_engine(make) -> None:
    # Teleport(opt, model, sites, example_inputs=..., loss_fn=..., batch_fn=...) with the default objective and
    # schedule (balance every 200 steps from step 200): the plan's first teleport is checked (lean) on
    # batch_fn's batch; the later ones need no batch (the closed form reads only the weights), so they run lean
    # and batch_fn is not called for them.  Each teleport step is compared with a twin whose companion is off.
    model, sites, x, y = make()
    calls = [0]

    def batch_fn() -> tuple[Tensor, Tensor]:
        calls[0] += 1
        return x, y

    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sites left out of "auto" detection
        opt = Teleport(base, model, sites, example_inputs=x[:2], loss_fn=nn.functional.mse_loss, batch_fn=batch_fn)
    assert opt.objective.name == "balance"
    lean, moved, engine_calls = 0, 0.0, 0
    for _ in range(1001):
        due = opt._schedule.due(opt._record.step, opt._record.accepted)
        if due:
            twin, engine_opt = copy.deepcopy((model, opt))
            BalanceCompanion.of(engine_opt).enabled = False
            before = calls[0]
            engine_opt.zero_grad()
            nn.functional.mse_loss(twin(x), y).backward()
            engine_opt.step()
            engine_calls += calls[0] - before
            calls[0] = before
        before = calls[0]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if not due:
            continue
        a, b = opt.reports[-1], engine_opt.reports[-1]
        assert b.check == "batch" and b.accepted and b.shrink == 1.0, (b.check, b.reason, b.shrink)
        if a.check == "none":
            lean, moved = lean + 1, max(moved, *a.coordinate_norms.values())
            assert calls[0] == before  # a lean teleport needs no batch
            assert a.state_decisions == b.state_decisions and a.coordinate_norms == pytest.approx(b.coordinate_norms, rel=1e-12)
            assert a.grad_norm_after == pytest.approx(b.grad_norm_after, rel=1e-12)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert _close(p.detach(), q.detach()) <= 1e-12, name
            for key, value in opt.state[p].items():
                if isinstance(value, Tensor):
                    assert _close(value, engine_opt.state[q][key]) <= 1e-12, (name, key)
    checks = [r.check for r in opt.reports]
    assert len(checks) == 5 and checks[0] == "batch" and lean == 4, [(r.step, r.check, r.reason) for r in opt.reports]
    assert engine_calls == 5 and calls[0] == 1  # the engine's twin called batch_fn at every teleport, the lean run once
    assert moved > 1e-6


def test_an_explicit_batch_or_a_closure_still_goes_through_the_engine_and_its_check() -> None:
    model, sites, x, y = lora_like()
    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt = Teleport(
        base, model, sites, objective="balance", every=1, example_inputs=x[:2], loss_fn=nn.functional.mse_loss, batch_fn=lambda: (x, y)
    )

    def closure() -> Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(4):
        closure()
        opt.step()
    assert opt.reports[-1].check == "none"  # scheduled, with batch_fn: lean once the plan was checked
    opt.step(closure)
    assert opt.reports[-1].check != "none" and opt.reports[-1].accepted  # a closure's loss: the engine decides
    closure()
    report = opt.teleport(batch=(x, y))
    assert report.check == "batch" and report.accepted  # the user asked for a check on this batch


def test_a_lean_teleport_joins_the_open_watch() -> None:
    # every=1 with the default 10-step watch: each lean teleport arrives while the earlier ones are watched; it
    # joins their watch (teleopt.teleport.watch.Watch.stack: a rollback undoes them all, newest first, and the
    # strikes carry over) instead of replacing it
    _, opt, step = wrapped(lora_like, lean=True)
    for _ in range(6):
        step()
    assert [r.check for r in opt.reports].count("none") >= 3
    watch = opt.record.watch
    assert watch is not None and len(watch.chain) >= 4, None if watch is None else len(watch.chain)
    step()
    assert opt.reports[-1].check == "none" and len(opt.record.watch.chain) == len(watch.chain) + 1


def _imbalance(model: nn.Module) -> float:
    """||A A^T - B^T B||_F / ||A A^T + B^T B||_F of the LoRA-like model's first pair (0 at its balanced point)."""
    a, b = model.A1.detach(), model.B1.detach()
    return float((a @ a.T - b.T @ b).norm() / (a @ a.T + b.T @ b).norm())


def test_every_step_balance_takes_newton_steps_that_keep_the_loss_and_approach_the_balanced_set(monkeypatch) -> None:
    # balance every step, then on a fixed model (AdamW with lr 0 moves nothing): once a lean teleport ran at the step
    # before, GL sites take one Newton step (GeneralLinear.balance_near_many) instead of the closed form.  The
    # first pair is put off balance by a group element (A1 -> g A1, B1 -> B1 g^-1: the loss stays); each Newton
    # step must leave the loss unchanged to float64 round-off and shrink the imbalance (quadratically) to 0.
    from teleopt.groups.matrix import GeneralLinear

    model, opt, _ = wrapped(lora_like, lean=True, near=True)
    _, _, x, y = lora_like()
    near: list[bool] = []
    original = GeneralLinear.balance_near_many

    def spy(self, stats, limit):  # noqa: ANN001, ANN202
        found = original(self, stats, limit)
        near.append(found is not None)
        return found

    monkeypatch.setattr(GeneralLinear, "balance_near_many", spy)

    def loss() -> float:
        return float(nn.functional.mse_loss(model(x), y))

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(4):
        step()
    assert [r.check for r in opt.reports][-2:] == ["none", "none"] and all(r.accepted for r in opt.reports)
    for group in opt.param_groups:
        group["lr"] = 0.0
    gen = torch.Generator().manual_seed(2)
    sym = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    g = torch.linalg.matrix_exp(0.03 * (sym + sym.T))
    with torch.no_grad():
        model.A1.copy_(g @ model.A1)
        model.B1.copy_(torch.linalg.solve(g.T, model.B1.T).T)
    imbalances, near = [_imbalance(model)], []
    for _ in range(4):
        before = loss()
        step()
        assert abs(loss() - before) <= 1e-13 * before  # float64 round-off of one exact teleport
        imbalances.append(_imbalance(model))
    assert near[:3] == [True] * 3, near  # the Newton step, not the closed form
    assert imbalances[0] > 1e-2, imbalances
    assert imbalances[1] < 0.05 * imbalances[0] and imbalances[2] < 0.05 * imbalances[1], imbalances
    # down to Balance's floor: a site whose move is below sqrt(eps) = 1.5e-8 of float64 stays (about 2 x the move)
    assert imbalances[-1] < 3e-8 and all(b <= a for a, b in zip(imbalances, imbalances[1:])), imbalances


def test_a_declined_lean_teleport_reports_the_engines_weight_norm() -> None:
    # with lr 0 after a few steps, the point stays balanced: the lean teleport declines ("no improvement") and, as
    # the engine, counts in objective_before the members of the site it leaves at the identity (the rotation)
    model, opt, step = wrapped(llama, lean=True)
    _, _, x, y = llama()
    for _ in range(4):
        step()
    for group in opt.param_groups:
        group["lr"] = 0.0
    step()
    _, engine_opt = _step_with_engine_twin(model, opt, x, y)
    a, b = opt.reports[-1], engine_opt.reports[-1]
    assert a.check == "none" and not a.accepted and "no improvement" in a.reason, (a.check, a.reason)
    assert not b.accepted and a.objective_before == pytest.approx(b.objective_before, rel=1e-12)
