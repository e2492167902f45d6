"""The fast path: teleport objectives over group coordinates with no pass of the model.

For an exact site whose action has a constant Jacobian J (linear or affine), the
gradient at g . w is (J^{-1})^T times the gradient at w (Zhao 2026, Prop. 4.5.1,
eq. 4.19).  The gradient of the current batch is already in ``.grad`` when the
optimizer steps, so Algorithm 1's objective ||grad L(g . w)||^2 is a closed-form
function of the group coordinates: no forward or backward pass is needed.

It is cheaper still after a one-off reduction of every gradient tensor to the
group's size (:class:`GradientNormModel`):

* a tensor acted on by diagonal groups only (positive scalings, on one or several
  axes): the sums of squares over the other axes, S; then
  ||grad'||^2 = sum S * prod_k c_k^{-2 p_k} (the group's
  :meth:`~teleopt.groups.Group.square_factor`);
* a tensor acted on by one matrix group on one axis: the Gram matrix K = G G^T of
  that axis; then ||A G||^2 = tr(A K A^T) with A the contragredient
  representation of g (g^{-T} for writers, g for readers);
* anything else (slices of fused tensors, two matrix groups on one tensor,
  affine actions such as the Booth rotation): the tensors of its connected
  component are transported explicitly with ``action.transport_gradient``.

Each ascent step then costs O(h^2)-O(h^3) in the group size h, not O(#params).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction, Member
from teleopt.actions.base import GroupAction
from teleopt.groups import Group
from teleopt.sharding import full, is_sharded, local, replicate_like, sharded_dims, square_sum, sum_over, write_
from teleopt.site import Site
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.distributed import is_distributed
from teleopt.teleport.state_policy import StatePolicy
from teleopt.teleport.transport import transport, transport_

__all__ = ["GradientNormModel", "FastEvaluator", "fast_path_eligible", "member_tensors"]


def member_tensors(site: Site, tensors: Mapping[str, Tensor]) -> tuple[Tensor | None, ...]:
    """The member tensors of ``site`` looked up by name in ``tensors``."""
    return tuple(None if n is None else tensors[n] for n in site.members)


def fast_path_eligible(site: Site) -> bool:
    """Whether ``site`` can take the fast path: exact, data-independent, continuous, constant Jacobian."""
    action = site.action
    return action.exactness == "exact" and not action.needs_data and action.continuous and bool(action.has_gradient_transport)


def _components(sites: Sequence[Site], names: set[str]) -> list[tuple[list[int], list[str]]]:
    """Connected components of the site--tensor graph restricted to tensors in ``names``."""
    parent = list(range(len(sites)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, site in enumerate(sites):
        for n in site.tensor_names:
            if n not in names:
                continue
            if n in owner:
                parent[find(i)] = find(owner[n])
            else:
                owner[n] = i
    comps: dict[int, tuple[list[int], list[str]]] = {}
    for i in range(len(sites)):
        comps.setdefault(find(i), ([], []))[0].append(i)
    for n, i in owner.items():
        comps[find(i)][1].append(n)
    return [c for c in comps.values() if c[1]]


class _Reduced:
    """One gradient tensor reduced to its group axes (see module docs)."""

    def __init__(self, name: str, grad: Tensor, entries: list[tuple[int, Member, Group]], host: bool = False) -> None:
        self.name = name
        self.entries = entries
        self.site_ids = {i for i, _, _ in entries}
        g = grad.detach()
        axes = [m.axis % grad.ndim for _, m, _ in entries]
        if all(_diagonal(grp) for _, _, grp in entries):
            self.kind = "scaling"
            other = [d for d in range(grad.ndim) if d not in axes]
            # float64 gradients keep float64 statistics; others are squared and summed in float32, which halves
            # the memory the search reads each evaluation (a search needs no more; the teleport's exactness
            # comes from the group action, not from S).  A sharded (FSDP2) gradient reduces on its shards;
            # gathering S costs O(units), not O(parameters).
            sq = g.to(torch.float64 if g.dtype == torch.float64 else torch.float32).square()
            S = full(sum_over(sq, other))
            # S has the acted axes in increasing order; remember where each entry's axis went
            order = sorted(axes)
            self.positions = [order.index(a) for a in axes]
            self.S = S
        else:
            (_, member, grp) = entries[0]
            # the acted part as (..., n, ...) with outer/inner blocks split off (one element acts on each);
            # sharded (FSDP2) along another axis: each rank's Gram matrix of its shard, summed over ranks
            # (O(k^2) bytes per block); sharded along the acted axis (a bias): gathered whole
            sharded = is_sharded(g) and axes[0] not in sharded_dims(g)
            view, axis = member.part_view(g if sharded else full(g))
            part = local(view)  # the rank's shard of the view (outside autograd), or the view itself
            flat = part.to(torch.float64).movedim(axis, 0).reshape(view.shape[axis], -1)
            n = grp.block_size
            if n is not None:
                # a block-diagonal representation only sees the diagonal blocks of G G^T:
                # ||A G||^2 = sum_b tr(A_b K_b A_b^T), K_b = G_b G_b^T (blocks x n x n)
                self.kind = "blocks"
                rows = flat.reshape(-1, n, flat.shape[1])
                self.K = _summed(rows @ rows.mT, g if sharded else None)
            else:
                self.kind = "matrix"
                self.K = _summed(flat @ flat.T, g if sharded else None)
            if host:  # the search's small matrices on the CPU (FastEvaluator.search_device)
                self.K = self.K.cpu()
            if self.kind == "matrix":
                self.eye = torch.eye(grp.dim, dtype=torch.float64, device=self.K.device)
        # S in its dtype, as value() contracts it (a float64 sum of a float32 S converted every entry: 16 ms vs 0.2 ms)
        self.identity_value = float(self.S.sum() if self.kind == "scaling" else self.K.diagonal(dim1=-2, dim2=-1).sum())

    def value(self, elements: Sequence[Tensor], cache: dict[tuple[int, float], Tensor] | None = None) -> Tensor:
        """The term at ``elements``; ``cache`` shares each element's block matrices between the terms of one
        evaluation (a GL site's contragredient is one solve however many tensors it acts on)."""
        if self.kind == "scaling":
            # sum S * prod_k c_k^{-2 p_k} as one contraction (a matrix-vector product for two axes)
            letters = "abcdefghij"[: self.S.ndim]
            factors = [_square_factor(grp, elements[i], -member.power).to(self.S) for i, member, grp in self.entries]
            spec = letters + "," + ",".join(letters[pos] for pos in self.positions) + "->"
            return torch.einsum(spec, self.S, *factors).to(torch.float64)
        (i, member, grp) = self.entries[0]
        if self.kind == "blocks":
            key = (i, -member.power)
            A = None if cache is None else cache.get(key)
            if A is None:
                A = grp.block_matrices(elements[i], -member.power)
                assert A is not None  # kind "blocks"
                if cache is not None:
                    cache[key] = A
            return ((A @ self.K) * A).sum()
        A = grp.act_on_axis(elements[i], self.eye, 0, -member.power)
        return ((A @ self.K) * A).sum()


def _summed(local_part: Tensor, like: Tensor | None) -> Tensor:
    """``local_part`` summed over the ranks that shard ``like`` (an all-reduce), or itself (``like`` None)."""
    if like is None:
        return local_part
    from torch.distributed.tensor import DTensor, Partial

    assert is_sharded(like)

    mesh = like.device_mesh
    return DTensor.from_local(local_part, mesh, [Partial()] * mesh.ndim, run_check=False).full_tensor()


def _plain(member: Member) -> bool:
    """A member acting on a whole axis (no slice, no outer/inner view, no grouped layout)."""
    return member.start is None and all(getattr(member, f, 1) == 1 for f in ("outer", "inner", "groups"))


def _sliced(entries: list[tuple[int, Member, Group]], ndim: int) -> bool:
    """Whether the entries act on disjoint slices ``[start, stop)`` of one axis, one group each, no other
    layout (the q, k and v rows of a fused qkv projection): each slice then reduces on its own."""
    if not entries or any(m.start is None or m.outer != 1 or m.inner != 1 or m.groups != 1 for _, m, _ in entries):
        return False
    if len({m.axis % ndim for _, m, _ in entries}) != 1:
        return False
    spans = sorted((m.start or 0, m.stop or 0) for _, m, _ in entries)  # every start and stop is set (checked above)
    return all(stop <= nxt for (_, stop), (nxt, _) in zip(spans, spans[1:]))


def _reducible(entries: list[tuple[int, Member, Group]], ndim: int) -> bool:
    if _sliced(entries, ndim):
        return True
    if len(entries) == 1 and not _diagonal(entries[0][2]):  # one matrix group: its part view reduces (outer/inner)
        member = entries[0][1]
        return member.start is None and member.groups == 1
    if not all(_plain(m) for _, m, _ in entries):
        return False
    axes = [m.axis % ndim for _, m, _ in entries]
    if len(set(axes)) != len(axes):
        return False
    if len(entries) == 1:
        return True
    return all(_diagonal(grp) for _, _, grp in entries)


def _diagonal(group: Group) -> bool:
    """Whether the group's representation on an axis is diagonal (it has a square factor)."""
    return group.square_factor(group.identity(), 1.0) is not None


def _square_factor(group: Group, g: Tensor, power: float) -> Tensor:
    factor = group.square_factor(g, power)
    assert factor is not None, "only diagonal groups are reduced to sums of squares"
    return factor


_Entries = dict[str, list[tuple[int, Member, Group]]]


def _plan(
    sites: Sequence[Site], groups: Sequence[Group], grads: Mapping[str, Tensor]
) -> list[tuple[list[int], list[str], _Entries | None]]:
    """Connected components of the sites over the tensors in ``grads``: (site indices, tensor names,
    entries per tensor when every tensor reduces to its group axes, else ``None``)."""
    out: list[tuple[list[int], list[str], _Entries | None]] = []
    for site_ids, names in _components(sites, set(grads)):
        entries: _Entries = {n: [] for n in names}
        axis_only = all(isinstance(sites[i].action, AxisAction) for i in site_ids)
        if axis_only:
            for i in site_ids:
                action = sites[i].action
                assert isinstance(action, AxisAction)  # axis_only
                for member, n in zip(action.members, sites[i].members):
                    if n in entries:
                        entries[n].append((i, member, groups[i]))
        reducible = axis_only and all(_reducible(entries[n], grads[n].ndim) for n in names)
        out.append((site_ids, names, entries if reducible else None))
    return out


class GradientNormModel:
    """||grad L(g . w)||^2 over the sites' tensors as a function of the elements (no model pass).

    Parameters
    ----------
    sites:
        Fast-path sites (:func:`fast_path_eligible`), in composition order.
    grads:
        Gradient at w of every site member that has one (tensor name -> gradient).
    like:
        Every site member (tensor name -> live tensor), for shapes.
    host:
        Keep the search's small matrices (GL Gram blocks, identities) on the CPU when a site is not
        diagonal (:attr:`host` says whether it does).
    """

    def __init__(self, sites: Sequence[Site], grads: Mapping[str, Tensor], like: Mapping[str, Tensor], host: bool = False) -> None:
        self.sites = list(sites)
        self.groups = [site.action.group(member_tensors(site, like)) for site in self.sites]
        self.host = host and not all(_diagonal(g) for g in self.groups)
        self.reduced: list[_Reduced] = []
        self.explicit: list[tuple[list[int], dict[str, Tensor]]] = []
        #: per tensor with sliced entries, the squared norm of its gradient outside every slice (no site moves it)
        self.remainders: list[tuple[str, float]] = []
        for site_ids, names, entries in _plan(self.sites, self.groups, grads):
            if entries is not None:
                for n in names:
                    self._reduce(n, grads[n], entries[n])
            else:
                self.explicit.append((site_ids, {n: grads[n] for n in names}))
        self.like = like
        self.explicit_identity = [sum(float(torch.linalg.vector_norm(t)) ** 2 for t in g.values()) for _, g in self.explicit]
        device = torch.device("cpu") if self.host else next(iter(grads.values())).device if grads else None
        self.identities = [grp.identity(dtype=torch.float64, device=device) for grp in self.groups]

    def _reduce(self, name: str, grad: Tensor, entries: list[tuple[int, Member, Group]]) -> None:
        """One tensor's reduced terms: the whole tensor, or one term per slice plus the remainder."""
        if not _sliced(entries, grad.ndim):
            self.reduced.append(_Reduced(name, grad, entries, self.host))
            return
        g = grad.detach()
        axis = entries[0][1].axis % g.ndim  # one axis for every slice (_sliced)
        if axis in sharded_dims(g):  # slices of a sharded axis (FSDP2 rows): gathered; else each rank its shard
            g = full(g)
        covered = 0.0
        for entry in entries:
            member = entry[1]
            assert member.start is not None and member.stop is not None  # _sliced
            part = g.narrow(axis, member.start, member.stop - member.start)
            plain = Member(member.name, member.axis, member.power)
            term = _Reduced(name, part, [(entry[0], plain, entry[2])], self.host)
            self.reduced.append(term)
            covered += term.identity_value
        self.remainders.append((name, max(square_sum([g]) - covered, 0.0)))

    def site_value(self, index: int, element: Tensor) -> float:
        """The value when only site ``index`` moves (by ``element``); every other site at the identity."""
        total = 0.0
        elements = [element if i == index else e for i, e in enumerate(self.identities)]
        cache: dict[tuple[int, float], Tensor] = {}
        for r in self.reduced:
            total += float(r.value(elements, cache)) if index in r.site_ids else r.identity_value
        total += sum(rest for _, rest in self.remainders)
        for (site_ids, grads), still in zip(self.explicit, self.explicit_identity):
            if index in site_ids:
                moved, _ = transport([self.sites[index]], [element], grads, self.like, "covector")
                total += sum(float(t.to(torch.float64).square().sum()) for t in moved.values())
            else:
                total += still
        return total

    def value(self, elements: Sequence[Tensor], weights: Mapping[str, float] | None = None) -> Tensor:
        """Sum over the sites' tensors of the squared transported gradient (float64),
        each tensor's term multiplied by ``weights[name]`` when given (e.g. its learning rate)."""
        total = torch.zeros((), dtype=torch.float64, device=elements[0].device if elements else None)
        cache: dict[tuple[int, float], Tensor] = {}
        for r in self.reduced:
            term = r.value(elements, cache).to(total.device)  # a scaling term stays on its gradient's device
            total = total + (term if weights is None else weights[r.name] * term)
        for name, rest in self.remainders:
            total = total + (rest if weights is None else weights[name] * rest)
        for site_ids, grads in self.explicit:
            moved, _ = transport([self.sites[i] for i in site_ids], [elements[i] for i in site_ids], grads, self.like, "covector")
            for n, t in moved.items():
                term = t.to(torch.float64).square().sum().to(total.device)
                total = total + (term if weights is None else weights[n] * term)
        return total


class FastEvaluator:
    """Teleport quantities at g . w for fast-path sites, from ``.grad`` alone (see module docs).

    Parameters
    ----------
    sites:
        Fast-path sites in composition order.
    ctx:
        The model/optimizer view of this teleport.
    with_decrease:
        Whether :meth:`first_order_decrease` will be needed (precomputes the
        constant part over parameters no site touches).

    Sharded (FSDP2 ``DTensor``) site members take one of two routes (every rank
    builds the evaluator: both are collective):

    * **on the shards** (:attr:`on_shards`), when every site is a diagonal axis
      action (positive scalings, BatchNorm/LayerScale outputs, signs) on whole axes
      of sharded members, or a matrix group (GL per head, ``gl_linear``) acting on
      axes of its members that no mesh dimension shards (FSDP2 shards dim 0: the
      columns of an output projection; the rows of q, k, v weights once
      :func:`~teleopt.sharding.shard_placement_fn` shards them along dim 1): the
      gradient statistics are reduced on each rank's shard and only the reductions
      are communicated (O(units) per tensor acted on one axis by a diagonal group,
      a k x k Gram matrix per GL block; a tensor acted on two axes, between two
      chained sites, sends its squared gradient, the tensor's size once; a 1-D
      member acted on along its sharded axis, a bias, is gathered: O(units)), and
      :meth:`apply` moves each rank's shards of the parameters, gradients and
      optimizer state with no communication (``DTensor`` arithmetic by the
      replicated elements, or each rank's local shard for matrix groups);
    * **gathered** otherwise (a matrix group on a sharded axis, slices of fused tensors): the site
      members, their gradients and optimizer state are gathered whole on every rank
      (``full_tensor()``), searched and moved identically everywhere, and each rank
      writes its own shard back; extra memory and communication are the whole size
      of those tensors.

    Parameters outside the sites stay sharded (their constant terms are summed over
    ranks).  Unsharded tensors are used as they are, without copies.
    """

    path = "fast"
    moves_gradients = True

    def __init__(self, sites: Sequence[Site], ctx: TeleportContext, with_decrease: bool = False) -> None:
        self.sites = list(sites)
        self.ctx = ctx
        names = sorted({n for site in self.sites for n in site.tensor_names})  # the same gather order on every rank
        self.live = {n: ctx.tensors[n] for n in names}
        grads = ctx.grads(names)
        gathered = _on_shards(self.sites, self.live, grads)
        self.on_shards = gathered is not None
        if gathered is not None:  # FSDP2: everything stays sharded but small members on a sharded axis (class docs)
            self.like = {n: full(t) if n in gathered else t.detach() for n, t in self.live.items()}
            self.grads = {n: full(g) if n in gathered else g for n, g in grads.items()}
            self.states = {
                n: {k: full(v) if n in gathered and isinstance(v, Tensor) else v for k, v in st.items()}
                for n, st in ctx.states(names).items()
            }
        else:
            self.like = {n: full(t) for n, t in self.live.items()}
            self.grads = {n: full(g) for n, g in grads.items()}
            self.states = {n: {k: full(v) if isinstance(v, Tensor) else v for k, v in st.items()} for n, st in ctx.states(names).items()}
        device = next(iter(self.like.values())).device
        # GL sites' search (Gram matrices, exp, solves, SVDs of n x n blocks) runs on the host for an accelerator
        # model: there each is a kernel launch, most synchronise.  Not when sharded (its collectives need the device).
        host = device.type != "cpu" and not self.on_shards and not is_distributed()
        self.norm_model = GradientNormModel(self.sites, self.grads, self.like, host)
        self.search_device = torch.device("cpu") if self.norm_model.host else device
        self.groups = self.norm_model.groups
        self._own_exp = [type(site.action).exp is not GroupAction.exp for site in self.sites]
        self.other_sq, self.other_decrease = ctx.constant_terms(set(names), with_decrease)

    def _plain_sgd_lrs(self) -> dict[str, float] | None:
        """Learning rate per site tensor if every site parameter is updated by plain SGD, else None."""
        ctx = self.ctx
        if ctx.model.family != "sgd":
            return None
        lrs = {}
        for name in self.grads:
            group = ctx.groups[name]
            if group.get("momentum", 0) or group.get("weight_decay", 0) or group.get("maximize", False):
                return None
            lrs[name] = float(group["lr"])
        return lrs

    def elements(self, coords: Sequence[Tensor]) -> list[Tensor]:
        """exp of each site's coordinates (groups built once unless an action overrides ``exp``).

        Coordinates outside autograd equal to the last call's return its elements (not for actions with their
        own ``exp``, which reads the moving members): a teleport asks for its chosen point's elements in the
        line search, the caps and the report (on vit_tiny, 72 ``matrix_exp`` of 64 x 64 blocks each time).
        """
        tracked = any(xi.requires_grad for xi in coords) or any(self._own_exp)  # an action's exp reads the members
        memo = self.__dict__.get("_elements_memo")
        if not tracked and memo is not None and len(memo[0]) == len(coords):
            if all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(memo[0], coords)):
                return list(memo[1])
        out = [
            site.action.exp(xi, member_tensors(site, self.like)) if own else group.exp(xi)
            for site, group, xi, own in zip(self.sites, self.groups, coords, self._own_exp)
        ]
        if not tracked and not any(e.requires_grad for e in out):
            self.__dict__["_elements_memo"] = ([xi.detach().clone() for xi in coords], out)
        return out

    def grad_norm_sq(self, elements: Sequence[Tensor]) -> Tensor:
        """||grad L(g . w)||^2 over all trainable parameters (float64)."""
        return self.norm_model.value(elements) + self.other_sq

    def site_gain(self, index: int, element: Tensor, n0: float) -> float:
        """||grad L||^2 ratio when only site ``index`` moves by ``element`` (the others stay at the identity)."""
        return (self.norm_model.site_value(index, element) + self.other_sq) / n0

    def site_gains(self, elements: Sequence[Tensor], n0: float) -> dict[str, float | None]:
        """Per site: :meth:`site_gain` of its element (``None`` when the gradient is zero)."""
        if n0 == 0:
            return {s.name: None for s in self.sites}
        return {s.name: self.site_gain(i, e, n0) for i, (s, e) in enumerate(zip(self.sites, elements))}

    def _placed(self, elements: Sequence[Tensor]) -> list[Tensor]:
        """The elements as the sharded members need them: replicated ``DTensor``s on each site's mesh
        when working on the shards (so ``DTensor`` arithmetic moves each rank's shard locally)."""
        if not self.on_shards:
            return list(elements)
        # matrix groups move each rank's local shard themselves (Group.act_on_axis on a DTensor)
        return [
            replicate_like(g, next(self.like[n] for n in site.tensor_names)) if _diagonal(group) else g
            for site, group, g in zip(self.sites, self.groups, elements)
        ]

    @torch.no_grad()
    def apply(self, elements: Sequence[Tensor]) -> Counter[str]:
        """Move the site members, their ``.grad`` and optimizer state to g . w in place (closed form).

        Diagonal sites on whole axes of unsharded tensors are applied in place
        (:func:`~teleopt.teleport.transport.transport_`: each tensor multiplied by its
        factors, bitwise the out-of-place result, no copies).  Otherwise the moved
        tensors are computed whole and written into the live ones (a sharded live
        tensor takes its own shard), one kind at a time: gradients, then optimizer
        state, then the parameters (which the other two read as ``like``), so at most
        one kind's moved copies are alive at once.
        """
        ctx, sites, like = self.ctx, self.sites, self.like
        for site, g in zip(sites, elements):  # before anything is written: an invalid element moves nothing
            site.action.validate_element(g, member_tensors(site, like))
        elements = self._placed(elements)
        # grads, state and like are the live tensors (unsharded, or FSDP2 on the shards: local DTensor arithmetic)
        in_place = self.on_shards or not any(is_sharded(t) for t in self.live.values())
        if not (in_place and transport_(sites, elements, self.grads, like, "covector")):
            moved_grads, _ = transport(sites, elements, self.grads, like, "covector")
            for n, g in moved_grads.items():
                grad = ctx.trainable[n].grad
                assert grad is not None  # ctx.grads returned only parameters that have one
                write_(grad, g)
            del moved_grads
        moved_state = ctx.policy.move(ctx.optimizer, sites, elements, self.states, like, ctx.groups, in_place=in_place)
        StatePolicy.write(ctx.states(self.live), moved_state)
        decisions = Counter(d for dec in moved_state.decisions.values() for d in dec.values())
        del moved_state
        if not (in_place and transport_(sites, elements, self.live, like, "params")):
            new_params, _ = transport(sites, elements, like, like, "params")
            for n, t in self.live.items():
                write_(t, new_params[n])
        return decisions

    def can_undo(self) -> bool:
        """Whether :meth:`undo` restores ``.grad`` and the optimizer state after :meth:`apply`: the
        tensors are not sharded (the evaluator's copies of sharded ones would be stale) and the state
        policy transports or keeps every entry (:meth:`StatePolicy.invertible`; a reset is not undone)."""
        if any(is_sharded(t) for t in self.live.values()):  # a rollback on shards restores local copies instead
            return False
        return self.ctx.policy.invertible(self.ctx.optimizer, self.states, self.like)

    @torch.no_grad()
    def undo(self, elements: Sequence[Tensor]) -> None:
        """Move ``.grad`` and the optimizer state back from g . w to w: the sites in reverse order, each
        by its inverse element (Zhao 2026, Prop. 4.5.1: the same transport rules, for g^-1).  Exact up
        to round-off (one multiplication by c and one by 1/c, or a solve with a matrix of condition
        number at most e^(2 r) in a trust region r); the parameters are not touched here."""
        ctx = self.ctx
        sites = self.sites[::-1]
        inverses = [site.action.inverse(g) for site, g in zip(sites, elements[::-1])]
        grads, _ = transport(sites, inverses, self.grads, self.like, "covector")
        for n, g in grads.items():
            grad = ctx.trainable[n].grad
            assert grad is not None  # ctx.grads returned only parameters that have one
            write_(grad, g)
        del grads
        StatePolicy.write(ctx.states(self.live), ctx.policy.move(ctx.optimizer, sites, inverses, self.states, self.like, ctx.groups))

    def transported_grads(self, elements: Sequence[Tensor]) -> dict[str, Tensor]:
        """Gradients of the site members at g . w."""
        return transport(self.sites, self._placed(elements), self.grads, self.like, "covector")[0]

    def site_params(self, elements: Sequence[Tensor]) -> dict[str, Tensor]:
        """Site members at g . w."""
        return transport(self.sites, self._placed(elements), self.like, self.like, "params")[0]

    @torch.no_grad()
    def next_step_point(self, elements: Sequence[Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Every trainable parameter at g . w and the base optimizer's diagonal preconditioner there."""
        ctx = self.ctx
        grads = {n: p.grad for n, p in ctx.trainable.items() if p.grad is not None}
        grads.update(self.transported_grads(elements))
        params = {n: p.detach() for n, p in ctx.trainable.items()}
        params.update({n: t for n, t in self.site_params(elements).items() if n in params})
        states = ctx.states(grads)
        mine = {n: s for n, s in states.items() if n in self.like}
        moved = ctx.policy.move(ctx.optimizer, self.sites, self._placed(elements), mine, self.like, ctx.groups)
        P = {}
        for name, g in grads.items():
            state = moved.values.get(name, states.get(name, {}))
            P[name] = ctx.model.preconditioner(ctx.groups[name], params[name], g, state)
        return params, P

    def first_order_decrease(self, elements: Sequence[Tensor]) -> Tensor:
        """<grad, u> of the base optimizer's next step from g . w, summed over all trainable parameters.

        For plain SGD (no momentum, no weight decay) u = lr grad, so this is the
        learning-rate-weighted gradient norm and reuses the reduced model; otherwise
        the gradients, parameters and state are transported explicitly.
        """
        ctx = self.ctx
        lrs = self._plain_sgd_lrs()
        if lrs is not None:
            return self.norm_model.value(elements, lrs) + self.other_decrease
        grads = self.transported_grads(elements)
        params = self.site_params(elements)
        states = {n: self.states[n] for n in grads if n in self.states}
        moved = ctx.policy.move(ctx.optimizer, self.sites, self._placed(elements), states, self.like, ctx.groups)
        total = torch.zeros((), dtype=torch.float64) + self.other_decrease
        for name, g in grads.items():
            state = moved.values.get(name, {})
            u = ctx.model.update(ctx.groups[name], params[name], g, state)
            part = (g.to(torch.float64) * u.to(torch.float64)).sum()
            # sharded: one scalar all-reduce, differentiable in the elements (DTensor autograd; full() is not)
            total = total + (part.full_tensor() if is_sharded(part) else part)
        return total


def _on_shards(sites: Sequence[Site], live: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> set[str] | None:
    """Whether a sharded teleport can stay on the shards (:class:`FastEvaluator`), as the names of the
    members to gather for it (``None``: it cannot).  Every member is a ``DTensor``, every gradient
    reducible, and every site a diagonal axis action on whole axes, or a matrix group (block matrices)
    acting on whole axes (with outer/inner blocks) that no mesh dimension shards, except on 1-D
    members (biases: gathered, O(units)); :func:`~teleopt.sharding.shard_placement_fn` lays the
    row-acted weights out that way."""
    if not live or not all(is_sharded(t) for t in live.values()):
        return None
    if not all(isinstance(site.action, AxisAction) for site in sites):
        return None
    groups = [site.action.group(member_tensors(site, live)) for site in sites]
    gathered: set[str] = set()
    for site, group in zip(sites, groups):
        assert isinstance(site.action, AxisAction)  # checked above
        diagonal = _diagonal(group)
        for member, name in zip(site.action.members, site.members):
            t = None if name is None else live.get(name)
            if name is None or t is None:
                continue
            if member.groups != 1 or (diagonal and not _plain(member)):
                return None  # grouped convolutions, diagonal views and slices: gathered
            if diagonal:
                continue
            if group.block_size is None:
                return None
            if member.axis % t.ndim in sharded_dims(t):
                if t.ndim > 1:
                    return None  # rows of a row-sharded weight: see shard_placement_fn
                gathered.add(name)
    if not all(entries is not None for _, _, entries in _plan(sites, groups, grads)):
        return None
    return gathered
