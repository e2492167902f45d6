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

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch import Tensor, nn

from teleopt.detection.attention import find_attention_sites
from teleopt.detection.axes import KINDS
from teleopt.detection.certify import CertificationEntry, certify_sites
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


def find_symmetries(
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
    if loss not in _LOSSES:
        raise ValueError(f"loss must be one of {_LOSSES}, got {loss!r}")
    flags = [(m, m.training) for m in model.modules()]
    lora = lora_sites(model, include_frozen=include_frozen)  # peft layers are not traceable: found by structure
    stream = find_residual_sites(model, inputs, kwargs, include_frozen=include_frozen)  # a dynamic trace of the root
    try:
        return _find(
            model, inputs, kwargs, loss, include_discrete, include_approximate, include_frozen, certify, certify_seed, lora, stream
        )
    finally:
        for m, flag in flags:
            m.training = flag


def _find(
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    kwargs: dict[str, Any],
    loss: str,
    include_discrete: bool,
    include_approximate: bool,
    include_frozen: bool,
    certify: bool,
    certify_seed: int,
    lora: LoRASites | None = None,
    stream: ResidualStream | None = None,
) -> SymmetryReport:
    start = time.perf_counter()
    model.eval()
    lora = LoRASites() if lora is None else lora
    stream = ResidualStream() if stream is None else stream
    try:
        graphs, opaque = trace_model(model, inputs, kwargs, custom_module_types())
    except DetectionError as e:
        if not str(e).startswith("could not trace") or not any(True for _ in model.children()) or isinstance(model, _Call):
            raise
        report = _find_children(model, inputs, kwargs, loss, include_discrete, include_approximate, include_frozen, str(e))
        sites = _name(_dedupe(lora.sites + report.sites + stream.sites), module_order(model))  # a LoRA pair keeps its name
        report.sites, merged = merge_overlapping(model, sites)
        report.skipped += [SkippedEntry("site", where, f"LoRA adapter {reason}") for where, reason in lora.skipped]
        report.skipped += [SkippedEntry(*entry) for entry in stream.skipped]
        report.skipped += [SkippedEntry(*note) for note in merged]
        return _certified(model, report, inputs, kwargs, certify, certify_seed, ("eval", "train"), start)
    rel = Relations(ModelTensors.of(model, include_frozen))
    run_rules(model, rel, graphs)
    skipped = [SkippedEntry("module", w.split(":")[0], f"could not be traced ({w.split(': ', 1)[1]}); kept opaque") for w in opaque]
    for gi, traced in enumerate(graphs):
        found, notes = find_attention_sites(traced, gi, rel)
        rel.direct_sites.extend(found)
        skipped += [SkippedEntry(*n) for n in notes if SkippedEntry(*n) not in skipped]
    settle(rel)
    order = module_order(model)
    kinds = KINDS if include_discrete else ("general", "diagonal")
    generic, notes = class_sites(rel, order, kinds)
    attention, notes2 = direct_sites(rel, len(graphs))
    sites = lora.sites + attention + generic + stream.sites  # first of equal sites is kept: a LoRA pair keeps its name
    if loss == "cross_entropy":
        translation, notes3 = softmax_translation_sites(graphs, rel)
        sites += translation
        notes2 += notes3
    if not include_discrete:
        sites = [s for s in sites if s.action.continuous]
    if not include_approximate:
        sites = [s for s in sites if s.action.exactness != "approximate"]
    sites, merged = merge_overlapping(model, _name(_dedupe(sites), order))  # one site per symmetry
    notes2 += merged
    certification: list[CertificationEntry] = []
    certify_seconds = 0.0
    if certify and sites:
        t0 = time.perf_counter()
        try:
            sites, certification = certify_sites(model, sites, inputs, kwargs, seed=certify_seed, modes=_certify_modes(graphs, opaque))
        except DetectionError:
            raise
        except Exception as e:  # the model does not run as called: say so rather than report unchecked sites
            raise DetectionError(
                f"certification could not run {type(model).__name__} on the example inputs: {type(e).__name__}: {e}"
            ) from None
        certify_seconds = time.perf_counter() - t0
        for checked in certification:
            if checked.status == "dropped":
                skipped.append(SkippedEntry("site", checked.site, f"failed certification: relative output error {checked.error:.2e}"))
    lora_notes = [("site", where, f"LoRA adapter {reason}") for where, reason in lora.skipped]
    for kind, where, reason in [*rel.skipped, *notes, *notes2, *lora_notes, *stream.skipped]:
        entry = SkippedEntry(kind, where, reason)
        if entry not in skipped:
            skipped.append(entry)
    for target, count in _shared_modules(graphs).items():
        skipped.append(SkippedEntry("module", target, f"called {count} times: its parameters are tied across calls"))
    covered, total = _coverage(model, sites)
    covered_exact, _ = _coverage(model, [s for s in sites if s.action.exactness == "exact"])
    frozen = {
        name: ("frozen (requires_grad=False)" if name in rel.tensors.frozen else blocked_reasons(rel, name))
        for name, p in model.named_parameters()
        if not covered.get(name, False)
    }
    return SymmetryReport(
        sites=sites,
        skipped=skipped,
        frozen=frozen,
        coverage=sum(covered.values()) / total if total else 0.0,
        coverage_exact=sum(covered_exact.values()) / total if total else 0.0,
        parameters=total,
        model=type(model).__name__,
        seconds=time.perf_counter() - start,
        certification=certification,
        certify_seconds=certify_seconds,
        certified=certify,
    )


def _certified(model, report, inputs, kwargs, certify, seed, modes, start) -> SymmetryReport:
    """Certify a report assembled from parts (the children fallback) and recompute its coverage."""
    if certify and report.sites:
        t0 = time.perf_counter()
        try:
            report.sites, report.certification = certify_sites(model, report.sites, inputs, kwargs, seed=seed, modes=modes)
        except Exception as e:  # noqa: BLE001
            raise DetectionError(
                f"certification could not run {type(model).__name__} on the example inputs: {type(e).__name__}: {e}"
            ) from None
        report.certify_seconds = time.perf_counter() - t0
        for entry in report.dropped:
            report.skipped.append(SkippedEntry("site", entry.site, f"failed certification: relative output error {entry.error:.2e}"))
    report.certified = certify
    covered, total = _coverage(model, report.sites)
    covered_exact, _ = _coverage(model, [s for s in report.sites if s.action.exactness == "exact"])
    report.coverage = sum(covered.values()) / total if total else 0.0
    report.coverage_exact = sum(covered_exact.values()) / total if total else 0.0
    report.parameters = total
    report.frozen = {n: report.frozen.get(n, "no site acts on it") for n, _ in model.named_parameters() if not covered.get(n, 0)}
    report.seconds = time.perf_counter() - start
    return report


class _Call(nn.Module):
    """Calls ``module`` with recorded keyword arguments whose tensors are this wrapper's positional inputs."""

    def __init__(self, module: nn.Module, call: dict[str, Any]) -> None:
        from torch.utils._pytree import tree_flatten

        super().__init__()
        self.m = module
        self._leaves, self._spec = tree_flatten(call)
        self._slots = [i for i, v in enumerate(self._leaves) if isinstance(v, Tensor)]

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(self._leaves[i] for i in self._slots)

    def call(self, tensors: tuple) -> Any:
        from torch.utils._pytree import tree_unflatten

        leaves = list(self._leaves)
        for i, t in zip(self._slots, tensors):
            leaves[i] = t
        return self.m(**tree_unflatten(leaves, self._spec))


def _call_module(module: nn.Module, call: dict[str, Any]) -> _Call:
    """A ``_Call`` whose ``forward`` takes one named positional input per tensor (fx cannot trace ``*args``)."""
    wrapper = _Call(module, call)
    names = [f"t{i}" for i in range(len(wrapper._slots))]
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {', '.join(names)}):\n    return self.call(({''.join(n + ', ' for n in names)}))", namespace)  # noqa: S102
    wrapper.__class__ = type("_Call", (_Call,), {"forward": namespace["forward"]})
    return wrapper


