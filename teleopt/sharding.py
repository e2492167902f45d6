"""Sharded tensors (FSDP2's ``DTensor`` parameters) for the wrappers: local shards, full copies, reductions.

``torch.distributed.fsdp.fully_shard`` (FSDP2) replaces every parameter by a
``DTensor``: the global shape, a device mesh and placements (``Shard(0)`` by
default), of which each rank holds its local shard.  The wrappers meet them in
three ways, each with one helper here:

* elementwise work (syre's decay, optimizer-state writes) runs on the local
  shards (:func:`local`), with no communication;
* a value defined for the *full* tensor (a syre anchor drawn from a seeded
  generator, a teleported site member) is computed whole, identically on every
  rank, and each rank keeps its shard of it (:func:`shard_like`, :func:`write_`);
  :func:`full` gathers a sharded tensor (a collective: every rank must call it);
* sums over all entries (squared gradient norms, inner products) add the local
  shards and all-reduce over the mesh dimensions that shard the tensor
  (:func:`total_sum`, :func:`square_sum`).

Every function is the identity (or plain arithmetic) on ordinary tensors, so
callers need no branch for the unsharded case.

Besides: :func:`replicate_like` lays a value identical on every rank out as a
replicated ``DTensor`` (so arithmetic with shards stays local), :func:`unsharded_copy`
builds a whole copy of an FSDP2 module once (symmetry detection),
:func:`unsupported_layout` names layouts the wrappers refuse (HSDP, tensor
parallelism), :class:`CommunicatedBytes` counts what a rank sends to collectives, and
:func:`shard_placement_fn` shards the parameters that matrix-group sites act on by rows
along their columns instead, so that their teleports stay on the shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeGuard, cast

import torch
from torch import Tensor, nn

from teleopt.numerics import read_together

__all__ = [
    "is_sharded",
    "local",
    "full",
    "shard_like",
    "replicate_like",
    "from_local_like",
    "sharded_dims",
    "shard_placement_fn",
    "write_",
    "total_sum",
    "square_sum",
    "square_sums",
    "sum_over",
    "sharded_module",
    "unsharded_copy",
    "unsupported_layout",
    "reshard",
    "CommunicatedBytes",
]

try:  # torch built without distributed support has no DTensor
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]
    distribute_tensor = None  # type: ignore[assignment]


def is_sharded(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter, its gradient or optimizer state)."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor`` (a view: in-place changes reach it), else ``t`` itself."""
    if is_sharded(t):
        with torch.no_grad():  # outside autograd to_local returns the local tensor itself, not a copy
            return t.to_local()
    return t


def full(t: Tensor) -> Tensor:
    """The whole tensor as an ordinary tensor (all-gathers a ``DTensor``: a collective), else ``t`` itself."""
    if is_sharded(t):
        with torch.no_grad():
            return t.full_tensor()
    return t


def shard_like(value: Tensor, like: Tensor) -> Tensor:
    """``value`` (a whole tensor of ``like``'s global shape, identical on every rank) laid out like ``like``.

    For a ``DTensor`` ``like`` each rank keeps its own shard of ``value`` (no
    communication: every rank holds the whole value); otherwise ``value`` itself.
    """
    if is_sharded(like):
        if tuple(value.shape) != tuple(like.shape):
            raise ValueError(f"cannot shard a tensor of shape {tuple(value.shape)} like one of shape {tuple(like.shape)}")
        return distribute_tensor(value.detach(), like.device_mesh, like.placements, src_data_rank=None)
    return value


def from_local_like(value: Tensor, like: Tensor, contiguous: bool = False) -> Tensor:
    """A local shard ``value`` (shaped like ``like``'s local shard) as a tensor laid out like ``like``.

    For a ``DTensor`` ``like``: a ``DTensor`` with its mesh, placements, global shape
    and stride (``contiguous``: the row-major stride of that shape, for a freshly computed
    contiguous ``value`` when ``like`` is a strided view), sharing ``value``'s storage;
    otherwise ``value`` itself.
    """
    if is_sharded(like):
        stride = torch.empty(like.shape, device="meta").stride() if contiguous else like.stride()
        return DTensor.from_local(value, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=stride)
    return value


def replicate_like(value: Tensor, like: Tensor) -> Tensor:
    """``value`` (identical on every rank) as a replicated ``DTensor`` on ``like``'s mesh, so that
    arithmetic with ``like``'s shards stays local; ``value`` itself when ``like`` is not sharded."""
    if is_sharded(like):
        from torch.distributed.tensor import Replicate

        mesh = like.device_mesh
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value


