"""The rule driver: walks a traced graph and applies, node by node, the rule of its op from the table.

Inputs and outputs of the model are fixed; parameters enter as views (``get_attr``)
that view ops relabel without stating relations; every other node gets the rule of
its canonical op from :data:`~teleopt.detection.rules.table.RULES`.  A node without
a rule, or whose rule raises, freezes every axis it touches and is reported (fail
closed); a rule registered by the user is sealed: what it leaves out is frozen.

A built-in rule that raises is a bug in teleopt, not a missing rule: the node is
still frozen, but the report names it an internal error (kind ``"internal_error"``),
and with the environment variable ``TELEOPT_DETECTION_STRICT=1`` (the test suite
sets it) the error is raised instead.
"""

from __future__ import annotations

import os
from typing import Any

import torch.fx as fx
from torch import nn

from teleopt.detection.fx_args import nodes_in
from teleopt.detection.ops import identify_node, is_user_op
from teleopt.detection.relations import ALL, ParamView, Relations
from teleopt.detection.rules.context import OpRule, RuleContext, tensor_paths
from teleopt.detection.rules.table import RULES
from teleopt.detection.tracing import TensorMeta, TracedGraph
from teleopt.detection.views import view_through

__all__ = ["run_rules", "RuleError", "STRICT_ENV"]

#: environment variable that makes a failing built-in rule raise :class:`RuleError`
STRICT_ENV = "TELEOPT_DETECTION_STRICT"


class RuleError(RuntimeError):
    """A built-in detection rule raised (strict mode, ``TELEOPT_DETECTION_STRICT=1``): a bug in teleopt."""


_VIEW_OPS = {"reshape", "permute", "expand", "identity_like", "identity", "getitem_view"}


def run_rules(model: nn.Module, rel: Relations, graphs: list[TracedGraph]) -> None:
    """Apply the op rules of every traced graph (train and eval) to one set of relations."""
    for gi, traced in enumerate(graphs):
        for node in traced.graph.nodes:
            _node(model, rel, traced, gi, node)


def _node(model: nn.Module, rel: Relations, traced: TracedGraph, gi: int, node: fx.Node) -> None:
    if node.op == "placeholder":
        _model_input(RuleContext(rel, traced, gi, node, "the model input"))
        return
    if node.op == "get_attr":
        _get_attr(model, rel, traced, gi, node)
        return
    if node.op == "output":
        _model_output(RuleContext(rel, traced, gi, node, "the model output"))
        return
    op, describe = identify_node(node, traced)
    ctx = RuleContext(rel, traced, gi, node, describe)
    if op in _VIEW_OPS and _propagate_view(ctx, op):
        return
    if op == "metadata":
        return
    rule = RULES.get(op) if op is not None else None
    if rule is None:
        _without_rule(ctx)
    else:
        ctx = _apply_rule(ctx, rule)
    _dead(ctx)
    ctx.finish()


def _model_input(ctx: RuleContext) -> None:
    """Every floating-point tensor of a model input is fixed."""
    for path, meta in tensor_paths(ctx.traced.values.get(ctx.node.name)):
        if meta.is_float:
            ctx.block_tensor(ALL, ctx.output(path), "the model input is fixed")


def _model_output(ctx: RuleContext) -> None:
    """Every floating-point tensor the model returns is fixed."""
    for a in nodes_in(ctx.node.args):
        if ctx.is_tensor(a):
            ctx.block_tensor(ALL, ctx.tensor(a, role="output"), "the model output is fixed")
    ctx.finish()


def _without_rule(ctx: RuleContext) -> None:
    """An op without a rule: fail closed when it reads an operand, else its outputs are constants."""
    node = ctx.node
    if any(ctx.is_operand(a) for a in nodes_in((node.args, node.kwargs))):
        ctx.fail_closed(ctx.describe)
    else:
        ctx.constant()


def _apply_rule(ctx: RuleContext, rule: OpRule) -> RuleContext:
    """Run ``rule`` on the node (sealing a user's rule); the context to finish, a fresh one if the rule raised.

    A rule that raises fails closed: the relations it stated before failing are true of the
    op, and blocking everything it touches dominates them.  A built-in rule that raises is
    an internal error (raised as :class:`RuleError` in strict mode).
    """
    node, describe = ctx.node, ctx.describe
    user = is_user_op(node, ctx.traced)
    try:
        rule(ctx)
        if user:
            ctx.seal()
        return ctx
    except Exception as e:
        if not user and os.environ.get(STRICT_ENV, "") not in ("", "0"):
            raise RuleError(f"the detection rule of {describe} ({node.name}) raised {type(e).__name__}: {e}") from e
        ctx.finish()
        ctx = RuleContext(ctx.rel, ctx.traced, ctx.gi, node, describe)
        if user:
            ctx.fail_closed(f"{describe} (its rule failed: {type(e).__name__}: {e})")
        else:
            ctx.internal_error(describe, e)
        return ctx


def _get_attr(model: nn.Module, rel: Relations, traced: TracedGraph, gi: int, node: fx.Node) -> None:
    """A parameter, buffer or constant read by the graph becomes a view of it (no relations yet)."""
    target = str(node.target)
    meta = traced.values.get(node.name)
    if not isinstance(meta, TensorMeta):
        return
    obj: Any = None
    for getter in (model.get_parameter, model.get_buffer):
        try:
            obj = getter(target)
            break
        except AttributeError:
            continue
    name = rel.tensors.names.get(id(obj)) if obj is not None else None
    kind = rel.tensors.kinds.get(name, "constant") if name else "constant"  # tensors fx made constants of
    n = len(meta.shape)
    rel.views[("t", gi, node.name, ())] = ParamView(name or target, kind, tuple(range(n)), meta.shape, (False,) * n)


def _propagate_view(ctx: RuleContext, op: str) -> bool:
    """A view op on a parameter view gives another view (no relations yet)."""
    node = ctx.node
    view = ctx.view_of(node.args[0] if node.args else None)
    if view is None:
        return False
    out = ctx.value(node)
    if not isinstance(out, TensorMeta):
        return False
    new = view_through(node, op, view, out.shape)
    if new is None:
        return False
    ctx.rel.views[("t", ctx.gi, node.name, ())] = new
    return True


def _dead(ctx: RuleContext) -> None:
    """The outputs of a node nothing reads (but shape queries) are fixed."""
    if not [u for u in ctx.node.users if ctx.op_of(u) != "metadata"]:
        for ref in ctx.outputs():
            ctx.block_tensor(ALL, ref, "this value is not used")
