"""The head layout of an attention projection: which rows of a (possibly fused) weight feed which head.

Shared vocabulary of :mod:`teleopt.detection.attention`: a projection's output
index is a list of *feature digits* (size, stride); reshapes, permutes, chunks and
picks on the way to q, k and v are replayed on those digits (Zhao 2026
Ex. 1.2.11-1.2.12 need the exact rows of each head).  A projection's bias may be
concatenated in forward from pieces (timm BEiT, EVA-02, SwinV2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from teleopt.detection.fx_args import Argument

__all__ = ["Digits", "NoMatch", "Layout", "BiasPiece", "Projection", "reads_dtype_only", "as_node", "row_range", "merge", "split_digits"]

Digits = list[tuple[int, int]]  # (size, stride) in the projection's output index, row-major


class NoMatch(Exception):
    pass


@dataclass
class Layout:
    axes: list[Digits | None]  # None: an axis that is not a feature axis (batch, tokens)
    offset: int = 0


@dataclass(frozen=True)
class BiasPiece:
    """Rows [start, stop) of a projection's bias: a parameter (``name``), a zero built in forward, or fixed."""

    start: int
    stop: int
    kind: str  # "parameter" | "zero" | "fixed"
    name: str | None = None


@dataclass(frozen=True)
class Projection:
    node: fx.Node
    weight: str
    bias: str | None
    in_features: int
    out_features: int
    #: the bias as pieces of rows: one parameter piece for a plain bias; timm BEiT/EVA/SwinV2 pass
    #: ``torch.cat((q_bias, k_bias, v_bias))`` (k_bias a zero buffer or ``zeros_like``)
    bias_pieces: tuple[BiasPiece, ...] = ()
    #: the weight axis of the output features (0: ``F.linear``'s (out, in); 1: ``addmm``'s (in, out), GPT-2's Conv1D)
    weight_axis: int = 0
    #: which argument of the call is the projection's input (0: ``linear(x, W)``; 1: ``addmm(b, x, W)``)
    input_index: int = 0

    def input(self) -> Argument:
        """The input the projection reads."""
        args = self.node.args
        return args[self.input_index] if len(args) > self.input_index else None

    def rows(self, start: int, length: int, power: int, outer: int = 1) -> dict:
        """Member fields of the weight's output features [start, start + length), viewed as (outer, n)."""
        fields = row_range(start, length, self.out_features, power)
        fields["axis"] = self.weight_axis
        if outer > 1:
            fields.update(start=start, stop=start + length, outer=outer)
        return fields

    def columns(self, power: int, start: int | None = None, length: int = 0, outer: int = 1) -> dict:
        """Member fields of the weight's input features (all, or [start, start + length) viewed as (outer, n))."""
        fields: dict = {"axis": 1 - self.weight_axis, "power": power}
        if start is not None:
            fields.update(start=start, stop=start + length)
        if outer > 1:
            fields["outer"] = outer
        return fields

    def bias_members(self, start: int, length: int, power: int, what: str, fixed_ok: bool = False) -> list[tuple[str, dict]]:
        """Members moving the bias of rows [start, start+length) like those rows (fail closed on a fixed piece).

        A zero piece built in forward stays zero under any linear map; a fixed nonzero
        piece (a buffer, a constant) cannot move, so the site is dropped unless
        ``fixed_ok`` (the key bias, which softmax ignores).
        """
        stop = start + length
        hit = [p for p in self.bias_pieces if p.start < stop and start < p.stop]
        members: list[tuple[str, dict]] = []
        for p in hit:
            if p.kind == "zero":
                continue
            if p.kind == "fixed":
                if fixed_ok:
                    continue
                raise NoMatch(f"the bias of rows {start}..{stop} of {self.weight} is a fixed tensor that cannot move with them")
            if not (p.start <= start and stop <= p.stop):
                raise NoMatch(f"the bias of rows {start}..{stop} of {self.weight} is split across several parameters")
            assert p.name is not None
            members.append((p.name, row_range(start - p.start, length, p.stop - p.start, power)))
        return members

    def bias_rows(self, start: int, length: int, power: int, outer: int = 1) -> list[tuple[str, dict]]:
        """:meth:`bias_members`, the bias viewed as (outer, n) like the rows."""
        members = self.bias_members(start, length, power, "rows")
        if outer > 1:
            for _, fields in members:
                fields.setdefault("start", start)
                fields.setdefault("stop", start + length)
                fields["outer"] = outer
        return members


def reads_dtype_only(user: fx.Node, node: fx.Node) -> bool:
    """``x.type_as(node)`` reads only the dtype of ``node`` (EVA-02's rotary embedding casts q to v's dtype)."""
    return user.op == "call_method" and user.target == "type_as" and user.args[0] is not node and node not in user.kwargs.values()


def as_node(value: Argument, what: str) -> fx.Node:
    if not isinstance(value, fx.Node):
        raise NoMatch(f"{what} is not a traced tensor")
    return value


def row_range(start: int, length: int, total: int, power: int) -> dict:
    if start == 0 and length == total:
        return {"axis": 0, "power": power}
    return {"axis": 0, "power": power, "start": start, "stop": start + length}


def merge(digits: Digits) -> Digits:
    out: Digits = []
    for size, stride in digits:
        if out and out[-1][1] == size * stride:
            s0, _ = out.pop()
            out.append((s0 * size, stride))
        else:
            out.append((size, stride))
    return out


def split_digits(digits: Digits, sizes: list[int], what: str) -> list[Digits]:
    digits = list(digits)
    out = []
    for s in sizes:
        cur: Digits = []
        prod = 1
        while prod < s:
            if not digits:
                raise NoMatch(f"cannot follow a reshape of {what}")
            size, stride = digits.pop(0)
            need = s // prod
            if size <= need:
                if need % size:
                    raise NoMatch(f"cannot follow a reshape of {what}")
                cur.append((size, stride))
                prod *= size
            else:
                if size % need:
                    raise NoMatch(f"cannot follow a reshape of {what}")
                cur.append((need, stride * (size // need)))
                digits.insert(0, (size // need, stride))
                prod *= need
        out.append(cur)
    if digits:
        raise NoMatch(f"cannot follow a reshape of {what}")
    return out
