"""Certification: every site detection reports as exact is checked numerically first.

Detection proposes, certification decides (DESIGN.md).  Rules follow axes through
the traced graph and may over-approximate on constructs they do not model (a
bias concatenated from separate parameters, a mask computed from the activation
it multiplies, a negative index into ``torch.split``'s result, ...).  So before a
site is reported as exact it is applied to a float64 deep copy of the model with
a random non-identity element at the edge of the documented range (scales 1/4 or
4, GL condition number near 10, a random permutation; CONVENTIONS.md sec. 3) and
the outputs on the example inputs and keyword arguments are compared, in eval
mode and in train mode under a forked RNG (dropout draws the same masks), against
:func:`teleopt.numerics.default_rtol` of float64, norm-relatively on every tensor
leaf of the output.

Checks are batched: all sites act at once and one forward per mode decides; on a
failure the set is bisected, so the cost is a few forwards plus about
``2 log2(n)`` per failing site.  The eps-approximate BatchNorm input sites are
checked exactly with eps scaled by c^2 (``verify.assert_batchnorm_site_exact``);
the softmax translation is checked on the log-softmax of the output (it leaves the
loss, not the logits, unchanged); data-dependent sites are not certified.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from teleopt.detection.float64 import keep_float64
from teleopt.functional import check_has_rows
from teleopt.numerics import default_rtol
from teleopt.site import Site

__all__ = [
    "CertificationEntry",
    "certify_sites",
    "edge_element",
    "output_leaves",
    "output_error",
    "log_softmax_leaves",
    "to_float64",
    "mode_dependent",
]

_MODES = ("eval", "train")
_EDGE = {"general": math.log(9.9) / 2, "orthogonal": math.pi / 2, "diagonal": math.log(4.0), "translation": 1.0}


@dataclass(frozen=True)
class CertificationEntry:
    """The outcome of certifying one site: ``status`` is "certified", "dropped", "demoted" or "unchecked"."""

    site: str
    status: str
    error: float
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"site": self.site, "status": self.status, "error": self.error, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CertificationEntry:
        return cls(str(data["site"]), str(data["status"]), float(data["error"]), str(data.get("reason", "")))


def edge_element(site: Site, model: nn.Module, generator: torch.Generator) -> Tensor:
    """A random non-identity element of the site's group at the edge of the documented range.

    Scales are 1/4 or 4 (random sign of the log), GL elements are exp of coordinates of
    spectral norm log(9.9)/2 per block (condition number near 10), rotations have angle
    pi/2, permutations are random and not the identity (if the group has two units).
    """
    params = site.tensors(model)
    ref = next(p for p in params if p is not None)
    group = site.action.group(params)
    if group.kind == "permutation":
        for _ in range(8):
            g = group.random(generator=generator, device=ref.device)
            if group.n < 2 or not torch.equal(g.cpu(), torch.arange(group.n)):
                return g
        return g
    if group.kind == "sign":
        return torch.where(torch.rand(group.dim, generator=generator) < 0.5, -1.0, 1.0).to(device=ref.device, dtype=ref.dtype)
    shape = group.coord_shape
    if shape is None:
        return group.random(generator=generator, dtype=ref.dtype, device=ref.device)
    coords = torch.randn(shape, generator=generator, dtype=torch.float64)
    if group.kind == "orthogonal" and len(shape) == 2 and shape[0] > 64:  # a rotation of a random 8-dim subspace:
        u = torch.linalg.qr(coords[:, :8])[0]  # I + U (e^M - I) U^T, cheap to apply to every weight of a residual stream
        coords = u @ torch.randn(8, 8, generator=generator, dtype=torch.float64) @ u.mT
    edge = _EDGE.get(group.kind, 1.0)
    if group.kind == "diagonal":
        coords = coords.sign() * edge
    elif len(shape) >= 2:
        norm = torch.linalg.matrix_norm(coords, ord=2).clamp_min(1e-12)
        coords = coords * (edge / norm)[..., None, None]
    else:
        coords = coords * (edge / coords.norm().clamp_min(1e-12))
    return group.exp(coords).to(dtype=ref.dtype, device=ref.device)


def mode_dependent(module: nn.Module) -> bool:
    """Whether a leaf module may compute differently in train and eval mode (fail closed: True if unsure).

    Dropout with p = 0 does not; BatchNorm/InstanceNorm and any module whose ``forward``
    source mentions ``training`` (or cannot be read) may.
    """
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return float(module.p) > 0
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return True
    try:
        import inspect

        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return True
    return "training" in source


def output_leaves(output: Any) -> list[Tensor]:
    """The tensor leaves of a model output (tensors, tuples, lists, dicts, dataclass-like outputs)."""
    out: list[Tensor] = []

    def walk(v: Any, depth: int) -> None:
        if depth > 8:
            return
        if isinstance(v, Tensor):
            out.append(v.detach())
        elif isinstance(v, dict):
            for x in v.values():
                walk(x, depth + 1)
        elif isinstance(v, (tuple, list)):
            for x in v:
                walk(x, depth + 1)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name), depth + 1)

    walk(output, 0)
    return out


def _leaf_error(after: Tensor, before: Tensor) -> float:
    if after.shape != before.shape:
        return math.inf
    if not before.is_floating_point() and not before.is_complex():
        return 0.0 if torch.equal(after, before) else 1.0
    a, b = after.to(torch.float64), before.to(torch.float64)
    if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
        same = torch.equal(torch.isfinite(a), torch.isfinite(b)) and torch.equal(a[~torch.isfinite(a)], b[~torch.isfinite(b)])
        if not same:
            return math.inf
        a, b = a[torch.isfinite(a)], b[torch.isfinite(b)]
    scale = float(b.norm())
    diff = float((a - b).norm())
    return diff / scale if scale > 0 else diff


def output_error(after: list[list[Tensor]], before: list[list[Tensor]]) -> float:
    """The largest norm-relative error over matching output leaves (per forward, per leaf), in float64.

    Non-finite entries must match exactly (then the finite ones are compared); a leaf of
    another shape, or another number of leaves, is an infinite error.
    """
    worst = 0.0
    for la, lb in zip(after, before):
        if len(la) != len(lb):
            return math.inf
        for a, b in zip(la, lb):
            worst = max(worst, _leaf_error(a, b))
    return worst


def to_float64(value: Any) -> Any:
    """``value`` with every floating-point tensor (in tuples, lists and dicts) converted to float64."""
    if isinstance(value, Tensor):
        return value.detach().to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(to_float64(v) for v in value)
    if isinstance(value, list):
        return [to_float64(v) for v in value]
    if isinstance(value, dict):
        return {k: to_float64(v) for k, v in value.items()}
    return value


def log_softmax_leaves(leaves: list[Tensor]) -> list[Tensor]:
    """log-softmax over the last axis of each floating leaf (what the softmax translation leaves unchanged)."""
    return [t.log_softmax(-1) if t.is_floating_point() and t.ndim >= 1 else t for t in leaves]


class _Checker:
    """Runs the float64 copy with sites applied and compares against the reference outputs."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Sequence[Any],
        kwargs: dict[str, Any],
        modes: Sequence[str],
        seed: int,
    ) -> None:
        self.model = model
        self.inputs = tuple(to_float64(inputs))
        self.kwargs = to_float64(kwargs)
        self.modes = tuple(modes)
        self.seed = seed
        self.live = model.state_dict(keep_vars=True)
        self.state: dict[str, Tensor] = {}  # snapshots of the tensors sites act on, taken on first use
        self.dirty: set[str] = set()
        self.forwards = 0
        self.skipped_modes: dict[str, str] = {}
        self.reference: list[list[Tensor]] = []
        for mode in tuple(self.modes):  # a mode the model cannot run in (train mode on a batch of one) is left out
            try:
                self.modes = (mode,)
                self.reference += self.outputs()
            except Exception as e:  # noqa: BLE001
                self.skipped_modes[mode] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self.modes = tuple(m for m in modes if m not in self.skipped_modes)
        if not self.modes:
            raise RuntimeError(f"the model does not run on the example inputs: {next(iter(self.skipped_modes.values()))}")

    @torch.no_grad()
    def restore(self) -> None:
        for k in self.dirty:
            self.live[k].copy_(self.state[k])
        self.dirty.clear()

    def apply(self, site: Site, g: Tensor) -> None:
        for n in site.tensor_names:
            if n in self.live and n not in self.state:
                self.state[n] = self.live[n].detach().clone()
        self.dirty.update(n for n in site.tensor_names if n in self.live)
        site.apply_(self.model, g)

    @torch.no_grad()
    def outputs(self) -> list[list[Tensor]]:
        outs = []
        for mode in self.modes:
            saved = {k: v.detach().clone() for k, v in self.model.named_buffers()}
            try:
                with torch.random.fork_rng(devices=[]), keep_float64():  # the model's float32 casts stay float64
                    torch.manual_seed(self.seed)
                    self.model.train(mode == "train")
                    y = self.model(*self.inputs, **self.kwargs)
            finally:
                for k, b in self.model.named_buffers():
                    b.copy_(saved[k])
            outs.append(output_leaves(y))
            self.forwards += 1
        return outs

    def error(self, items: Sequence[tuple[Callable[[], Any], Callable[[], Any]]], transform: Callable | None = None) -> float:
        """Output error with every item applied (each an ``(apply, undo)`` pair); the model is restored."""
        self.restore()
        undo: list[Callable[[], Any]] = []
        try:
            for do, un in items:
                undo.append(un)
                do()
            after = self.outputs()
        except Exception:  # noqa: BLE001 - an element the model cannot run with: not a symmetry
            return math.inf
        finally:
            for un in reversed(undo):
                un()
            self.restore()
        before = self.reference
        if transform is not None:
            after = [transform(a) for a in after]
            before = [transform(b) for b in before]
        return output_error(after, before)