def _record_calls(model: nn.Module, inputs, kwargs) -> dict[str, list[tuple[tuple, dict]]]:
    """The arguments every descendant module is called with, when the model runs once in eval mode."""
    import torch

    calls: dict[str, list[tuple[tuple, dict]]] = {}
    hooks = []
    for name, m in model.named_modules():
        if name:
            hooks.append(
                m.register_forward_pre_hook(lambda mod, a, k, name=name: calls.setdefault(name, []).append((a, dict(k))), with_kwargs=True)
            )
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*inputs, **kwargs)
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
    return calls


def _under(name: str, path: str) -> str:
    """A name inside a ``_Call`` wrapper ("m", "m.<rest>") as a name inside the model (``path``, "<path>.<rest>")."""
    if name == "m":
        return path
    return path + name[1:] if name.startswith("m.") else name


def _renamed(site: Site, path: str) -> Site:
    from teleopt.actions.axis import AxisAction

    info = dict(site.info)
    if isinstance(info.get("module"), str):
        info["module"] = _under(info["module"], path)
    if isinstance(info.get("batchnorm"), list):
        info["batchnorm"] = [_under(p, path) for p in info["batchnorm"]]
    action = site.action
    if isinstance(action, AxisAction):  # member roles carry the wrapper's tensor names (they name the site)
        cfg = action.config()
        for m in cfg["members"]:
            m["name"] = _under(m["name"], path)
            if m.get("tensor"):
                m["tensor"] = _under(m["tensor"], path)
        if isinstance(cfg.get("reference"), str):
            cfg["reference"] = _under(cfg["reference"], path)
        action = AxisAction.from_config(cfg)
    return Site(action, tuple(None if m is None else _under(m, path) for m in site.members), "", site.data_input, info)


