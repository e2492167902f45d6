"""Turning axis classes into sites: one ``AxisAction`` per free class, bound by tensor names.

After every op rule has run, the pending constraints are settled (shared tensors
tied, products through two scaled factors decided, reshaped axes resolved), and
each class that is free (not blocked) and holds at least one parameter becomes a
site: the group of its kind acting on every parameter/buffer axis in the class,
with the power the class assigned (Zhao 2026, Prop. 1.2.3: g on the writer, the
contragredient on the reader; Ex. 1.2.7: c^2 on BatchNorm running variances).
A class's members are exactly the tensors the union-find tied together, so no
site over-ties (minimality) and none misses a member (invariance).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch.fx as fx
from torch import nn

from teleopt.actions.axis import AxisAction, Member
from teleopt.actions.softmax import SoftmaxTranslation
from teleopt.detection.axes import KINDS, AxisClasses
from teleopt.detection.fx_args import float_arg
from teleopt.detection.ops import identify_node
from teleopt.detection.relations import DirectSite, Relations
from teleopt.detection.tracing import TensorMeta, TracedGraph
from teleopt.site import Site

__all__ = ["settle", "class_sites", "direct_sites", "softmax_translation_sites", "blocked_reasons", "module_order"]

_TOL = 1e-9


@dataclass(frozen=True)
class _Piece:
    """Part of a tensor axis in a class: [start, stop) of ``axis`` viewed as (outer, n, inner)."""

    param: str
    axis: int
    groups: int
    start: int
    stop: int
    full: int
    outer: int
    inner: int
    power: float
    role: tuple = ()

    @property
    def layout(self) -> tuple:
        return (self.param, self.axis, self.groups, self.start, self.stop, self.outer, self.inner)

    @property
    def n(self) -> int:
        return (self.stop - self.start) // (self.outer * self.inner)


# -- settling pending constraints ---------------------------------------------------------
def settle(rel: Relations) -> None:
    """Tie shared tensors, then decide products and reshapes until nothing changes (fixpoint)."""
    rel.tie_occurrences()
    done: set[tuple] = set()
    while True:
        changed = _products(rel)
        for kind in KINDS:
            changed |= _krons(rel, kind, done)
        if changed:
            continue
        if not rel.products:
            return
        # positive scaling through a product of two free factors: fail closed
        space = rel.spaces["diagonal"]
        for a, b, out, _, _, where in rel.products:
            for atoms in (a, b, out):
                space.block(rel.nodes("diagonal", atoms), f"{where}: both factors of a product could be scaled")
        rel.products = []


def _products(rel: Relations) -> bool:
    space = rel.spaces["diagonal"]
    pending, changed = [], False
    for rec in rel.products:
        a, b, out, ea, eb, where = rec
        na, nb, no = (rel.nodes("diagonal", x) for x in (a, b, out))
        if space.all_blocked(nb):
            space.unify(na, no, ea)
        elif space.all_blocked(na):
            space.unify(nb, no, eb)
        else:
            pending.append(rec)
            continue
        changed = True
    rel.products = pending
    return changed


def _krons(rel: Relations, kind: str, done: set[tuple]) -> bool:
    space = rel.spaces[kind]
    changed = False
    groups: dict[int, list[tuple[int, float, list[list[int]], str]]] = {}
    for idx, (m_atoms, factors, kinds, where) in enumerate(rel.krons):
        if kind not in kinds:
            continue
        leaves = space.leaves(rel.nodes(kind, m_atoms))
        fnodes = [rel.nodes(kind, f) for f in factors]
        roots = {leaf.root for f in fnodes for leaf in space.leaves(f)}
        if len(leaves) != 1 or leaves[0].root in roots:
            # the merged axis too: its pieces (a fused qkv cut by a concatenated bias) reach the
            # blocked factors through the reshape, so no group may act on them either
            why = f"{where}: a reshaped axis is cut or tied to its own factors"
            changed |= _block_all(space, fnodes + [rel.nodes(kind, m_atoms)], why)
            continue
        groups.setdefault(leaves[0].root, []).append((idx, leaves[0].power, fnodes, where))
    for cm, recs in groups.items():
        reasons = space.blocked(cm)
        if reasons:
            for _, _, fnodes, where in recs:
                changed |= _block_all(space, fnodes, f"reshaped at {where} into an axis that is fixed ({reasons[0]})")
            continue
        i0, p0, f0, _ = recs[0]
        for i, pr, fr, where in recs[1:]:
            key = (kind, i0, i)
            if key in done:
                continue
            done.add(key)
            sizes0 = [sum(space.length(leaf.root) for leaf in space.leaves(f)) for f in f0]
            sizes = [sum(space.length(leaf.root) for leaf in space.leaves(f)) for f in fr]
            if sizes0 != sizes:
                changed |= _block_all(space, f0 + fr, f"{where}: one axis is reshaped in two incompatible ways")
                continue
            for a, b in zip(f0, fr):
                space.unify(a, b, 1.0 if kind == "permutation" else pr / p0)
            changed = True
    return changed


def _block_all(space: AxisClasses, axes: list[list[int]], reason: str) -> bool:
    changed = False
    for nodes in axes:
        if not space.all_blocked(nodes):
            space.block(nodes, reason)
            changed = True
    return changed


# -- pieces of classes ---------------------------------------------------------------------
def _direct_pieces(rel: Relations, kind: str) -> dict[int, list[_Piece]]:
    space = rel.spaces[kind]
    out: dict[int, list[_Piece]] = {}
    for atom, occ in rel.occurrences.items():
        offset = 0
        length = rel.lengths[atom]
        for leaf in space.leaves(rel.nodes(kind, [atom])):
            out.setdefault(leaf.root, []).append(
                _Piece(occ.param, occ.axis, occ.groups, offset, offset + leaf.length, length, 1, 1, leaf.power, (occ.use, occ.role))
            )
            offset += leaf.length
    return out


def _compose(p: _Piece, outer_f: int, size_f: int, inner_f: int, offset: int, length: int, power: float) -> _Piece | None:
    """The piece of tensor axis ``p`` that a factor segment [offset, offset+length) of a reshaped axis acts on."""
    if p.groups > 1:
        return None
    inner = inner_f * p.inner
    if length == size_f:
        return replace(p, outer=p.outer * outer_f, inner=inner, power=power)
    if p.outer == 1 and outer_f == 1:
        start = p.start + offset * inner
        return replace(p, start=start, stop=start + length * inner, inner=inner, power=power)
    return None


_Absorb = tuple[int, float, int, int, int, int, int, float]


def _kron_absorbs(rel: Relations, kind: str) -> tuple[set[int], dict[int, list[_Absorb]]]:
    """The classes of reshaped axes (structural) and, per class of a factor axis, the segments it absorbs.

    A reshape ties an axis of size ``prod(sizes)`` to its factor axes (``rel.krons``); the factor
    class at position ``i`` acts on a strided block of the merged axis: ``(merged class, its power,
    outer size, factor size, inner size, offset in the factor, length, the factor leaf's power)``.
    """
    space = rel.spaces[kind]
    structural: set[int] = set()
    absorbs: dict[int, list[_Absorb]] = {}
    for m_atoms, factors, kinds, _where in rel.krons:
        if kind not in kinds:
            continue
        leaves = space.leaves(rel.nodes(kind, m_atoms))
        if len(leaves) != 1 or space.blocked(leaves[0].root):
            continue
        cm, p_m = leaves[0].root, leaves[0].power
        structural.add(cm)
        sizes = [sum(space.length(leaf.root) for leaf in space.leaves(rel.nodes(kind, f))) for f in factors]
        for i, f in enumerate(factors):
            outer_f, inner_f = math.prod(sizes[:i]), math.prod(sizes[i + 1 :])
            offset = 0
            for leaf in space.leaves(rel.nodes(kind, f)):
                absorbs.setdefault(leaf.root, []).append((cm, p_m, outer_f, sizes[i], inner_f, offset, leaf.length, leaf.power))
                offset += leaf.length
    return structural, absorbs


def _effective_pieces(rel: Relations, kind: str) -> tuple[dict[int, list[_Piece]], set[int], dict[int, list[str]], dict[int, list[str]]]:
    """Pieces of every class including those reached through reshapes; structural classes; extra blocks/approx."""
    space = rel.spaces[kind]
    direct = _direct_pieces(rel, kind)
    structural, absorbs = _kron_absorbs(rel, kind)
    memo: dict[int, list[_Piece]] = {}
    extra_block: dict[int, list[str]] = {}
    extra_approx: dict[int, list[str]] = {}

    def pieces(root: int, visiting: frozenset[int]) -> list[_Piece]:
        if root in memo:
            return memo[root]
        out = list(direct.get(root, []))
        for cm, p_m, outer_f, size_f, inner_f, offset, length, p_f in absorbs.get(root, []):
            if cm in visiting:
                extra_block.setdefault(root, []).append("reshapes form a cycle")
                continue
            for p in pieces(cm, visiting | {root}):
                power = 1.0 if kind == "permutation" else p_f * p.power / p_m
                c = _compose(p, outer_f, size_f, inner_f, offset, length, power)
                if c is None:
                    extra_block.setdefault(root, []).append(f"{p.param}: the reshaped layout is not a strided block")
                else:
                    out.append(c)
            extra_approx.setdefault(root, []).extend(space.approximate(cm))
        memo[root] = out
        return out

    result = {}
    for root in set(direct) | set(absorbs):
        result[root] = pieces(root, frozenset())
    return result, structural, extra_block, extra_approx


# -- sites ------------------------------------------------------------------------------------
_ACTIONS = {
    "general": ("gl_linear", "Zhao 2026, Ex. 1.2.2 (GL_h between linear maps)", "GL_{n}(R)"),
    "diagonal": ("positive_rescaling", "Zhao 2026, Ex. 1.2.4 (positive rescaling)", "R_{{>0}}^{n}"),
    "permutation": ("hidden_permutation", "Zhao 2026, Ex. 1.2.9 (permutations)", "S_{n}"),
}


def _members(pieces: list[_Piece], kind: str, order: dict[str, int], shared: set[str]) -> list[Member] | str:
    """The members of a site from the pieces of its class, or why the group is not representable."""
    chosen = _chosen_powers(pieces, kind, shared)
    if isinstance(chosen, str):
        return chosen
    if not chosen:
        return "no tensor is changed by this group"
    chosen.sort(key=lambda t: (order.get(t[0].param, 1 << 30), t[0].param, t[0].axis, t[0].start))
    by_param: dict[str, list[tuple[_Piece, float]]] = {}
    for p, power in chosen:
        by_param.setdefault(p.param, []).append((p, power))
    members = []
    for param, parts in by_param.items():
        if _overlapping(parts):
            return f"{param} would carry the group twice on overlapping entries"
        members += [_member(param, p, power, tensor=param if len(parts) > 1 else None) for p, power in parts]
    return members


def _chosen_powers(pieces: list[_Piece], kind: str, shared: set[str]) -> list[tuple[_Piece, float]] | str:
    """One (piece, power) per tensor layout, the uses of a layout combined; a reason if they cannot be.

    Permutations act with power 1; a GL group or a shared tensor's tied uses carry one
    transformation, so their powers must agree; one use in several roles (``x * gamma``:
    gamma absorbs x and writes the output) multiplies the scalings, and a layout whose
    powers cancel is left out.
    """
    by_layout: dict[tuple, dict[tuple, float]] = {}
    template: dict[tuple, _Piece] = {}
    for p in pieces:
        by_layout.setdefault(p.layout, {})[p.role] = p.power
        template.setdefault(p.layout, p)
    chosen: list[tuple[_Piece, float]] = []
    for layout, roles in by_layout.items():
        powers = list(roles.values())
        if kind == "permutation":
            power = 1.0
        elif kind == "general" or layout[0] in shared:
            if any(abs(x - powers[0]) > _TOL for x in powers):
                return f"{layout[0]} would need two different transformations of the same entries"
            power = powers[0]
        else:
            power = sum(powers)
            if abs(power) < _TOL:
                continue
        chosen.append((template[layout], power))
    return chosen


def _overlapping(parts: list[tuple[_Piece, float]]) -> bool:
    """Whether two pieces of one tensor cover overlapping entries of the same axis."""
    return any(p is not q and p.axis == q.axis and not (p.stop <= q.start or q.stop <= p.start) for p, _ in parts for q, _ in parts)


def _member(param: str, p: _Piece, power: float, tensor: str | None) -> Member:
    """The member of a piece: named by its slice when ``tensor`` is set (one of several pieces), power an
    int when it is one."""
    whole = p.start == 0 and p.stop == p.full
    if abs(power - round(power)) < _TOL:
        power = int(round(power))
    name = param if tensor is None else f"{param}[{p.axis}:{p.start}:{p.stop}]"
    return Member(
        name,
        p.axis,
        power,
        start=None if whole else p.start,
        stop=None if whole else p.stop,
        outer=p.outer,
        inner=p.inner,
        groups=p.groups,
        tensor=tensor,
    )


def class_sites(rel: Relations, order: dict[str, int], kinds: Iterable[str] = KINDS) -> tuple[list[Site], list[tuple[str, str, str]]]:
    """One site per free class holding a parameter, for each group kind."""
    sites: list[Site] = []
    skipped: list[tuple[str, str, str]] = []
    uses: dict[str, set] = {}
    for occ in rel.occurrences.values():
        uses.setdefault(occ.param, set()).add(occ.use)
    shared = {p for p, u in uses.items() if len(u) > 1}
    for kind in kinds:
        space = rel.spaces[kind]
        pieces, structural, extra_block, extra_approx = _effective_pieces(rel, kind)
        for root, ps in pieces.items():
            if root in structural or space.blocked(root) or extra_block.get(root):
                continue
            if not any(rel.tensors.kinds.get(p.param) == "parameter" for p in ps):
                continue
            n = ps[0].n
            if kind == "permutation" and n < 2:
                continue
            members = _members(ps, kind, order, shared)
            if isinstance(members, str):
                skipped.append(("site", ps[0].param, f"{kind} group not representable: {members}"))
                continue
            if not any(rel.tensors.kinds.get(m.tensor_key) == "parameter" for m in members):
                continue
            approx = list(space.approximate(root)) + extra_approx.get(root, [])
            name, reference, group_name = _ACTIONS[kind]
            if approx:
                name, reference = "batchnorm_scaling", "Zhao 2026, Ex. 1.2.7 (scale invariance of BatchNorm inputs)"
            try:
                action = AxisAction(
                    name,
                    kind,
                    members,
                    reference=reference,
                    group_name=group_name.format(n=n),
                    exactness="approximate" if approx else "exact",
                )
                action.group(tuple(_zeros(rel, m) for m in members))  # the layouts fit the tensors
            except ValueError as e:
                skipped.append(("site", ps[0].param, f"{kind} group not representable: {e}"))
                continue
            info: dict[str, Any] = {"kind": kind, "channels": n}
            if approx:
                info["approximate"] = sorted(set(approx))
                # the BatchNorm modules whose eps makes the site approximate (reasons end in " at <module>")
                info["batchnorm"] = sorted({r.rsplit(" at ", 1)[-1] for r in approx if "BatchNorm" in r})
            sites.append(Site(action, tuple(m.tensor_key for m in members), "", None, info))
    return sites, skipped


def _zeros(rel: Relations, m: Member):
    """A stand-in tensor with the member tensor's shape (layouts are checked on shapes only)."""
    import torch

    return torch.empty(rel.tensors.shapes[m.tensor_key], device="meta")


def direct_sites(rel: Relations, n_graphs: int) -> tuple[list[Site], list[tuple[str, str, str]]]:
    """Sites stated by rules (attention heads), kept when every traced mode found them."""
    uses: dict[str, set] = {}
    for occ in rel.occurrences.values():
        uses.setdefault(occ.param, set()).add(occ.use)
    seen: dict[tuple, list[DirectSite]] = {}
    for ds in rel.direct_sites:
        key = (ds.action, tuple((n, tuple(sorted(kw.items()))) for n, kw in ds.members))
        seen.setdefault(key, []).append(ds)
    sites, skipped = [], []
    for found in seen.values():
        ds = found[0]
        if len({d.graph for d in found}) < n_graphs:
            skipped.append(("attention", ds.where, f"{ds.action} holds in one mode only"))
            continue
        bad = [n for n, _ in ds.members if n is None or n not in rel.tensors.movable]
        if bad:
            skipped.append(("attention", ds.where, f"{ds.action}: {bad[0]} is frozen or not a state_dict entry"))
            continue
        named = [(n, kw) for n, kw in ds.members if n is not None]  # all of them (checked above)
        names = [n for n, _ in named]
        shared = [n for n in names if len(uses.get(n, ())) > 1]
        if shared:
            skipped.append(("attention", ds.where, f"{ds.action}: {shared[0]} is also used elsewhere"))
            continue
        counts: dict[str, int] = {}
        for n in names:
            counts[n] = counts.get(n, 0) + 1
        try:
            members = []
            for n, kw in named:
                label = n if counts[n] == 1 else f"{n}[{kw.get('axis', 0)}:{kw.get('start', '')}:{kw.get('stop', '')}]"
                members.append(Member(label, tensor=n if counts[n] > 1 else None, **kw))
            action = AxisAction(
                ds.action,
                ds.group,
                members,
                reference=ds.reference,
                blocks=ds.blocks,
                unit_size=ds.unit_size,
                exactness=ds.exactness,  # type: ignore[arg-type]
                group_name={
                    "attention_qk_gl": "(GL_{d_k}(R))^h",
                    "attention_vo_gl": "(GL_{d_v}(R))^h",
                    "attention_head_permutation": "S_h",
                }.get(ds.action),
            )
            action.group(tuple(_zeros(rel, m) for m in members))
        except ValueError as e:
            skipped.append(("attention", ds.where, f"{ds.action} not representable: {e}"))
            continue
        sites.append(Site(action, tuple(names), "", None, {"kind": ds.group, **ds.info}))
    return sites, skipped


def softmax_translation_sites(graphs: list[TracedGraph], rel: Relations) -> tuple[list[Site], list[tuple[str, str, str]]]:
    """The softmax translation of a final linear classifier (Zhao 2026, Ex. 1.2.8), for a cross-entropy loss."""
    found: list[tuple[str, str | None] | str] = []
    for gi, traced in enumerate(graphs):
        found.append(_classifier(traced, gi, rel))
    if any(isinstance(f, str) for f in found):
        why = next(f for f in found if isinstance(f, str))
        return [], [("site", "softmax_translation", why)]
    if len(set(found)) != 1:
        return [], [("site", "softmax_translation", "the classifier differs between train and eval mode")]
    w, b = cast("tuple[str, str | None]", found[0])  # no entry is a reason (checked above)
    uses: dict[str, set] = {}
    for occ in rel.occurrences.values():
        uses.setdefault(occ.param, set()).add(occ.use)
    for n in (w, b):
        if n is not None and (n not in rel.tensors.movable or len(uses.get(n, ())) > 1):
            return [], [("site", "softmax_translation", f"{n} is frozen or shared")]
    action = SoftmaxTranslation()
    return [Site(action, (w, b), "", None, {"kind": "translation"})], []


def _classifier(traced: TracedGraph, gi: int, rel: Relations) -> tuple[str, str | None] | str:
    out = next(n for n in traced.graph.nodes if n.op == "output")
    arg = out.args[0]
    if not isinstance(arg, fx.Node):
        return "the model output is not a single tensor"
    cur = arg
    while True:
        op, describe = identify_node(cur, traced)
        if op == "linear":
            break
        if op in ("identity", "identity_like") or (op == "dropout" and not _p(traced, cur)):
            nxt = cur.args[0]
            if not isinstance(nxt, fx.Node):
                return f"the model output is computed by {describe}, not by a linear classifier"
            cur = nxt
            continue
        return f"the model output is computed by {describe}, not by a linear classifier"
    users = [u for u in cur.users if identify_node(u, traced)[0] != "metadata"]
    if len(users) != 1:
        return "the classifier output is also used inside the model"
    if cur.op == "call_module":
        m = traced.modules[str(cur.target)]
        w = rel.tensors.names.get(id(m.weight))
        b = rel.tensors.names.get(id(m.bias)) if m.bias is not None else None
    else:
        views = [rel.views.get(("t", gi, a.name, ())) if isinstance(a, fx.Node) else None for a in cur.args[1:3]]
        if views[0] is None or views[0].axis_map != (0, 1):
            return "the classifier weight is not a parameter"
        w = views[0].name
        b = views[1].name if len(views) > 1 and views[1] is not None else None
    value = traced.values.get(cur.name)
    if w is None or not isinstance(value, TensorMeta) or value.ndim < 1:
        return "the classifier weight is not a parameter"
    return (w, b)


def _p(traced: TracedGraph, node: fx.Node) -> float:
    if node.op == "call_module":
        module: Any = traced.modules[str(node.target)]
        return float(module.p)
    return float(float_arg(node, 1, "p", 0.5))


def blocked_reasons(rel: Relations, param: str, kinds: Iterable[str] = ("diagonal", "general")) -> str:
    """Why no continuous group acts on a parameter: the first block reason of each of its axes."""
    reasons: dict[int, str] = {}
    for atom, occ in rel.occurrences.items():
        if occ.param != param or occ.axis in reasons:
            continue
        for kind in kinds:
            space = rel.spaces[kind]
            for leaf in space.leaves(rel.nodes(kind, [atom])):
                why = space.blocked(leaf.root)
                if why:
                    reasons[occ.axis] = why[0]
                    break
            if occ.axis in reasons:
                break
    if not reasons:
        return (
            "not used by the traced forward"
            if not any(o.param == param for o in rel.occurrences.values())
            else "no continuous group acts on it"
        )
    return "; ".join(f"axis {a}: {r}" for a, r in sorted(reasons.items()))


def module_order(model: nn.Module) -> dict[str, int]:
    """Position of every parameter and buffer in the model (to sort members and sites)."""
    order: dict[str, int] = {}
    for i, (name, _) in enumerate(list(model.named_parameters()) + list(model.named_buffers())):
        order.setdefault(name, i)
    return order