def _bisect(check: Callable[[list[int]], float], idx: list[int], rtol: float, out: dict[int, float], first: float | None = None) -> None:
    err = check(idx) if first is None else first
    if err <= rtol:
        return
    if len(idx) == 1:
        out[idx[0]] = err
        return
    mid = len(idx) // 2
    _bisect(check, idx[:mid], rtol, out)
    _bisect(check, idx[mid:], rtol, out)


def certify_sites(  # noqa: PLR0913  public: the sites, the inputs they are checked on, and five keyword-only options
    model: nn.Module,
    sites: list[Site],
    inputs: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    modes: Sequence[str] = _MODES,
    rtol: float | None = None,
    demote: bool = False,
    perturb: bool = True,
) -> tuple[list[Site], list[CertificationEntry]]:
    """Certify ``sites`` on a float64 deep copy of ``model``; returns the surviving sites and one entry per site.

    An exact site whose output error exceeds ``rtol`` (default ``default_rtol(float64)``)
    in either mode is dropped, or kept as "approximate" with the measured error in
    ``site.info["certified_error"]`` when ``demote``.  Approximate BatchNorm input
    sites are checked exactly with eps scaled by c^2 and dropped on failure.
    Data-dependent sites are kept unchecked.  The model is not changed.

    With ``perturb`` (default) the copy's constant trainable tensors (zero biases,
    norm weights of one, LayerScale 1e-6, zero heads) get noise of 0.5 max(|c|, 1)
    and other vectors 0.1 times their RMS first: a rule that leaves out a member which
    happens to be zero (timm initialises q/v biases and some heads to zero) would
    otherwise pass at initialisation and fail after training.  Buffers and frozen
    parameters are constants of the model and are not perturbed.  If the perturbed
    copy's outputs are not finite, the model's own parameters are used.
    """
    kwargs = dict(kwargs or {})
    check_has_rows(inputs, kwargs, "inputs/kwargs")
    tol = default_rtol(torch.float64) if rtol is None else rtol
    try:
        moved = copy.deepcopy(model).to(torch.float64)
    except Exception as e:  # noqa: BLE001 - a model that cannot be copied is reported, not certified
        reason = f"the model could not be copied to float64 ({type(e).__name__}: {e})"
        return sites, [CertificationEntry(s.name, "unchecked", math.nan, reason) for s in sites]
    gen = torch.Generator().manual_seed(seed)
    saved = _perturb_(moved, gen) if perturb else {}
    checker = _Checker(moved, inputs, kwargs, modes, seed)
    if perturb and not all(bool(torch.isfinite(t).all()) for leaves in checker.reference for t in leaves if t.is_floating_point()):
        with torch.no_grad():  # the perturbed model overflows: certify at the model's own parameters
            for p, value in saved:
                p.copy_(value)
        checker = _Checker(moved, inputs, kwargs, modes, seed)
    certification = _Certification(sites, checker, tol, demote)
    for i, site in enumerate(sites):
        certification.prepare(i, site, gen)
    for transform, batch in certification.batches():
        certification.check(batch, transform)
    return certification.result()


