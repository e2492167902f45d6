"""How view ops relabel tensor axes: reshapes, permutations, basic indexing.

Shared by the axis rules (``teleopt.detection.rules``) and the head finder
(``teleopt.detection.attention``): a row-major reshape pairs groups of axes of
equal product, a permute/transpose/movedim maps output axes to input axes, and a
basic index (ints, slices, ``None``, ``...``) is normalised to one item per input
axis.  A parameter seen through such ops stays a :class:`ParamView`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from teleopt.detection.fx_args import arg, int_arg, ints
from teleopt.detection.relations import ParamView

__all__ = ["reshape_groups", "perm_of", "index_items", "view_through"]


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Pair the non-unit axes of two shapes into groups of equal product (row-major reshape).

    Returns ``[(src_axes, dst_axes), ...]`` or ``None`` if the shapes have different sizes.
    """
    a = [(i, n) for i, n in enumerate(src) if n != 1]
    b = [(j, n) for j, n in enumerate(dst) if n != 1]
    if math.prod(src) != math.prod(dst):
        return None
    groups = []
    i = j = 0
    while i < len(a) and j < len(b):
        ga, gb = [a[i][0]], [b[j][0]]
        pa, pb = a[i][1], b[j][1]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(a[i][0])
                pa *= a[i][1]
                i += 1
            else:
                gb.append(b[j][0])
                pb *= b[j][1]
                j += 1
        groups.append((ga, gb))
    return groups


def perm_of(node: fx.Node, ndim: int) -> list[int] | None:
    """Output axis k comes from input axis perm[k] (permute, transpose, t, movedim, .T, .mT)."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.target is getattr:
        name = str(node.args[1])
    else:
        name = getattr(node.target, "__name__", "")
    rest = list(node.args[1:])
    if name == "permute":
        dims: Any = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        if not dims and "dims" in node.kwargs:
            dims = node.kwargs["dims"]
        return [d % ndim for d in ints(dims, "permute dims")]
    perm = list(range(ndim))
    if name in ("transpose", "swapaxes"):
        d0, d1 = int_arg(node, 1, "dim0") % ndim, int_arg(node, 2, "dim1") % ndim
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    if name in ("t", "T"):
        return perm[::-1] if ndim == 2 or name == "T" else perm
    if name == "mT":
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return perm
    if name == "movedim":
        src = [s % ndim for s in ints(arg(node, 1, "source"), "movedim source")]
        dst = [d % ndim for d in ints(arg(node, 2, "destination"), "movedim destination")]
        out: list[int | None] = [None] * ndim
        for s, d in zip(src, dst):
            out[d] = s
        rest_in = iter([i for i in range(ndim) if i not in src])
        return [o if o is not None else next(rest_in) for o in out]
    return None


def index_items(index: Any, ndim: int) -> list | None:
    """Normalise a basic index (ints, slices, None, Ellipsis) to one item per input axis (plus Nones)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool) for i in items):
        return None
    for it in items:
        if isinstance(it, slice) and any(isinstance(v, fx.Node) for v in (it.start, it.stop, it.step)):
            return None
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    if items.count(Ellipsis) > 1 or n_real > ndim:
        return None
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (ndim - n_real) + items[k + 1 :]
    else:
        items = items + [slice(None)] * (ndim - n_real)
    return items


def view_through(node: fx.Node, op: str, view: ParamView, out_shape: tuple[int, ...]) -> ParamView | None:
    """The parameter view after a view op, or ``None`` if the op does more than relabel axes."""
    if op in ("identity_like", "identity"):
        return view
    through = _VIEW_OPS.get(op)
    return through(node, view, out_shape) if through is not None else None


def _relabelled(view: ParamView, out_shape: tuple[int, ...], axis_map: list[int | None], expanded: list[bool]) -> ParamView:
    """``view``'s parameter seen with new axes: output axis j is parameter axis ``axis_map[j]`` (``None``: new)."""
    return ParamView(view.name, view.kind, tuple(axis_map), out_shape, tuple(expanded))


def _permuted(node: fx.Node, view: ParamView, out_shape: tuple[int, ...]) -> ParamView | None:
    """A permute/transpose/movedim of a view: its axes reordered (``None`` if the order is unknown)."""
    perm = perm_of(node, len(view.shape))
    if perm is None:
        return None
    return _relabelled(view, out_shape, [view.axis_map[i] for i in perm], [view.expanded[i] for i in perm])


def _expanded(node: fx.Node, view: ParamView, out_shape: tuple[int, ...]) -> ParamView:
    """An expand of a view: trailing axes of equal size kept, the others new (expanded when longer than 1)."""
    off = len(out_shape) - len(view.shape)
    axis_map: list[int | None] = []
    expanded: list[bool] = []
    for j, n in enumerate(out_shape):
        i = j - off
        if i >= 0 and view.shape[i] == n:
            axis_map.append(view.axis_map[i])
            expanded.append(view.expanded[i])
        else:
            axis_map.append(None)
            expanded.append(n > 1)
    return _relabelled(view, out_shape, axis_map, expanded)


def _reshaped(node: fx.Node, view: ParamView, out_shape: tuple[int, ...]) -> ParamView | None:
    """A reshape of a view that only adds or drops unit axes (``None`` if it merges or splits axes)."""
    groups = reshape_groups(view.shape, out_shape)
    if groups is None or any(len(s) != 1 or len(d) != 1 for s, d in groups):
        return None
    axis_map: list[int | None] = [None] * len(out_shape)
    expanded = [False] * len(out_shape)
    for (s,), (d,) in groups:
        axis_map[d] = view.axis_map[s]
        expanded[d] = view.expanded[s]
    return _relabelled(view, out_shape, axis_map, expanded)


def _indexed(node: fx.Node, view: ParamView, out_shape: tuple[int, ...]) -> ParamView | None:
    """A basic index of a view that only takes full slices and inserts new axes (``None`` otherwise)."""
    items = index_items(node.args[1], len(view.shape))
    if items is None or any(isinstance(i, int) or (isinstance(i, slice) and i != slice(None)) for i in items):
        return None
    axis_map: list[int | None] = []
    expanded: list[bool] = []
    k = 0
    for it in items:
        if it is None:
            axis_map.append(None)
            expanded.append(False)
        else:
            axis_map.append(view.axis_map[k])
            expanded.append(view.expanded[k])
            k += 1
    return _relabelled(view, out_shape, axis_map, expanded)


_VIEW_OPS: dict[str, Callable[[fx.Node, ParamView, tuple[int, ...]], ParamView | None]] = {
    "permute": _permuted,
    "expand": _expanded,
    "reshape": _reshaped,
    "getitem_view": _indexed,
}
