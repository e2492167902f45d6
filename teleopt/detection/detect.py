"""``find_symmetries``: the symmetry sites of any ``nn.Module`` or timm model.

Pipeline: trace ``forward`` with torch.fx in train and eval mode and record the
shape of every value on the example inputs (``tracing``); let each op's rule tie,
block or reshape the axes it touches, for each group kind (``rules``, a table by
op family that ``register_op_rule`` extends;
``relations``, ``axes``); find the per-head structure of attention (``attention``);
settle the pending constraints and turn every free class into an ``AxisAction``
bound by tensor names (``sites``).  Papers: the groups are those of Zhao 2026
Table 1.1 and Sec. 1.2; teleportation (Zhao 2026, Ch. 4) acts through the sites.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from torch import Tensor, nn

from teleopt.detection.attention import find_attention_sites
from teleopt.detection.axes import KINDS
from teleopt.detection.certify import CertificationEntry, certify_sites
from teleopt.detection.children import Call, call_module, is_cache, record_calls, renamed, shared_tensor_names, under
from teleopt.detection.ops import custom_module_types
from teleopt.detection.overlap import merge_overlapping
from teleopt.detection.relations import ModelTensors, Relations
from teleopt.detection.report import SkippedEntry, SymmetryReport
from teleopt.detection.residual import ResidualStream, find_residual_sites
from teleopt.detection.rules import run_rules
from teleopt.detection.sites import blocked_reasons, class_sites, direct_sites, module_order, settle, softmax_translation_sites
from teleopt.detection.tracing import DetectionError, trace_model
from teleopt.functional import check_has_rows
from teleopt.integrations.peft import LoRASites, lora_sites
from teleopt.site import Site
from teleopt.unwrap import unwrap as unwrap_model

__all__ = ["find_symmetries", "unwrap_model"]

_LOSSES = ("none", "cross_entropy")


def find_symmetries(  # noqa: PLR0913  public: the model, its example call, and seven documented keyword-only options
    model: nn.Module,
    example_inputs: Tensor | Sequence[Tensor] | None = None,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    loss: Literal["none", "cross_entropy"] = "none",
    include_discrete: bool = True,
    include_approximate: bool = True,
    include_frozen: bool = False,
    certify: bool = True,
    certify_seed: int = 0,
) -> SymmetryReport:
    """Find every place where a group action leaves the model's output unchanged (Zhao 2026, Table 1.1).

    Parameters
    ----------
    model:
        Any ``nn.Module`` whose ``forward`` torch.fx can trace (timm models can);
        submodules that cannot be traced are kept opaque and frozen.  If the root's
        own ``forward`` cannot be traced (transformers models), each submodule it
        calls once is analysed on its own with the arguments it was called with.
        peft LoRA adapters are found by their module structure
        (:func:`teleopt.integrations.peft.lora_sites`) and certified with the rest.
        ``DistributedDataParallel``/``DataParallel`` and ``torch.compile`` wrappers
        are unwrapped; site names are relative to the unwrapped module.
    example_inputs:
        One tensor or a tuple of positional inputs, with the shapes used in training
        (small images are fine; a batch of one works, detection runs in eval mode).
        The model runs on them in eval mode (buffers, RNG state and the train/eval
        flags are restored).  May be left out when ``example_kwargs`` supplies the inputs.
    example_kwargs:
        Keyword arguments of the call, as in training: ``model(*example_inputs,
        **example_kwargs)`` (``input_ids``/``attention_mask`` of a transformers model,
        ``smooth=True``).  Tensors are traced as inputs; other values are constants of
        the trace, so a flag that changes the computed path is seen.
    loss:
        ``"cross_entropy"`` adds the softmax translation of a final linear classifier
        (Zhao 2026, Ex. 1.2.8), which leaves the loss, not the logits, unchanged.
    include_discrete:
        Report permutation sites (Zhao 2026, Ex. 1.2.9, 1.2.12) as well.
    include_approximate:
        Report the eps-approximate scaling of BatchNorm inputs (Zhao 2026, Ex. 1.2.7).
    include_frozen:
        Let sites move parameters with ``requires_grad=False`` (default: they are fixed).
    certify:
        Check every site before reporting it (default; ``teleopt.detection.certify``):
        each exact site is applied with a random element at the edge of the range to a
        float64 copy of the model, and the outputs on the example inputs and keyword
        arguments must stay within ``default_rtol(float64)`` in eval and train mode (same
        dropout masks); eps-approximate BatchNorm input sites are checked with eps * c^2.
        A site that fails is dropped and listed in ``report.certification`` with its error.
        ``False`` reports what the rules propose, unchecked (faster, not safe).
    certify_seed:
        Seed of the random elements and of the forward RNG of the certification.

    Returns
    -------
    SymmetryReport
        Sites bound by qualified ``state_dict`` names (each an ``AxisAction``, or the
        registered softmax translation), skipped ops with reasons, and the coverage.

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module`` or the inputs are not tensors.
    ValueError
        (``teleopt.detection.DetectionError``) ``forward`` cannot be traced, or the
        example inputs do not fit the model, or have a tensor with no rows (a check on
        empty outputs would pass anything); ``loss`` is unknown.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = unwrap_model(model)
    inputs, kwargs = _example_call(example_inputs, example_kwargs)
    if loss not in _LOSSES:
        raise ValueError(f"loss must be one of {_LOSSES}, got {loss!r}")
    options = _Options(loss, include_discrete, include_approximate, include_frozen, certify, certify_seed)
    flags = [(m, m.training) for m in model.modules()]
    lora = lora_sites(model, include_frozen=include_frozen)  # peft layers are not traceable: found by structure
    stream = find_residual_sites(model, inputs, kwargs, include_frozen=include_frozen)  # a dynamic trace of the root
    try:
        return _find(model, inputs, kwargs, options, lora, stream)
    finally:
        for m, flag in flags:
            m.training = flag