_Item = tuple[Callable[[], Any], Callable[[], Any]]  # (apply, undo) of one site on the checker's model


class _Certification:
    """The state of one :func:`certify_sites` call: each site's item, its batch, and its entry once decided.

    Sites are prepared in order (an element drawn for each, or an entry saying why it is not
    checked), then checked batch by batch: one error for the whole batch, bisected on failure.
    """

    def __init__(self, sites: list[Site], checker: _Checker, tol: float, demote: bool) -> None:
        self.sites = sites
        self.checker = checker
        self.tol = tol
        self.demote = demote
        self.entries: dict[int, CertificationEntry] = {}
        self.keep: dict[int, Site] = {}
        self.items: dict[int, _Item] = {}
        self.groups: dict[str, list[int]] = {"exact": [], "translation": [], "batchnorm": []}

    def prepare(self, i: int, s: Site, gen: torch.Generator) -> None:
        """Site ``i``: kept unchecked (data-dependent, approximate without a BatchNorm), or an item in its group."""
        if s.action.exactness == "data-dependent":
            self.entries[i] = CertificationEntry(s.name, "unchecked", math.nan, "data-dependent: holds on a given batch only")
            self.keep[i] = s
            return
        if s.action.exactness == "approximate" and not s.info.get("batchnorm"):
            self.entries[i] = CertificationEntry(s.name, "unchecked", math.nan, "approximate: no exact check for this site")
            self.keep[i] = s
            return
        try:
            if s.action.exactness == "approximate":
                self.items[i] = _batchnorm_item(self.checker, s, gen)
                self.groups["batchnorm"].append(i)
            else:
                g = edge_element(s, self.checker.model, gen)
                self.items[i] = (partial(self.checker.apply, s, g), _nothing)
                self.groups["translation" if s.action.name == "softmax_translation" else "exact"].append(i)
        except Exception as e:  # noqa: BLE001
            self.entries[i] = CertificationEntry(s.name, "dropped", math.inf, f"no element could be drawn: {type(e).__name__}: {e}")

    def batches(self) -> list[tuple[Callable | None, list[int]]]:
        """The batches to check, each with the transform of the outputs it is checked on.

        Exact and BatchNorm sites share one batch (one forward per mode when all pass); BatchNorm
        sites sharing a BatchNorm cannot scale its eps twice: those are checked one by one.  The
        softmax translation is checked on the log-softmax of the outputs.
        """
        first = list(self.groups["exact"])
        alone: list[int] = []
        seen: set[str] = set()
        for j in self.groups["batchnorm"]:
            bns = set(self.sites[j].info["batchnorm"])
            (alone if bns & seen else first).append(j)
            seen |= bns
        batches: list[tuple[Callable | None, list[int]]] = [(None, first)]
        batches += [(None, [j]) for j in alone]
        batches.append((log_softmax_leaves, self.groups["translation"]))
        return [(transform, batch) for transform, batch in batches if batch]

    def check(self, batch: list[int], transform: Callable | None) -> None:
        """Decide every site of ``batch``: one error for all, bisected down to the failing sites."""

        def error(subset: list[int]) -> float:
            return self.checker.error([self.items[j] for j in subset], transform)

        failed: dict[int, float] = {}
        err = error(list(batch))
        _bisect(error, list(batch), self.tol, failed, err)
        for j in batch:
            self._decide(j, err, failed)

    def _decide(self, j: int, batch_error: float, failed: dict[int, float]) -> None:
        """Site ``j`` is certified, demoted (with ``demote``) or dropped, by its error in ``failed``."""
        s = self.sites[j]
        bn = s.action.exactness == "approximate"
        note = "approximate BatchNorm input site, exact with eps * c^2" if bn else ""
        if j not in failed:
            # the error of the whole batch when it passed (<= rtol), else 0 (passed within a sub-batch)
            self.entries[j] = CertificationEntry(s.name, "certified", batch_error if batch_error <= self.tol else 0.0, note)
            self.keep[j] = s
        elif self.demote and not bn and math.isfinite(failed[j]):
            self.entries[j] = CertificationEntry(s.name, "demoted", failed[j], "output changes: demoted to approximate")
            self.keep[j] = _demoted(s, failed[j])
        else:
            why = "fails with eps * c^2" if bn else "output changes under a random element"
            self.entries[j] = CertificationEntry(s.name, "dropped", failed[j], why)

    def result(self) -> tuple[list[Site], list[CertificationEntry]]:
        """The surviving sites and one entry per site, in the sites' order; the checker's model restored.

        A mode the model could not run in is named in every entry's reason.
        """
        self.checker.restore()
        entries = self.entries
        if self.checker.skipped_modes:
            note = "; ".join(f"{m} mode not checked ({why})" for m, why in self.checker.skipped_modes.items())
            entries = {
                i: CertificationEntry(e.site, e.status, e.error, f"{e.reason}; {note}" if e.reason else note) for i, e in entries.items()
            }
        return [self.keep[i] for i in sorted(self.keep)], [entries[i] for i in sorted(entries)]