def sharded_dims(t: Tensor) -> set[int]:
    """The dimensions of ``t`` that some mesh dimension shards (empty for an ordinary tensor)."""
    if not is_sharded(t):
        return set()
    from torch.distributed.tensor import Shard

    return {p.dim % t.ndim for p in t.placements if isinstance(p, Shard)}


def shard_placement_fn(module: nn.Module, sites: Iterable[Any]) -> Callable[[nn.Parameter], Any]:
    """A ``shard_placement_fn`` for ``fully_shard`` under which matrix-group teleports stay on the shards.

    FSDP2 shards every parameter along dim 0 by default.  A matrix group (GL per attention head, a
    LoRA rank, ``gl_linear``) acting on the rows of a weight mixes rows that different ranks hold, so
    a teleport of such a site would gather the weight whole.  Sharded along dim 1 instead, every rank
    holds whole rows of its columns: the search reduces them to k x k Gram matrices (summed over
    ranks, O(k^2) bytes per block) and each rank moves its own columns.  This returns a function that
    gives ``Shard(1)`` for every parameter of ``module`` with at least two dimensions whose dim 0 a
    matrix-group site in ``sites`` (``Site`` objects, e.g. ``find_symmetries(model, x).sites`` on the
    unsharded model) acts on, and ``None`` (FSDP2's default, ``Shard(0)``) for the rest::

        fn = teleopt.sharding.shard_placement_fn(model, sites)
        for block in model.blocks:
            fully_shard(block, shard_placement_fn=fn)
        fully_shard(model, shard_placement_fn=fn)

    1-D members acted on along their only axis (biases) stay on ``Shard(0)`` and are gathered for
    the teleport (O(units)).
    """
    from torch.distributed.tensor import Shard

    params = dict(module.named_parameters())
    rows: set[int] = set()
    for site in sites:
        if not (hasattr(site, "action") and hasattr(site, "members")):
            raise TypeError(
                f"shard_placement_fn needs teleopt Site objects (e.g. find_symmetries(model, x).sites), got {type(site).__name__}"
            )
        members = [None if n is None else params.get(n) for n in site.members]
        group = site.action.group(tuple(members))
        for member, p in zip(getattr(site.action, "members", ()), members):
            if p is not None and p.ndim >= 2 and member.axis % p.ndim == 0 and group.block_size is not None:
                rows.add(id(p))

    def placement(param: nn.Parameter) -> Any:
        return Shard(1) if id(param) in rows else None

    return placement


@torch.no_grad()
def write_(dst: Tensor, value: Tensor) -> None:
    """Copy the whole tensor ``value`` into ``dst`` in place; a sharded ``dst`` takes only its shard
    (with no communication when ``value`` is laid out like ``dst`` already)."""
    if is_sharded(dst):
        if is_sharded(value) and value.shape == dst.shape and value.placements == dst.placements and value.device_mesh == dst.device_mesh:
            local(dst).copy_(local(value))
            return
        local(dst).copy_(local(shard_like(full(value), dst)))
    else:
        dst.copy_(value)


@torch.no_grad()
def total_sum(parts: Iterable[tuple[Tensor, Tensor]]) -> float:
    """Sum of ``(partial, tensor)`` pairs: ``partial`` a scalar computed on ``local(tensor)``.

    The partial sums of ``DTensor``s are all-reduced over the mesh dimensions that
    shard them (one all-reduce per mesh and layout, not per tensor; every rank must
    call this with the same tensors in the same order); replicated dimensions are
    counted once, and ordinary tensors add their value as it is.
    """
    total = 0.0
    plain: list[Tensor] = []  # read together: once per device, not once per tensor
    pending: dict[tuple[int, tuple[int, ...]], tuple[Any, tuple[int, ...], Tensor]] = {}
    for partial, t in parts:
        value = partial.detach().to(torch.float64)
        if not is_sharded(t):
            plain.append(value)
            continue
        if any(p.is_partial() for p in t.placements):
            raise ValueError("a DTensor with Partial placements is not a whole tensor; redistribute it first")
        dims = tuple(i for i, p in enumerate(t.placements) if p.is_shard())
        key = (id(t.device_mesh), dims)
        mesh, _, acc = pending.get(key, (t.device_mesh, dims, torch.zeros((), dtype=torch.float64, device=value.device)))
        pending[key] = (mesh, dims, acc + value)
    if pending:
        import torch.distributed as dist

        for mesh, dims, acc in pending.values():
            for dim in dims:
                dist.all_reduce(acc, group=mesh.get_group(dim))
            total += float(acc)
    return total + sum(read_together(plain))