@dataclass(frozen=True)
class _Options:
    """The options of one :func:`find_symmetries` call (the submodules of the children fallback get their own)."""

    loss: str
    include_discrete: bool
    include_approximate: bool
    include_frozen: bool
    certify: bool
    certify_seed: int


def _example_call(example_inputs: Any, example_kwargs: Any) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
    """The example call as positional tensors and keyword arguments; ``TypeError``/``ValueError`` naming what is wrong."""
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(f"example_kwargs must be a mapping of keyword arguments, got {type(example_kwargs).__name__}")
    kwargs = dict(example_kwargs or {})
    if not all(isinstance(k, str) for k in kwargs):
        raise TypeError("example_kwargs must have string keys")
    if example_inputs is None:
        inputs: tuple[Tensor, ...] = ()
    elif isinstance(example_inputs, Tensor):
        inputs = (example_inputs,)
    elif isinstance(example_inputs, Sequence) and not isinstance(example_inputs, str):
        inputs = tuple(example_inputs)
    else:
        raise TypeError(f"example_inputs must be a tensor or a sequence of tensors, got {type(example_inputs).__name__}")
    if not all(isinstance(t, Tensor) for t in inputs):
        raise TypeError("example_inputs must contain only tensors")
    if not inputs and not any(isinstance(v, Tensor) for v in kwargs.values()):
        raise TypeError("example_inputs must contain at least one tensor (or example_kwargs a tensor input)")
    check_has_rows(inputs, None, "example_inputs")
    check_has_rows((), kwargs, "example_kwargs")
    return inputs, kwargs