@torch.no_grad()
def _perturb_(model: nn.Module, gen: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    saved: list[tuple[Tensor, Tensor]] = []
    for p in model.parameters():
        if not p.requires_grad or not p.is_floating_point() or p.numel() == 0:
            continue
        lo, hi = torch.aminmax(p.detach().reshape(-1))
        if float(lo) == float(hi):  # constant (zero biases, norm weights of one, LayerScale 1e-6, zero heads)
            sigma = 0.5 * max(abs(float(lo)), 1.0)
        elif p.ndim >= 2:  # a non-constant matrix is generic already
            continue
        else:
            sigma = 0.1 * float(p.detach().pow(2).mean().sqrt())
        saved.append((p, p.detach().clone()))
        p.add_(sigma * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device=p.device, dtype=p.dtype))
    return saved


def _nothing() -> None:
    """The undo of an item whose apply is undone by restoring the parameters."""


def _demoted(site: Site, err: float) -> Site:
    action = copy.copy(site.action)
    action.exactness = "approximate"
    return Site(action, site.members, site.name, site.data_input, {**site.info, "certified_error": err})


def _batchnorm_item(checker: _Checker, site: Site, gen: torch.Generator) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Apply one scale c (1/4 or 4) to the site and multiply the eps of its BatchNorms by c^2 (undo restores eps)."""
    model = checker.model
    c = 4.0 if float(torch.rand((), generator=gen)) < 0.5 else 0.25
    n = site.action.group(site.tensors(model)).dim
    g = torch.full((n,), c, dtype=torch.float64)
    mods = [model.get_submodule(p) for p in site.info["batchnorm"]]
    eps = [float(getattr(m, "eps")) for m in mods]  # noqa: B009 - BatchNorm's eps is a float attribute

    def do() -> None:
        checker.apply(site, g)
        for m, e in zip(mods, eps):
            setattr(m, "eps", e * c**2)  # noqa: B010

    def undo() -> None:
        for m, e in zip(mods, eps):
            setattr(m, "eps", e)  # noqa: B010

    return do, undo