def _square_part(t: Tensor) -> Tensor:
    """The squared norm of ``local(t)`` in float64, accumulated in its own precision (float32 at least)."""
    x = local(t).detach()
    x = x if x.dtype in (torch.float32, torch.float64) or not x.is_floating_point() else x.float()
    return torch.linalg.vector_norm(x).to(torch.float64).square()


def square_sum(tensors: Iterable[Tensor]) -> float:
    """Sum of squares of all entries of ``tensors``, returned in float64 (of the whole tensor for ``DTensor``s:
    :func:`total_sum`).

    Each tensor's norm is accumulated in its own precision (float32 at least), as torch's norms do: a
    float64 copy first converts every entry, at many times the cost of the sum.
    """
    return total_sum((_square_part(t), t) for t in tensors)


def square_sums(tensors: Sequence[Tensor]) -> list[float]:
    """:func:`square_sum` of each tensor on its own, the plain ones read together (one device synchronisation
    per device, :func:`~teleopt.numerics.read_together`), each ``DTensor`` summed over its ranks."""
    plain = [i for i, t in enumerate(tensors) if not is_sharded(t)]
    values = dict(zip(plain, read_together([_square_part(tensors[i]) for i in plain])))
    return [values[i] if i in values else square_sum([t]) for i, t in enumerate(tensors)]


def sum_over(t: Tensor, dims: Sequence[int]) -> Tensor:
    """``t.sum(dim=dims)`` (``t`` itself for no dims), faster on the CPU for a plain tensor.

    Each run of consecutive summed dimensions is reduced separately, the outermost first: summing leading
    dimensions adds whole rows (vectorised), and the inner runs are then short.  ``DTensor``s sum as
    ``DTensor``s (a reshape would redistribute them).
    """
    dims = sorted({d % t.ndim for d in dims}) if t.ndim else []
    if not dims:
        return t
    if is_sharded(t):
        return t.sum(dim=dims)
    runs: list[list[int]] = []
    for d in dims:
        if runs and runs[-1][-1] == d - 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    out, removed = t, 0
    for run in runs:
        start, stop = run[0] - removed, run[-1] - removed + 1
        shape = tuple(out.shape)
        prefix, size, suffix = math.prod(shape[:start]), math.prod(shape[start:stop]), math.prod(shape[stop:])
        out = out.reshape(prefix, size, suffix).sum(dim=1).reshape(shape[:start] + shape[stop:])
        removed += len(run)
    return out