def _find(
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    kwargs: dict[str, Any],
    options: _Options,
    lora: LoRASites | None = None,
    stream: ResidualStream | None = None,
) -> SymmetryReport:
    """Detection on an unwrapped model in eval mode: trace, rules, attention heads, sites, certification, report.

    A root whose ``forward`` cannot be traced is analysed submodule by submodule
    (:func:`_find_children`); ``lora`` and ``stream`` are the sites found by structure and
    by the residual stream's own trace.
    """
    start = time.perf_counter()
    model.eval()
    lora = LoRASites() if lora is None else lora
    stream = ResidualStream() if stream is None else stream
    try:
        graphs, opaque = trace_model(model, inputs, kwargs, custom_module_types())
    except DetectionError as e:
        if not str(e).startswith("could not trace") or not any(True for _ in model.children()) or isinstance(model, Call):
            raise
        report = _find_children(model, inputs, kwargs, options, str(e))
        sites = _name(_dedupe(lora.sites + report.sites + stream.sites), module_order(model))  # a LoRA pair keeps its name
        report.sites, merged = merge_overlapping(model, sites)
        report.skipped += [SkippedEntry("site", where, f"LoRA adapter {reason}") for where, reason in lora.skipped]
        report.skipped += [SkippedEntry(*entry) for entry in stream.skipped]
        report.skipped += [SkippedEntry(*note) for note in merged]
        return _certified(model, report, inputs, kwargs, options, start)
    rel = Relations(ModelTensors.of(model, options.include_frozen))
    run_rules(model, rel, graphs)
    skipped = [SkippedEntry("module", w.split(":")[0], f"could not be traced ({w.split(': ', 1)[1]}); kept opaque") for w in opaque]
    for gi, traced in enumerate(graphs):
        found, notes = find_attention_sites(traced, gi, rel)
        rel.direct_sites.extend(found)
        skipped += [SkippedEntry(*n) for n in notes if SkippedEntry(*n) not in skipped]
    settle(rel)
    sites, notes = _proposed_sites(model, rel, graphs, options, lora, stream)
    certification: list[CertificationEntry] = []
    certify_seconds = 0.0
    if options.certify and sites:
        t0 = time.perf_counter()
        sites, certification = _certify(model, sites, inputs, kwargs, options.certify_seed, _certify_modes(graphs, opaque))
        certify_seconds = time.perf_counter() - t0
        for checked in certification:
            if checked.status == "dropped":
                skipped.append(SkippedEntry("site", checked.site, f"failed certification: relative output error {checked.error:.2e}"))
    lora_notes = [("site", where, f"LoRA adapter {reason}") for where, reason in lora.skipped]
    for kind, where, reason in [*rel.skipped, *notes, *lora_notes, *stream.skipped]:
        entry = SkippedEntry(kind, where, reason)
        if entry not in skipped:
            skipped.append(entry)
    for target, count in _shared_modules(graphs).items():
        skipped.append(SkippedEntry("module", target, f"called {count} times: its parameters are tied across calls"))
    covered, coverage = _coverage_fields(model, sites)
    frozen = {
        name: ("frozen (requires_grad=False)" if name in rel.tensors.frozen else blocked_reasons(rel, name))
        for name, p in model.named_parameters()
        if not covered.get(name, False)
    }
    return SymmetryReport(
        sites=sites,
        skipped=skipped,
        frozen=frozen,
        model=type(model).__name__,
        seconds=time.perf_counter() - start,
        certification=certification,
        certify_seconds=certify_seconds,
        certified=options.certify,
        **coverage,
    )


def _proposed_sites(
    model: nn.Module, rel: Relations, graphs: list, options: _Options, lora: LoRASites, stream: ResidualStream
) -> tuple[list[Site], list[tuple[str, str, str]]]:
    """The sites the settled relations propose, with the LoRA and residual-stream sites, one per symmetry and
    named; and the notes on what was not made a site."""
    order = module_order(model)
    kinds = KINDS if options.include_discrete else ("general", "diagonal")
    generic, notes = class_sites(rel, order, kinds)
    attention, notes2 = direct_sites(rel, len(graphs))
    sites = lora.sites + attention + generic + stream.sites  # first of equal sites is kept: a LoRA pair keeps its name
    if options.loss == "cross_entropy":
        translation, notes3 = softmax_translation_sites(graphs, rel)
        sites += translation
        notes2 += notes3
    if not options.include_discrete:
        sites = [s for s in sites if s.action.continuous]
    if not options.include_approximate:
        sites = [s for s in sites if s.action.exactness != "approximate"]
    sites, merged = merge_overlapping(model, _name(_dedupe(sites), order))  # one site per symmetry
    return sites, notes + notes2 + merged