def _find_children(model, inputs, kwargs, loss, include_discrete, include_approximate, include_frozen, why) -> SymmetryReport:
    """Fallback when the root ``forward`` cannot be traced (transformers models): analyse the called submodules.

    The model runs once with hooks that record each submodule's arguments; every
    submodule called exactly once is traced on its own with those arguments (tensors
    as inputs, everything else constant), recursing into submodules that cannot be
    traced either.  A submodule's inputs and outputs are then fixed streams, so its
    sites leave its output, hence the model's, unchanged; sites on tensors that are
    shared with other parts are dropped, and certification checks the rest on the
    whole model.
    """
    import inspect

    calls = _record_calls(model, inputs, kwargs)
    sites: list[Site] = []
    skipped = [
        SkippedEntry(
            "module", "", f"the root forward could not be traced ({why.split(chr(10))[0][:200]}); its submodules were analysed one by one"
        )
    ]
    frozen: dict[str, str] = {}

    def visit(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            full = f"{path}{name}"
            record = calls.get(full)
            if not record:
                visit(child, full + ".")
                continue
            if len(record) > 1:
                skipped.append(SkippedEntry("module", full, f"called {len(record)} times: not analysed on its own"))
                continue
            args, kw = record[0]
            try:
                bound = inspect.signature(child.forward).bind(*args, **kw)
            except TypeError as e:
                skipped.append(SkippedEntry("module", full, f"its arguments could not be bound ({e})"))
                continue
            call: dict[str, Any] = {}
            ok = True
            for pname, value in bound.arguments.items():
                param = inspect.signature(child.forward).parameters[pname]
                if param.kind == param.VAR_KEYWORD:
                    call.update(value)
                elif param.kind == param.VAR_POSITIONAL:
                    ok = ok and not value
                else:
                    call[pname] = None if _is_cache(value) else value
            if not ok:
                skipped.append(SkippedEntry("module", full, "called with *args: not analysed on its own"))
                continue
            wrapper = _call_module(child, call)
            try:
                sub = _find(wrapper, wrapper.tensors(), {}, "none", include_discrete, include_approximate, include_frozen, False, 0)
            except DetectionError as e:
                if str(e).startswith("could not trace") and any(True for _ in child.children()):
                    visit(child, full + ".")
                else:
                    skipped.append(SkippedEntry("module", full, f"could not be analysed ({str(e)[:200]})"))
                continue
            if any(e.kind == "module" and e.where == "m" for e in sub.skipped):  # the child itself is untraceable
                visit(child, full + ".")
                continue
            sites.extend(_renamed(site, full) for site in sub.sites)
            skipped.extend(SkippedEntry(e.kind, _under(e.where, full), e.reason) for e in sub.skipped)
            frozen.update({_under(n, full): reason for n, reason in sub.frozen.items()})

    visit(model, "")
    shared = _shared_tensor_names(model)
    kept = [s for s in sites if not shared & set(s.tensor_names)]
    for s in sites:
        if s not in kept:
            skipped.append(SkippedEntry("site", s.name, "acts on a tensor shared with another part of the model"))
    if loss == "cross_entropy":
        skipped.append(SkippedEntry("site", "softmax_translation", "the root forward could not be traced"))
    return SymmetryReport(sites=_name(_dedupe(kept), module_order(model)), skipped=skipped, frozen=frozen, model=type(model).__name__)


def _is_cache(value: Any) -> bool:
    """A transformers key/value cache: stateful (each call appends to it), so a submodule is analysed without it."""
    return any(c.__name__.endswith("Cache") and c.__module__.startswith("transformers") for c in type(value).__mro__)


def _shared_tensor_names(model: nn.Module) -> set[str]:
    """Qualified names of parameters/buffers reachable under more than one name (tied weights)."""
    seen: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        seen.setdefault(id(t), []).append(name)
    return {n for names in seen.values() if len(names) > 1 for n in names}


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
