"""||grad L(g . w)||^2 of fast-path sites as a function of the group elements, with no model pass.

The fast path (:mod:`teleopt.teleport.fast_path`) evaluates it after a one-off reduction of every gradient tensor to the
group's size (:class:`GradientNormModel`):

* a tensor acted on by diagonal groups only (positive scalings, on one or several
  axes): the sums of squares over the other axes, S; then
  ||grad'||^2 = sum S * prod_k c_k^{-2 p_k} (the group's
  :meth:`~teleopt.groups.Group.square_factor`);
* a tensor acted on by one matrix group on one axis: the Gram matrix K = G G^T of
  that axis; then ||A G||^2 = tr(A K A^T) with A the contragredient
  representation of g (g^{-T} for writers, g for readers);
* anything else (slices of fused tensors, two matrix groups on one tensor,
  affine actions such as the Booth rotation, the residual rotation conjugated by
  trainable gains): the tensors of its connected component are transported
  explicitly (:func:`~teleopt.teleport.transport.transport`).

Each ascent step then costs O(h^2)-O(h^3) in the group size h, not O(#params).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction, Member
from teleopt.groups import Group
from teleopt.numerics import read_together
from teleopt.sharding import full, is_sharded, local, sharded_dims, square_sums, sum_over
from teleopt.site import Site
from teleopt.teleport.transport import transport

__all__ = ["GradientNormModel"]


def member_tensors(site: Site, tensors: Mapping[str, Tensor]) -> tuple[Tensor | None, ...]:
    """The member tensors of ``site`` looked up by name in ``tensors``."""
    return tuple(None if n is None else tensors[n] for n in site.members)


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


#: one evaluation's shared values: (site, power) -> block matrices, ("factor", site, power) -> a scaling factor,
#: ("one", site, power) -> whether that factor is 1 everywhere
_Cache = dict[tuple[Any, ...], Any]


class _Reduced:
    """One gradient tensor reduced to its group axes (see module docs)."""

    def __init__(self, name: str, grad: Tensor, entries: list[tuple[int, Member, Group]]) -> None:
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
            g = g.to(torch.float64 if g.dtype == torch.float64 else torch.float32)
            self._g: Tensor | None = None
            S: Tensor | None
            if other and other == list(range(grad.ndim - len(other), grad.ndim)) and not is_sharded(g):
                # trailing axes (the rows of a writer): one pass, no squared copy
                S = torch.linalg.vector_norm(g.flatten(grad.ndim - len(other)), dim=-1).square()
            elif not other and g.ndim == 2 and not is_sharded(g):
                # both axes acted (between two chained sites): S = g^2 would copy the whole gradient (a fresh
                # allocation and a pass over it), so margins and values read g in row chunks; S is made only for
                # autograd away from the identity (the projected ascent), and g must not change meanwhile
                self._g, self._version, S = g, g._version, None
            else:
                S = full(sum_over(g.square(), other))
            # S has the acted axes in increasing order; remember where each entry's axis went
            order = sorted(axes)
            self.positions = [order.index(a) for a in axes]
            self._S = S
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
            if self.kind == "matrix":
                self.eye = torch.eye(grp.dim, dtype=torch.float64, device=self.K.device)
        # S in its dtype, as value() contracts it (a float64 sum of a float32 S would convert every entry first)
        # the term at the identity, read on first use (GradientNormModel reads every term's at once)
        self._identity: Tensor | float = (
            self.K.diagonal(dim1=-2, dim2=-1).sum()
            if self.kind != "scaling"
            else self.margin(0).sum()
            if self._S is None
            else self._S.sum()
        )

    @property
    def identity_value(self) -> float:
        """The term at the identity: tr K, or the sum of S (in S's dtype, read as a float)."""
        if isinstance(self._identity, Tensor):
            self._identity = float(self._identity)
        return self._identity

    @property
    def S(self) -> Tensor:
        """The squared gradient summed over the axes no site acts on (made on first use when kept as g)."""
        if self._S is None:
            self._S = self._gradient().square()
        return self._S

    def _gradient(self) -> Tensor:
        g = self._g
        assert g is not None  # kept instead of S
        if g._version != self._version:
            raise RuntimeError(f"the gradient of {self.name!r} changed after its reduction (the teleport reads it again)")
        return g

    def _rows(self) -> list[Tensor]:
        """The kept gradient in chunks of about 2^19 entries (the squares of a chunk stay in cache)."""
        g = self._gradient()
        return list(g.split(max(1, (1 << 19) // max(1, g.shape[1]))))

    def margin(self, k: int) -> Tensor:
        """S summed over every axis but entry ``k``'s (float64, computed once): d term / d factor_k at the identity."""
        margins = self.__dict__.setdefault("_margins", {})
        if k not in margins:
            pos = self.positions[k]
            if self._S is not None:
                margins[k] = sum_over(self._S, [d for d in range(self._S.ndim) if d != pos]).to(torch.float64)
            elif pos == 0:
                margins[k] = torch.linalg.vector_norm(self._gradient(), dim=1).to(torch.float64).square()
            else:
                margins[k] = torch.stack([c.square().sum(0) for c in self._rows()]).sum(0).to(torch.float64)
        return margins[k]

    def _chunked(self, factors: Sequence[Tensor]) -> Tensor:
        """sum_ab g_ab^2 x_a y_b from the kept g, a chunk of rows at a time (x, y the factors of axes 0 and 1)."""
        by_axis = {self.positions[k]: f for k, f in enumerate(factors)}
        g = self._gradient()
        x, y = (by_axis[d].to(g) for d in (0, 1))
        root = y.sqrt()
        total = torch.zeros((), dtype=torch.float64, device=g.device)
        for rows, xs in zip(self._rows(), x.split(self._rows()[0].shape[0])):
            total += (torch.linalg.vector_norm(rows * root, dim=1).square() @ xs).to(torch.float64)
        return total

    def value(self, elements: Sequence[Tensor], cache: _Cache | None = None) -> Tensor:
        """The term at ``elements``; ``cache`` shares each element's block matrices between the terms of one
        evaluation (a GL site's contragredient is one solve however many tensors it acts on).

        Outside autograd the last value is remembered with the elements it read (kept alive, so their storage
        identifies them): a teleport's per-site gains re-read each term at the chosen point, which its line
        search evaluated (vit_tiny: 72 GL blocks' solves and products)."""
        mine = [elements[i] for i, _, _ in self.entries]
        if any(e.requires_grad for e in mine):
            return self._value(elements, cache)
        key = tuple((e.data_ptr(), tuple(e.shape), e.dtype, e.device, e._version) for e in mine)
        memo = self.__dict__.get("_memo")
        if memo is not None and memo[0] == key:
            return memo[2]
        value = self._value(elements, cache)
        self.__dict__["_memo"] = (key, mine, value)
        return value

    def _value(self, elements: Sequence[Tensor], cache: _Cache | None) -> Tensor:
        if self.kind == "scaling":
            kept = [None if cache is None else cache.get(("factor", i, -member.power)) for i, member, _ in self.entries]
            factors = [
                f if f is not None and not elements[i].requires_grad else _square_factor(grp, elements[i], -member.power)
                for f, (i, member, grp) in zip(kept, self.entries)
            ]
            ones = [None if cache is None else cache.get(("one", i, -member.power)) for i, member, _ in self.entries]
            if any(one is None for one in ones):  # not read ahead with the other terms' (GradientNormModel._read_ones)
                ones = read_together([(f == 1).all() for f in factors])
            moving = [k for k, one in enumerate(ones) if not one]
            if not moving:
                # at the identity: the sum of S and, for autograd, the linearisation there, whose gradient in
                # factor k is S summed over every other axis (a pass over the margins instead of a contraction
                # of S forward and two backward: the search's start and its gradient, Zhao 2026 Algorithm 1)
                # (on the gradient's device: the elements may live on the host, FastEvaluator.search_device)
                device = self.margin(0).device
                linear = [((f - 1).to(device=device, dtype=torch.float64) * self.margin(k)).sum() for k, f in enumerate(factors)]
                return torch.stack(linear).sum() + self.identity_value
            if len(moving) == 1 and not any(f.requires_grad for f in factors):  # one site moves (its gain alone)
                margin = self.margin(moving[0])
                return (factors[moving[0]].to(device=margin.device, dtype=torch.float64) * margin).sum()
            if self._S is None and not any(f.requires_grad for f in factors):
                return self._chunked(factors)
            # sum S * prod_k c_k^{-2 p_k} as one contraction (a matrix-vector product for two axes)
            letters = "abcdefghij"[: self.S.ndim]
            spec = letters + "," + ",".join(letters[pos] for pos in self.positions) + "->"
            return torch.einsum(spec, self.S, *(f.to(self.S) for f in factors)).to(torch.float64)
        (i, member, grp) = self.entries[0]
        g = elements[i]
        if (
            g.dim() >= 2
            and g.shape[-1] == g.shape[-2]
            and torch.equal(g.detach(), torch.eye(g.shape[-1], dtype=g.dtype, device=g.device).expand(g.shape))
        ):
            # at the identity: tr(K) and, for autograd, the linearisation there: d tr(A K A^T) / dg = 2 K for A = g,
            # -2 K for A = g^-T (no solve, no product of the blocks: the search's start and its gradient); O(n)'s
            # contragredient is g itself (Group.block_matrices)
            eye = torch.eye(g.shape[-1], dtype=g.dtype, device=g.device)
            sign = 2.0 if -member.power == 1 or grp.self_dual else -2.0
            return sign * ((g - eye) * self.K).sum() + self.identity_value
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


def _to_host(terms: Sequence[_Reduced], host: torch.device, chunk: int = 1 << 22) -> None:
    """Move the GL terms' Gram matrices to ``host`` for the search (FastEvaluator.search_device): a copy per
    ``chunk`` elements of each dtype and device, not one synchronising copy per term
    (vit_tiny: 72), and never more than a chunk duplicated on the device."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[_Reduced]]] = {}
    for term in terms:
        if term.kind != "scaling" and term.K.device != host:
            batches = groups.setdefault((term.K.device, term.K.dtype), [[]])
            if batches[-1] and sum(t.K.numel() for t in batches[-1]) + term.K.numel() > chunk:
                batches.append([])
            batches[-1].append(term)
    for batch in (b for batches in groups.values() for b in batches):
        flat = torch.cat([t.K.reshape(-1) for t in batch]).to(host)
        for term, K in zip(batch, flat.split([t.K.numel() for t in batch])):
            term.K = K.reshape(term.K.shape)
            if term.kind == "matrix":
                term.eye = torch.eye(term.eye.shape[0], dtype=term.eye.dtype, device=host)


def _read_identities(terms: Sequence[_Reduced]) -> None:
    """Read every term's value at the identity from its device together (:func:`read_together`)."""
    pending = [t for t in terms if isinstance(t._identity, Tensor)]
    for term, value in zip(pending, read_together([t._identity for t in pending if isinstance(t._identity, Tensor)])):
        term._identity = value


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
        Every site member (tensor name -> live tensor) at w: shapes, and the point that covector rules reading
        it take (the residual rotation behind trainable gains, transported explicitly).
    host:
        Keep the search's small matrices (GL Gram blocks, identities) on the CPU when a site is not
        diagonal (:attr:`host` says whether it does).
    groups:
        The sites' groups when the caller made them already (else made here from ``like``).
    """

    def __init__(
        self,
        sites: Sequence[Site],
        grads: Mapping[str, Tensor],
        like: Mapping[str, Tensor],
        host: bool = False,
        groups: Sequence[Group] | None = None,
    ) -> None:
        self.sites = list(sites)
        self.groups = list(groups) if groups is not None else [site.action.group(member_tensors(site, like)) for site in self.sites]
        self.host = host and not all(_diagonal(g) for g in self.groups)
        self.reduced: list[_Reduced] = []
        self.explicit: list[tuple[list[int], dict[str, Tensor]]] = []
        #: per tensor with sliced entries, the squared norm of its gradient outside every slice (no site moves it)
        self.remainders: list[tuple[str, float]] = []
        self._pending: list[tuple[str, Tensor, list[_Reduced]]] = []  # sliced tensors, until the terms are read
        for site_ids, names, entries in _plan(self.sites, self.groups, grads):
            if entries is not None:
                for n in names:
                    self._reduce(n, grads[n], entries[n])
            else:
                self.explicit.append((site_ids, {n: grads[n] for n in names}))
        _read_identities(self.reduced)
        # each sliced tensor's gradient outside its slices: its squared norm less the slices' (read together)
        for (name, _, terms), whole in zip(self._pending, square_sums([g for _, g, _ in self._pending])):
            self.remainders.append((name, max(whole - sum(t.identity_value for t in terms), 0.0)))
        del self._pending
        if self.host:
            _to_host(self.reduced, torch.device("cpu"))
        self.like = like
        self.explicit_identity = [sum(float(torch.linalg.vector_norm(t)) ** 2 for t in g.values()) for _, g in self.explicit]
        device = torch.device("cpu") if self.host else next(iter(grads.values())).device if grads else None
        self.identities = [grp.shared_identity(dtype=torch.float64, device=device) for grp in self.groups]
        self.released = False

    def _reduce(self, name: str, grad: Tensor, entries: list[tuple[int, Member, Group]]) -> None:
        """One tensor's reduced terms: the whole tensor, or one term per slice plus the remainder."""
        if not _sliced(entries, grad.ndim):
            self.reduced.append(_Reduced(name, grad, entries))
            return
        g = grad.detach()
        axis = entries[0][1].axis % g.ndim  # one axis for every slice (_sliced)
        if axis in sharded_dims(g):  # slices of a sharded axis (FSDP2 rows): gathered; else each rank its shard
            g = full(g)
        terms = []
        for entry in entries:
            member = entry[1]
            assert member.start is not None and member.stop is not None  # _sliced
            part = g.narrow(axis, member.start, member.stop - member.start)
            plain = Member(member.name, member.axis, member.power)
            term = _Reduced(name, part, [(entry[0], plain, entry[2])])
            self.reduced.append(term)
            terms.append(term)
        self._pending.append((name, g, terms))

    def release(self) -> None:
        """Drop the reduced terms (their Gram matrices, squared gradients and margins); :meth:`value` and
        :meth:`site_value` raise afterwards."""
        self.reduced, self.explicit, self.released = [], [], True

    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError("GradientNormModel: released after the search (FastEvaluator.end_search); build a new one")

    def site_value(self, index: int, element: Tensor) -> float:
        """The value when only site ``index`` moves (by ``element``); every other site at the identity."""
        return self.site_values({index: element})[index]

    def site_values(self, moves: Mapping[int, Tensor]) -> dict[int, float]:
        """:meth:`site_value` of each site in ``moves`` (index -> its element), every term read together."""
        self._check_live()
        evaluations: list[tuple[int, Tensor, list[Tensor], _Cache]] = []
        for index, element in moves.items():
            elements = [element if i == index else e for i, e in enumerate(self.identities)]
            evaluations.append((index, element, elements, {}))
        self._read_ones([(elements, cache) for _, _, elements, cache in evaluations])
        totals: dict[int, float] = {}
        terms: list[tuple[int, Tensor]] = []  # (site, term), read together: one synchronisation per device
        for index, element, elements, cache in evaluations:
            total = 0.0
            for r in self.reduced:
                if index in r.site_ids:
                    terms.append((index, r.value(elements, cache)))
                else:
                    total += r.identity_value
            total += sum(rest for _, rest in self.remainders)
            for (site_ids, grads), still in zip(self.explicit, self.explicit_identity):
                if index in site_ids:
                    moved, _ = transport([self.sites[index]], [element], grads, self.like, "covector")
                    terms += [(index, t.to(torch.float64).square().sum()) for t in moved.values()]
                else:
                    total += still
            totals[index] = total
        for (index, _), value in zip(terms, read_together([t for _, t in terms])):
            totals[index] += value
        return totals

    def _read_ones(self, evaluations: Sequence[tuple[Sequence[Tensor], _Cache]]) -> None:
        """For each evaluation (its elements and cache), whether each scaling factor its terms compute is 1
        everywhere (the term is at the identity in it), put in the cache: the shared identities are known
        to be, the other elements are read all at once instead of once per term."""
        needed = {(i, -member.power): grp for r in self.reduced if r.kind == "scaling" for i, member, grp in r.entries}
        pending: list[tuple[_Cache, tuple[Any, ...], Tensor]] = []
        for elements, cache in evaluations:
            for (i, power), grp in needed.items():
                g = elements[i]
                if g is self.identities[i]:
                    cache["one", i, power] = True
                    continue
                factor = _square_factor(grp, g.detach(), power)
                if not g.requires_grad:  # the terms reuse it (under autograd they need their own, with its graph)
                    cache["factor", i, power] = factor
                pending.append((cache, ("one", i, power), (factor == 1).all()))
        for (cache, key, _), one in zip(pending, read_together([flag for _, _, flag in pending])):
            cache[key] = one

    def value(self, elements: Sequence[Tensor], weights: Mapping[str, float] | None = None) -> Tensor:
        """Sum over the sites' tensors of the squared transported gradient (float64),
        each tensor's term multiplied by ``weights[name]`` when given (e.g. its learning rate)."""
        self._check_live()
        total = torch.zeros((), dtype=torch.float64, device=elements[0].device if elements else None)
        cache: _Cache = {}
        self._read_ones([(elements, cache)])
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