def _certify(
    model: nn.Module, sites: list[Site], inputs: tuple[Tensor, ...], kwargs: dict[str, Any], seed: int, modes: tuple[str, ...]
) -> tuple[list[Site], list[CertificationEntry]]:
    """:func:`certify_sites`; a model that does not run as called is a ``DetectionError`` rather than unchecked sites."""
    try:
        return certify_sites(model, sites, inputs, kwargs, seed=seed, modes=modes)
    except DetectionError:
        raise
    except Exception as e:
        raise DetectionError(f"certification could not run {type(model).__name__} on the example inputs: {type(e).__name__}: {e}") from None


def _coverage_fields(model: nn.Module, sites: list[Site]) -> tuple[dict[str, int], dict[str, Any]]:
    """Entries covered per parameter (:func:`_coverage`), and a report's ``coverage``, ``coverage_exact`` and ``parameters``."""
    covered, total = _coverage(model, sites)
    covered_exact, _ = _coverage(model, [s for s in sites if s.action.exactness == "exact"])
    return covered, {
        "coverage": sum(covered.values()) / total if total else 0.0,
        "coverage_exact": sum(covered_exact.values()) / total if total else 0.0,
        "parameters": total,
    }


def _certified(
    model: nn.Module, report: SymmetryReport, inputs: tuple[Tensor, ...], kwargs: dict[str, Any], options: _Options, start: float
) -> SymmetryReport:
    """Certify a report assembled from parts (the children fallback) and recompute its coverage."""
    if options.certify and report.sites:
        t0 = time.perf_counter()
        try:
            report.sites, report.certification = certify_sites(
                model, report.sites, inputs, kwargs, seed=options.certify_seed, modes=("eval", "train")
            )
        except Exception as e:  # noqa: BLE001
            raise DetectionError(
                f"certification could not run {type(model).__name__} on the example inputs: {type(e).__name__}: {e}"
            ) from None
        report.certify_seconds = time.perf_counter() - t0
        for entry in report.dropped:
            report.skipped.append(SkippedEntry("site", entry.site, f"failed certification: relative output error {entry.error:.2e}"))
    report.certified = options.certify
    covered, coverage = _coverage_fields(model, report.sites)
    report.coverage, report.coverage_exact, report.parameters = coverage["coverage"], coverage["coverage_exact"], coverage["parameters"]
    report.frozen = {n: report.frozen.get(n, "no site acts on it") for n, _ in model.named_parameters() if not covered.get(n, 0)}
    report.seconds = time.perf_counter() - start
    return report


def _find_children(model: nn.Module, inputs: tuple[Tensor, ...], kwargs: dict[str, Any], options: _Options, why: str) -> SymmetryReport:
    """Fallback when the root ``forward`` cannot be traced (transformers models): analyse the called submodules.

    The model runs once with hooks that record each submodule's arguments; every
    submodule called exactly once is traced on its own with those arguments (tensors
    as inputs, everything else constant), recursing into submodules that cannot be
    traced either.  A submodule's inputs and outputs are then fixed streams, so its
    sites leave its output, hence the model's, unchanged; sites on tensors that are
    shared with other parts are dropped, and certification checks the rest on the
    whole model.
    """
    children = _Children(record_calls(model, inputs, kwargs), replace(options, loss="none", certify=False, certify_seed=0))
    children.skipped.append(
        SkippedEntry(
            "module", "", f"the root forward could not be traced ({why.split(chr(10))[0][:200]}); its submodules were analysed one by one"
        )
    )
    children.visit(model, "")
    sites, skipped = children.sites, children.skipped
    shared = shared_tensor_names(model)
    kept = [s for s in sites if not shared & set(s.tensor_names)]
    for s in sites:
        if s not in kept:
            skipped.append(SkippedEntry("site", s.name, "acts on a tensor shared with another part of the model"))
    if options.loss == "cross_entropy":
        skipped.append(SkippedEntry("site", "softmax_translation", "the root forward could not be traced"))
    return SymmetryReport(
        sites=_name(_dedupe(kept), module_order(model)), skipped=skipped, frozen=children.frozen, model=type(model).__name__
    )