def sharded_module(module: nn.Module) -> bool:
    """Whether ``module`` has ``DTensor`` parameters (``fully_shard``, FSDP2)."""
    return any(is_sharded(p) for p in module.parameters())


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@torch.no_grad()
def unsharded_copy(module: nn.Module, _memo: dict[int, Any] | None = None) -> nn.Module:
    """An unsharded twin of an FSDP2 ``module`` for work that needs the whole module once (symmetry detection).

    Every submodule becomes an instance of its own class again (``fully_shard`` swaps in
    an ``FSDP<Class>`` subclass), with the same attributes, whole copies of its parameters
    (gathered: a collective, every rank must call this) and clones of its buffers;
    parameter and module names are the original's, and a parameter or module that
    appears twice (tied weights) is one object in the copy too.  Hooks are not copied
    (FSDP2's own are hooks; a user hook that changes what a module computes is not seen).
    Costs the model's full size in memory and one all-gather of it; the original is not
    touched.
    """
    memo: dict[int, Any] = {} if _memo is None else _memo
    if id(module) in memo:
        return cast(nn.Module, memo[id(module)])
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()  # type: ignore[assignment,misc]
    cls = next(c for c in type(module).__mro__ if not (isinstance(FSDPModule, type) and issubclass(c, FSDPModule)))
    twin = cast(nn.Module, object.__new__(cls))  # FSDP's classes re-run __init__ in __new__; the state is copied below
    memo[id(module)] = twin
    twin.__dict__.update(module.__dict__)
    for key in _HOOK_DICTS:
        if key in twin.__dict__:
            twin.__dict__[key] = type(module.__dict__[key])()
    if "_non_persistent_buffers_set" in twin.__dict__:
        twin.__dict__["_non_persistent_buffers_set"] = set(module.__dict__["_non_persistent_buffers_set"])

    def whole(t: Tensor | None, parameter: bool) -> Tensor | None:
        if t is None:
            return None
        if id(t) not in memo:
            value = full(t).detach().clone()
            memo[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if parameter else value
        return cast(Tensor, memo[id(t)])

    twin.__dict__["_parameters"] = {n: whole(p, True) for n, p in module._parameters.items()}
    twin.__dict__["_buffers"] = {n: whole(b, False) for n, b in module._buffers.items()}
    twin.__dict__["_modules"] = {n: None if c is None else unsharded_copy(c, memo) for n, c in module._modules.items()}
    return twin


def unsupported_layout(module: nn.Module) -> str | None:
    """Why ``module``'s ``DTensor`` parameters are laid out in a way a teleport does not support (``None``:
    supported).  Supported: FSDP2 on a 1-D mesh, ``Shard(0)`` by default or another dimension chosen by
    ``fully_shard(shard_placement_fn=...)`` (:func:`shard_placement_fn`); refused: 2-D meshes (HSDP, FSDP
    with tensor parallelism), ``Replicate``, and sharded parameters no ``fully_shard`` manages (tensor
    parallelism, whose ranks compute on their shards)."""
    managed = _fsdp_managed(module)
    for name, p in module.named_parameters():
        if not is_sharded(p):
            continue
        if p.device_mesh.ndim != 1:
            return f"{name!r} on a {p.device_mesh.ndim}-D device mesh (HSDP or tensor parallelism); 1-D FSDP2 meshes only"
        if not p.placements[0].is_shard():
            return f"{name!r} placed {p.placements}; FSDP2's sharded placements only"
        if name not in managed:
            return f"{name!r} placed {p.placements} outside any fully_shard module (tensor parallelism?); FSDP2 only"
    return None


def _fsdp_managed(module: nn.Module) -> set[str]:
    """Names of the parameters of ``module`` that lie inside a ``fully_shard`` module (itself or an ancestor)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return set()
    managed: set[str] = set()
    for prefix, m in module.named_modules():
        if isinstance(m, FSDPModule):
            managed.update(f"{prefix}.{n}" if prefix else n for n, _ in module.get_submodule(prefix).named_parameters())
    return managed


def reshard(module: nn.Module) -> None:
    """Reshard every FSDP2 submodule of ``module`` (no-op elsewhere).

    FSDP2 keeps the root module's parameters unsharded after a forward pass
    without backward (``torch.no_grad`` evaluation).  While they are, the
    registered parameters are the unsharded tensors, and in-place changes of the
    sharded ones (an optimizer step, a teleport) would not reach the next forward
    pass.  The wrappers reshard after every pass they make.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
#: operators that send data (not waits, receives, barriers or the functional collectives' autograd wrapper)
_SENDING = {
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "broadcast",
    "allreduce_",
    "allreduce_coalesced_",
    "allgather_",
    "_allgather_base_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
    "alltoall_",
    "alltoall_base_",
    "broadcast_",
    "reduce_",
    "gather_",
    "scatter_",
    "send",
}
_SENT_ARGUMENTS = ("tensors", "input_tensors", "input_tensor", "input", "inputs", "tensor")


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class CommunicatedBytes:
    """Count the bytes this rank hands to collectives while inside (``with CommunicatedBytes() as c``).

    Every ``torch.distributed`` collective (``all_reduce``, ``broadcast``, ``all_gather``, ...)
    and every functional collective (what ``DTensor`` redistributions use) goes through the
    dispatcher; a dispatch mode adds the sizes of the tensors each call sends (its input
    arguments, not its output buffers; waits, receives and barriers are not counted).
    ``bytes`` is the total, ``calls`` the count per operator.  What a collective moves over
    the wire depends on the algorithm (a ring all-reduce sends about twice its input); this
    counts the input.  Collectives a ``DTensor`` operator runs inside its own dispatch (an
    implicit redistribution in ``x + y``) are not seen (a dispatch mode is off there);
    explicit ones (``full_tensor()``, ``redistribute()``) are.
    """

    def __init__(self) -> None:
        from collections import Counter

        self.bytes = 0
        self.calls: Counter[str] = Counter()
        self._mode: Any = None

    def __enter__(self) -> CommunicatedBytes:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if func.namespace in _COLLECTIVE_NAMESPACES and func.overloadpacket.__name__ in _SENDING:
                    sent = 0
                    for i, arg in enumerate(func._schema.arguments):
                        value = args[i] if i < len(args) else kwargs.get(arg.name)
                        if arg.name in _SENT_ARGUMENTS:
                            sent += _tensor_bytes(value)
                    counter.bytes += sent
                    counter.calls[str(func.overloadpacket.__name__)] += 1
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
