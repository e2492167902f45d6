"""What an op rule receives: one node of a traced graph and the relations it may state.

An op rule is a function ``rule(ctx: RuleContext) -> None``.  ``RuleContext`` is the
:class:`~teleopt.detection.relations.NodeContext` of the node (its tensors as
:meth:`tensor` / :meth:`output` / :meth:`param`, the relations :meth:`unify`,
:meth:`block`, :meth:`kron`, :meth:`product`, :meth:`approximate`), plus what rules
share: the node's leaf module, typed arguments, the op of another node, and the
fail-closed fallbacks (:meth:`fail_closed`, :meth:`constant`).  Every axis of the
tensors a rule touches that it leaves unmentioned is blocked when it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch.fx as fx
from torch import nn

from teleopt.detection.fx_args import Argument, arg, nodes_in
from teleopt.detection.ops import identify_node
from teleopt.detection.relations import ALL, NodeContext, ParamView, Ref
from teleopt.detection.tracing import TensorMeta

__all__ = ["RuleContext", "OpRule", "tensor_paths", "align"]


class RuleContext(NodeContext):
    """One node as a rule sees it (see :class:`~teleopt.detection.relations.NodeContext` for the relation helpers)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.touched: set[str] = set()  # parameters and buffers the rule materialised

    # -- the node -----------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The leaf module a ``call_module`` node calls (``TypeError`` for other nodes)."""
        if self.node.op != "call_module":
            raise TypeError(f"{self.node.name} is a {self.node.op} node, not a module call")
        return self.traced.modules[str(self.node.target)]

    def arg(self, i: int, name: str, default: Argument = None) -> Argument:
        """Argument ``i`` of the call, else keyword ``name``, else ``default``."""
        return arg(self.node, i, name, default)

    def op_of(self, node: fx.Node) -> str | None:
        """The canonical op of another node of the graph (``teleopt.detection.ops``)."""
        return identify_node(node, self.traced)[0]

    def is_operand(self, value: Any) -> bool:
        """A floating-point tensor or a parameter view (what a rule ties axes of)."""
        return self.is_tensor(value) or self.view_of(value) is not None

    # -- tensors (recording which parameters the rule used) -------------------------
    def tensor(self, arg: Any, role: str = "input", movable: bool = False) -> Ref:
        view = self.view_of(arg)
        if view is not None:
            self.touched.add(view.name)
        return super().tensor(arg, role, movable)

    def param(self, module: nn.Module, attr: str, role: str, movable: bool = False) -> Ref | None:
        t = getattr(module, attr, None)
        if t is not None:
            self.touched.add(self.rel.tensors.names.get(id(t)) or f"{self.where}.{attr}")
        return super().param(module, attr, role, movable)

    def outputs(self) -> list[Ref]:
        """Every floating-point output tensor of the node (declared and involved)."""
        return [self.output(path) for path, meta in tensor_paths(self.value(self.node)) if meta.is_float]

    # -- shared rules and fallbacks ---------------------------------------------------
    def same(self, x_arg: Any) -> None:
        """The output is ``x_arg`` with the same axes: every group kind passes every axis."""
        x, out = self.tensor(x_arg), self.output()
        for i in range(len(self.meta(out))):
            self.unify(ALL, (x, i), (out, i))

    def constant(self) -> None:
        """The outputs do not depend on tensor values: they are fixed."""
        for ref in self.outputs():
            self.block_tensor(ALL, ref, "a constant tensor built in forward")

    def fail_closed(self, describe: str) -> None:
        """No rule applies: every axis the node touches is frozen, and the op is reported."""
        self._freeze_all()
        self.rel.skipped.append(("op", self.where, f"{describe} has no detection rule: the axes it touches are frozen"))

    def internal_error(self, describe: str, error: Exception) -> None:
        """A built-in rule raised (a bug in teleopt): every axis the node touches is frozen, and the error is reported."""
        self._freeze_all()
        reason = f"internal error: the detection rule of {describe} raised {type(error).__name__}: {error}; the axes it touches are frozen"
        self.rel.skipped.append(("internal_error", self.where, reason))

    def _freeze_all(self) -> None:
        node = self.node
        for a in nodes_in((node.args, node.kwargs)):
            if self.is_operand(a):
                self.tensor(a, role="opaque")
        if node.op == "call_module":
            module = self.traced.modules.get(str(node.target))
            if module is not None:
                for pname, _ in module.named_parameters(recurse=True):
                    self.param(_owner(module, pname), pname.rsplit(".", 1)[-1], role="opaque")
        self.outputs()

    def seal(self) -> None:
        """Involve what a user rule left out, so that its unmentioned axes are blocked (fail closed).

        Tensor arguments and outputs are involved; parameters and buffers of the node
        (arguments, or the leaf module's own) that the rule did not use enter as opaque
        occurrences, so no site moves them for another use.
        """
        node = self.node
        for a in nodes_in((node.args, node.kwargs)):
            view: ParamView | None = self.view_of(a)
            if view is not None:
                if view.name not in self.touched:
                    self.tensor(a, role="opaque")
            elif self.is_tensor(a):
                self.tensor(a)
        if node.op == "call_module":
            module = self.module
            for pname, t in [*module.named_parameters(recurse=True), *module.named_buffers(recurse=True)]:
                name = self.rel.tensors.names.get(id(t))
                if name is not None and name not in self.touched:
                    self.param(_owner(module, pname), pname.rsplit(".", 1)[-1], role="opaque")
        self.outputs()


#: An op rule: states the relations of one node (see the module docstring).
OpRule = Callable[[RuleContext], None]


def tensor_paths(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, TensorMeta]]:
    """(path, meta) of every tensor in a recorded value (nested tuples and lists)."""
    if isinstance(value, TensorMeta):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from tensor_paths(v, path + (i,))


def align(ctx: NodeContext, t: Ref, out: Ref, j: int) -> tuple[Ref, int] | None:
    """The axis of operand ``t`` that broadcasting aligns with output axis ``j`` (right-aligned)."""
    i = j - (len(ctx.meta(out)) - len(ctx.meta(t)))
    return (t, i) if i >= 0 else None


def _owner(module: nn.Module, qualified: str) -> nn.Module:
    for p in qualified.split(".")[:-1]:
        module = getattr(module, p)
    return module