class _Children:
    """The submodules of an untraceable root, analysed one by one: their sites, skipped entries and frozen tensors.

    ``calls`` holds the arguments each submodule was called with (:func:`~teleopt.detection.children.record_calls`);
    ``options`` are those of each submodule's own detection (no loss, not certified).
    """

    def __init__(self, calls: dict[str, list[tuple[tuple, dict]]], options: _Options) -> None:
        self.calls = calls
        self.options = options
        self.sites: list[Site] = []
        self.skipped: list[SkippedEntry] = []
        self.frozen: dict[str, str] = {}

    def visit(self, module: nn.Module, path: str) -> None:
        """Analyse each child of ``module`` called exactly once; recurse into those never called."""
        for name, child in module.named_children():
            full = f"{path}{name}"
            record = self.calls.get(full)
            if not record:
                self.visit(child, full + ".")
            elif len(record) > 1:
                self.skipped.append(SkippedEntry("module", full, f"called {len(record)} times: not analysed on its own"))
            else:
                call = self._call(child, full, record[0])
                if call is not None:
                    self._analyse(child, full, call)

    def _call(self, child: nn.Module, full: str, record: tuple[tuple, dict]) -> dict[str, Any] | None:
        """The recorded call of ``child`` as keyword arguments of its ``forward`` (a cache left out); ``None``
        (and a skipped entry) if they cannot be bound or a ``*args`` is used."""
        args, kw = record
        signature = inspect.signature(child.forward)
        try:
            bound = signature.bind(*args, **kw)
        except TypeError as e:
            self.skipped.append(SkippedEntry("module", full, f"its arguments could not be bound ({e})"))
            return None
        call: dict[str, Any] = {}
        ok = True
        for pname, value in bound.arguments.items():
            param = signature.parameters[pname]
            if param.kind == param.VAR_KEYWORD:
                call.update(value)
            elif param.kind == param.VAR_POSITIONAL:
                ok = ok and not value
            else:
                call[pname] = None if is_cache(value) else value
        if not ok:
            self.skipped.append(SkippedEntry("module", full, "called with *args: not analysed on its own"))
            return None
        return call

    def _analyse(self, child: nn.Module, full: str, call: dict[str, Any]) -> None:
        """Detection on ``child`` called as recorded, its names made the model's; recurse if it cannot be traced."""
        wrapper = call_module(child, call)
        try:
            sub = _find(wrapper, wrapper.tensors(), {}, self.options)
        except DetectionError as e:
            if str(e).startswith("could not trace") and any(True for _ in child.children()):
                self.visit(child, full + ".")
            else:
                self.skipped.append(SkippedEntry("module", full, f"could not be analysed ({str(e)[:200]})"))
            return
        if any(e.kind == "module" and e.where == "m" for e in sub.skipped):  # the child itself is untraceable
            self.visit(child, full + ".")
            return
        self.sites.extend(renamed(site, full) for site in sub.sites)
        self.skipped.extend(SkippedEntry(e.kind, under(e.where, full), e.reason) for e in sub.skipped)
        self.frozen.update({under(n, full): reason for n, reason in sub.frozen.items()})


def _certify_modes(graphs, opaque) -> tuple[str, ...]:
    """Train mode is checked unless the traced forward is the same in both modes and no leaf module depends on the mode."""
    from teleopt.detection.certify import mode_dependent

    if len(graphs) != 1 or opaque:
        return ("eval", "train")
    traced = graphs[0]
    for node in traced.graph.nodes:
        if node.op == "call_module" and mode_dependent(traced.modules[str(node.target)]):
            return ("eval", "train")
    return ("eval",)


def _signature(site: Site) -> frozenset:
    from teleopt.actions.axis import AxisAction

    if not isinstance(site.action, AxisAction):
        return frozenset({(site.action.name, *site.tensor_names)})
    return frozenset((m.tensor_key, m.axis, m.start, m.stop, m.outer, m.inner, m.groups) for m in site.action.members)


def _dedupe(sites: list[Site]) -> list[Site]:
    """A GL site subsumes scaling and permutation sites on the same members; drop exact duplicates."""
    gl = {_signature(s) for s in sites if getattr(s.action, "group_kind", None) == "general"}
    out, seen = [], set()
    for s in sites:
        sig = (getattr(s.action, "group_kind", s.action.name), _signature(s))
        if sig in seen:
            continue
        if getattr(s.action, "group_kind", None) in ("diagonal", "permutation") and _signature(s) in gl:
            continue
        seen.add(sig)
        out.append(s)
    return out


def _name(sites: list[Site], order: dict[str, int]) -> list[Site]:
    def first(site: Site) -> int:
        return min((order.get(n, 1 << 30) for n in site.tensor_names), default=1 << 30)

    sites = sorted(sites, key=lambda s: (first(s), s.action.name))
    used: dict[str, int] = {}
    for s in sites:
        anchor = s.info.get("module") or _anchor(s)
        if isinstance(s.info.get("adapter"), str):  # one LoRA layer holds a pair per adapter
            anchor = f"{anchor}[{s.info['adapter']}]"
        base = f"{s.action.name}@{anchor}"
        used[base] = used.get(base, 0) + 1
        s.name = base if used[base] == 1 else f"{base}#{used[base]}"
    return sites


def _anchor(site: Site) -> str:
    members = getattr(site.action, "members", None)
    name = site.tensor_names[0]
    if members is not None:
        writers = [m.tensor_key for m in members if m.power > 0]
        if writers:
            name = writers[0]
    return name.rsplit(".", 1)[0] if "." in name else name


def _coverage(model: nn.Module, sites: list[Site]) -> tuple[dict[str, int], int]:
    """Entries of each parameter acted on by a continuous site (shared tensors counted once).

    A member acts on a slab (a range of one axis); the entries outside every slab of a
    tensor form a product set, so the count is exact without materialising masks.
    """
    from teleopt.actions.axis import Member

    params = dict(model.named_parameters())
    slabs: dict[str, dict[int, set[int]]] = {}
    full: set[str] = set()
    for s in sites:
        if not s.action.continuous:
            continue
        members = getattr(s.action, "members", None)  # axis-wise actions (the residual rotation's too)
        if not members or not all(isinstance(m, Member) for m in members):
            members = [None] * len(s.members)
        for m, name in zip(members, s.members):
            if name not in params or (m is not None and m.power == 0):  # read, not moved (a norm's gain)
                continue
            if m is None or m.start is None or m.stop is None or m.groups > 1:
                full.add(name)
            else:
                axis = m.axis % params[name].ndim
                slabs.setdefault(name, {}).setdefault(axis, set()).update(range(m.start, m.stop))
    covered: dict[str, int] = {}
    for name, p in params.items():
        if name in full:
            covered[name] = p.numel()
        elif name in slabs:
            outside = 1
            for axis, n in enumerate(p.shape):
                outside *= n - len(slabs[name].get(axis, ()))
            covered[name] = p.numel() - outside
        else:
            covered[name] = 0
    return covered, sum(p.numel() for p in params.values())


def _shared_modules(graphs) -> dict[str, int]:
    counts: dict[str, int] = {}
    traced = graphs[0]
    for node in traced.graph.nodes:
        if node.op == "call_module":
            counts[str(node.target)] = counts.get(str(node.target), 0) + 1
    return {k: v for k, v in counts.items() if v > 1}
