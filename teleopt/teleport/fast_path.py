"""The fast path: teleport objectives over group coordinates with no pass of the model.

For an exact site whose action has a closed-form Jacobian J (constant for linear or
affine actions; read at w for the residual rotation behind trainable gains), the
gradient at g . w is (J^{-1})^T times the gradient at w (Zhao 2026, Prop. 4.5.1,
eq. 4.19).  The gradient of the current batch is already in ``.grad`` when the
optimizer steps, so Algorithm 1's objective ||grad L(g . w)||^2 is a closed-form
function of the group coordinates: no forward or backward pass is needed.

The objective's reduced form is :class:`~teleopt.teleport.gradient_norm.GradientNormModel`.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction
from teleopt.actions.base import GroupAction
from teleopt.groups import Group, validated
from teleopt.groups.cache import GroupCache, active_cache
from teleopt.groups.matrix import remembering_placements
from teleopt.numerics import read_together
from teleopt.sharding import full, is_sharded, replicate_like, sharded_dims, write_
from teleopt.site import Site
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.decrease_bound import decrease_bound
from teleopt.teleport.distributed import is_distributed
from teleopt.teleport.gradient_norm import GradientNormModel, _diagonal, _plain, _plan, member_tensors
from teleopt.teleport.state_policy import StatePolicy
from teleopt.teleport.transport import TensorKind, _identity_matrix, transport, transport_

__all__ = ["GradientNormModel", "FastEvaluator", "fast_path_eligible", "member_tensors"]


def fast_path_eligible(site: Site) -> bool:
    """Whether ``site`` can take the fast path: exact, data-independent, continuous, with a closed-form covector
    rule (a constant Jacobian, or one read at the point: :meth:`~teleopt.actions.base.GroupAction.transport_gradient_at`)."""
    action = site.action
    return action.exactness == "exact" and not action.needs_data and action.continuous and bool(action.has_gradient_transport)


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
        self.groups = [site.action.group(member_tensors(site, self.like)) for site in self.sites]
        self._host = host and not all(_diagonal(g) for g in self.groups)
        self.search_device = torch.device("cpu") if self._host else device
        self._own_exp = [type(site.action).exp is not GroupAction.exp for site in self.sites]
        self.other_sq, self.other_decrease = ctx.constant_terms(set(names), with_decrease)

    @functools.cached_property
    def norm_model(self) -> GradientNormModel:
        """The gradient norm's reduced terms (GL Gram matrices, per-unit sums), made on first use: an objective
        that reads no gradient (``Balance``) with ``max_gain`` off never needs them (the engine then reads
        ||grad|| off the gradients before and after, as the lean balance path does)."""
        return GradientNormModel(self.sites, self.grads, self.like, self._host, self.groups)

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
        line search, the caps and the report (a ``matrix_exp`` per GL block each time otherwise).
        """
        tracked = any(xi.requires_grad for xi in coords) or any(self._own_exp)  # an action's exp reads the members
        memo = self.__dict__.get("_elements_memo")
        if not tracked and memo is not None and _unchanged(memo[0], memo[2]) and _equal(memo[0], coords):
            return list(memo[1])
        stacked = _stacked_exps(self.groups, coords, self._own_exp) if tracked else {}
        # exp(0) = I, bit for bit: the sites at zero decided together (one synchronisation, not one per site)
        plain = [
            i for i, (g, xi, own) in enumerate(zip(self.groups, coords, self._own_exp)) if g.plain_exp and not own and not xi.requires_grad
        ]
        at_zero = {i for i, nonzero in zip(plain, read_together([(coords[i] != 0).any() for i in plain])) if not nonzero}
        out = [
            stacked[i]
            if i in stacked
            else site.action.exp(xi, member_tensors(site, self.like))
            if own
            else group.shared_identity(dtype=xi.dtype, device=xi.device)
            if i in at_zero
            else group.exp(xi)
            for i, (site, group, xi, own) in enumerate(zip(self.sites, self.groups, coords, self._own_exp))
        ]
        if not tracked and not any(e.requires_grad for e in out):
            # the coordinates by reference with their versions (an in-place change is a new key), not copies
            self.__dict__["_elements_memo"] = ([xi.detach() for xi in coords], out, [xi._version for xi in coords])
            exps = [(xi, e) for group, xi, e, own in zip(self.groups, coords, out, self._own_exp) if not own and group.plain_exp]
            bounds = read_together([_spectral_bound(xi.detach()) for xi, _ in exps])  # NaN fails the comparison
            self.__dict__["_proven_elements"] = {
                _storage(e): e for (_, e), bound in zip(exps, bounds) if bound < _proven_limit(e)
            }  # the last set made: the chosen elements are the memo's, or made after everything else
        return out

    def _proven(self, g: Tensor) -> bool:
        """Whether ``g`` is exp(xi) of a plain-exp group, made by :meth:`elements`, with every block's
        ||xi||_2 <= b and e^(-2 b) over twice the dtype's n eps: ||exp(xi)|| and ||exp(xi)^-1|| are at most
        e^||xi||_2, so its condition number is at most e^(2 b), and it is finite (positive for scalings);
        :meth:`Group.validate <teleopt.groups.Group.validate>` (an SVD of each GL block) could not reject it."""
        return _storage(g) in self.__dict__.get("_proven_elements", {})

    def grad_norm_sq(self, elements: Sequence[Tensor]) -> Tensor:
        """||grad L(g . w)||^2 over all trainable parameters (float64).

        Elements outside autograd equal to the last such call's return its value: a teleport asks for its chosen
        point's value in the line search, the caps, the objective and the report (on mlp-10M each is a pass over
        the squared gradients of the tensors between two sites)."""
        tracked = any(e.requires_grad for e in elements)
        memo = self.__dict__.get("_norm_memo")
        if not tracked and memo is not None and _unchanged(memo[0], memo[2]) and _equal(memo[0], elements):
            return memo[1]
        value = self.norm_model.value(elements) + self.other_sq
        if not tracked:
            self.__dict__["_norm_memo"] = ([e.detach() for e in elements], value.detach(), [e._version for e in elements])
        return value

    def gradients_finite_after(self, norm_after: float) -> bool:
        """Whether the gradients the apply moves are finite, proven without a pass over them: every site's group is
        diagonal (an entry times a few positive factors, each product rounded to within eps) and ``norm_after``, the
        float64 ||grad L(g . w)|| predicted from the gradients (finite: they were), is below half the largest value of
        each gradient's dtype, so no entry can overflow (a pass over the gradients saved)."""
        if not math.isfinite(norm_after) or any(self._own_exp) or not all(_diagonal(g) for g in self.groups):
            return False
        return all(norm_after < 0.5 * torch.finfo(g.dtype).max for g in self.grads.values())

    def site_gain(self, index: int, element: Tensor, n0: float) -> float:
        """||grad L||^2 ratio when only site ``index`` moves by ``element`` (the others stay at the identity)."""
        return (self.norm_model.site_value(index, element) + self.other_sq) / n0

    def site_gains(self, elements: Sequence[Tensor], n0: float) -> dict[str, float | None]:
        """Per site: :meth:`site_gain` of its element (``None`` when the gradient is zero)."""
        if n0 == 0:
            return {s.name: None for s in self.sites}
        values = self.norm_model.site_values(dict(enumerate(elements)))
        return {s.name: (values[i] + self.other_sq) / n0 for i, s in enumerate(self.sites)}

    def end_search(self) -> None:
        """Free the gradient norm's reduced terms (GL Gram matrices, large, alive
        at the apply's peak otherwise), the decrease bound and the value memos; :meth:`grad_norm_sq` raises afterwards."""
        if "norm_model" in self.__dict__:  # made (a cached property)
            self.norm_model.release()
        self.__dict__.pop("_bound", None)  # the decrease cap's weights (per entry between two sites): the caps are done
        self.__dict__.pop("_norm_memo", None)
        self.__dict__.pop("_elements_memo", None)

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
        sites, like = self.sites, self.like
        for site, g in zip(sites, elements):  # before anything is written: an invalid element moves nothing
            if not self._proven(g):
                site.action.validate_element(g, member_tensors(site, like))
        with validated(elements), remembering_placements():
            return self._apply(self._placed(elements))

    def _apply(self, elements: Sequence[Tensor]) -> Counter[str]:
        ctx, sites, like = self.ctx, self.sites, self.like
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

    def exactly_invertible(self, elements: Sequence[Tensor]) -> bool:
        """Whether moving the parameters back by the inverse elements after :meth:`apply` restores them bit
        for bit, so a rollback needs no copy of them (:meth:`undo` with ``params``).

        True when :meth:`can_undo` and every site is a diagonal or sign action on whole axes whose factor on
        each parameter (in its dtype: float32, bfloat16 or float64) is a power of two with the inverse's
        factor its reciprocal: multiplying by 2^k only changes the exponent.  The default boundary step
        under the default trust region (log 4) moves scalings by exactly 4, 1/4 or 1.  The one exception is
        a parameter within 2^k of the dtype's subnormal or overflow range (below about 1e-37 or above 1e37
        in float32 and bfloat16), which float16's narrow range makes common: float16 is always copied."""
        if not self.can_undo():
            return False
        conditions: list[Tensor] = []  # decided together: one device synchronisation, not two per member
        for site, group, g in zip(self.sites, self.groups, elements):
            action = site.action
            if not group.diagonal or not isinstance(action, AxisAction):
                return False
            inverse = action.inverse(g)
            for member, name in zip(action.members, site.members):
                if name is None:
                    continue
                dtype = self.like[name].dtype
                if dtype not in (torch.float32, torch.float64, torch.bfloat16) or not _plain(member):
                    return False
                # the factors as Group.act_on_axis_ computes them (the element in the tensor's dtype, then the power)
                f, f_inv = (x.to(dtype) if member.power == 1 else x.to(dtype) ** member.power for x in (g, inverse))
                conditions += [(torch.frexp(f.to(torch.float64)).mantissa.abs() == 0.5).all(), ((f * f_inv) == 1).all()]
        return all(read_together(conditions))

    @torch.no_grad()
    def undo(self, elements: Sequence[Tensor], params: bool = False) -> None:
        """Move ``.grad`` and the optimizer state back from g . w to w: the sites in reverse order, each
        by its inverse element (Zhao 2026, Prop. 4.5.1: the same transport rules, for g^-1).  Exact up
        to round-off (one multiplication by c and one by 1/c, or a solve with a matrix of condition
        number at most e^(2 r) in a trust region r).  The parameters move back too with ``params``, after
        the rest: bit for bit where :meth:`exactly_invertible`, which ``params`` requires."""
        if params and not self.exactly_invertible(elements):
            raise ValueError("the parameters move back by the inverse elements only where that is exact")
        sites = self.sites[::-1]
        inverses = [site.action.inverse(g) for site, g in zip(sites, elements[::-1])]
        with remembering_placements():
            self._undo(sites, inverses, params)

    def _undo(self, sites: Sequence[Site], inverses: Sequence[Tensor], params: bool) -> None:
        ctx = self.ctx
        grads, _ = transport(sites, inverses, self.grads, self.like, "covector")
        for n, g in grads.items():
            grad = ctx.trainable[n].grad
            assert grad is not None  # ctx.grads returned only parameters that have one
            write_(grad, g)
        del grads
        StatePolicy.write(ctx.states(self.live), ctx.policy.move(ctx.optimizer, sites, inverses, self.states, self.like, ctx.groups))
        if params and not transport_(sites, inverses, self.live, self.like, "params"):  # pragma: no cover - exactly_invertible
            raise AssertionError("diagonal sites on whole axes move in place")

    def originals(self, elements: Sequence[Tensor]) -> dict[str, Tensor]:
        """Copies of the site members at w, computed from g . w by the inverse elements (after :meth:`apply`;
        bit for bit where :meth:`exactly_invertible`)."""
        sites = self.sites[::-1]
        inverses = [site.action.inverse(g) for site, g in zip(sites, elements[::-1])]
        return transport(sites, inverses, self.like, self.like, "params")[0]

    def transported_grads(self, elements: Sequence[Tensor]) -> dict[str, Tensor]:
        """Gradients of the site members at g . w."""
        return transport(self.sites, self._placed(elements), self.grads, self.like, "covector")[0]

    def site_params(self, elements: Sequence[Tensor], only: tuple[Sequence[Site], list[str]] | None = None) -> dict[str, Tensor]:
        """Site members at g . w; with ``only`` = (sites, names), those names alone, moved in copies along
        those sites (the ones moving them, ``elements`` theirs, placed)."""
        if only is None:
            return transport(self.sites, self._placed(elements), self.like, self.like, "params")[0]
        return _moved(only[0], elements, {n: self.like[n] for n in only[1]}, self.like, "params")

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

    def decrease_bound(self, elements: Sequence[Tensor]) -> float | None:
        """An upper bound of :meth:`first_order_decrease` from the gradient norm's reduced terms
        (:mod:`~teleopt.teleport.decrease_bound`; built on first use, for these elements and any closer to the
        identity, as the caps' bisection asks: made again for elements farther out), or ``None`` where there is
        none."""
        if "_bound" not in self.__dict__:
            self.__dict__["_bound"] = decrease_bound(self.sites, self.groups, self.ctx, lambda: self.norm_model, self.grads, elements)
        bound = self.__dict__["_bound"]
        if bound is None:
            return None
        value = bound(elements)
        if value == math.inf:  # a factor below those the weights were made for (or an underflowing gradient)
            self.__dict__["_bound"] = bound = decrease_bound(
                self.sites, self.groups, self.ctx, lambda: self.norm_model, self.grads, elements
            )
            value = math.inf if bound is None else bound(elements)
        return value + float(self.other_decrease)

    @property
    def decrease_bound_tight(self) -> bool:
        """Whether :meth:`decrease_bound` (once made) is the decrease itself up to eps and round-off, so that
        the simulated decrease has nothing to add."""
        bound = self.__dict__.get("_bound")
        return bound is not None and bound.tight

    def decrease_at_identity(self) -> float:
        """:meth:`first_order_decrease` at the identity: read off the decrease bound's pass where it was made,
        else the modelled update of each site tensor where it is (one pass, no transport)."""
        bound = self.__dict__.get("_bound")
        if bound is not None:
            return bound.at_identity() + float(self.other_decrease)
        _, products = self.ctx.constant_terms(set(self.ctx.trainable) - set(self.grads), True)
        return products + float(self.other_decrease)

    def first_order_decrease(self, elements: Sequence[Tensor]) -> Tensor:
        """<grad, u> of the base optimizer's next step from g . w, summed over all trainable parameters.

        For plain SGD (no momentum, no weight decay) u = lr grad, so this is the
        learning-rate-weighted gradient norm and reuses the reduced model; otherwise
        the gradients, parameters and state are transported explicitly: a run of site
        tensors at a time (moved in copies, reduced and freed: extra memory a few times
        the larger of the largest site tensor and 1/16 of them all, not the model's)
        where the elements are outside autograd, the tensors unsharded and no moving
        site's covector rule reads the point; else all together.  The same sum, in the
        same order, either way.
        """
        lrs = self._plain_sgd_lrs()
        if lrs is not None:
            return self.norm_model.value(elements, lrs) + self.other_decrease
        placed = self._placed(elements)
        moving = [i for i, g in enumerate(placed) if not _identity_matrix(g)]  # idle sites move nothing
        if (
            any(e.requires_grad for e in placed)
            or any(self.sites[i].action.transport_reads_params for i in moving)
            or any(is_sharded(t) for t in self.live.values())
        ):
            return self._decrease_together(elements)
        total = torch.zeros((), dtype=torch.float64) + self.other_decrease
        # constant in the elements: no graph through the parameters, alive to the end; each GL element's
        # contragredient solved once for all runs (a teleport's own cache where one is active)
        with torch.no_grad(), nullcontext() if active_cache() is not None else GroupCache().active():
            for names in self._batches():
                index = [i for i in moving if any(n in self.sites[i].members for n in names)]
                total = self._decrease_of(names, [self.sites[i] for i in index], [placed[i] for i in index], total)
        return total

    def _batches(self) -> list[list[str]]:
        """The site tensors with a gradient in order, in runs of at most 1/16 of their bytes (or one tensor)."""
        sizes = {n: g.numel() * g.element_size() for n, g in self.grads.items()}
        batches: list[list[str]] = []
        budget, used = sum(sizes.values()) // 16, math.inf
        for name, size in sizes.items():
            if used + size > budget:
                batches.append([])
                used = 0
            batches[-1].append(name)
            used += size
        return batches

    def _decrease_of(self, names: list[str], sites: list[Site], elements: list[Tensor], total: Tensor) -> Tensor:
        """``total`` plus <grad, u> at g . w of the site tensors ``names`` in order, their gradients and
        state moved in copies along ``sites`` (those moving them, with their placed ``elements``)."""
        ctx = self.ctx
        grads = _moved(sites, elements, {n: self.grads[n] for n in names}, self.like, "covector")
        # the modelled update reads the parameters' values only through weight decay (else their shapes)
        decays = [n for n in names if float(ctx.groups[n].get("weight_decay", 0.0))]
        params = {**self.like, **self.site_params(elements, (sites, decays))} if decays else self.like
        states = {n: _copied(self.states[n]) if sites else self.states[n] for n in names if n in self.states}
        moved = ctx.policy.move(ctx.optimizer, sites, elements, states, self.like, ctx.groups, in_place=True)
        for name, g in grads.items():
            u = ctx.model.update(ctx.groups[name], params[name], g, moved.values.get(name, {}))
            total = total + (g.to(torch.float64) * u.to(torch.float64)).sum()
        return total

    def _decrease_together(self, elements: Sequence[Tensor]) -> Tensor:
        """:meth:`first_order_decrease` with every site tensor moved at once (under autograd, on shards, or
        along a site whose covector rule reads the point)."""
        ctx = self.ctx
        grads = self.transported_grads(elements)
        # the modelled updates read the parameters' values only through weight decay (else their shapes)
        decays = any(float(ctx.groups[n].get("weight_decay", 0.0)) for n in grads)
        params = self.site_params(elements) if decays else self.like
        states = {n: self.states[n] for n in grads if n in self.states}
        moved = ctx.policy.move(ctx.optimizer, self.sites, self._placed(elements), states, self.like, ctx.groups)
        total = torch.zeros((), dtype=torch.float64) + self.other_decrease
        for name, g in grads.items():
            u = ctx.model.update(ctx.groups[name], params[name], g, moved.values.get(name, {}))
            part = (g.to(torch.float64) * u.to(torch.float64)).sum()
            # sharded: one scalar all-reduce, differentiable in the elements (DTensor autograd; full() is not)
            total = total + (part.full_tensor() if is_sharded(part) else part)
        return total


def _moved(
    sites: Sequence[Site], elements: Sequence[Tensor], values: dict[str, Tensor], like: Mapping[str, Tensor], kind: TensorKind
) -> dict[str, Tensor]:
    """``values`` moved along ``sites``: in place in copies where :func:`transport_` can (bitwise
    :func:`transport`'s result, with no zeros made for members absent from ``values``), else by :func:`transport`."""
    if not sites:  # nothing moves them
        return dict(values)
    work = {n: v.clone() for n, v in values.items()}
    if transport_(sites, elements, work, like, kind):
        return work
    del work
    return transport(sites, elements, values, like, kind)[0]


def _copied(state: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer state with its tensors copied (moved in place by the state policy)."""
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}


def _stacked_exps(groups: Sequence[Group], coords: Sequence[Tensor], own: Sequence[bool]) -> dict[int, Tensor]:
    """Elements under autograd of the sites whose groups stack their exps, by site index: one
    :meth:`Group.exp_stacked <teleopt.groups.Group.exp_stacked>` per :meth:`Group.exp_stack_key` and dtype."""
    if not torch.is_grad_enabled():
        return {}
    by_kind: dict[tuple[Hashable, torch.dtype, torch.device], list[int]] = {}
    for i, (group, xi, o) in enumerate(zip(groups, coords, own)):
        if not o and group.exp_stack_key() is not None and xi.requires_grad:
            by_kind.setdefault((group.exp_stack_key(), xi.dtype, xi.device), []).append(i)
    out: dict[int, Tensor] = {}
    for index in by_kind.values():
        if len(index) > 1:
            gl = [groups[i] for i in index]
            out.update(zip(index, type(gl[0]).exp_stacked(gl, [coords[i] for i in index])))
    return out


def _spectral_bound(xi: Tensor) -> Tensor:
    """An upper bound of every block's spectral norm, sqrt(||xi||_1 ||xi||_inf) (max |xi_i| for diagonal
    coordinates; NaN or inf where a coordinate is), as a 0-dim tensor (read with the other sites')."""
    if not xi.numel():
        return torch.zeros((), dtype=torch.float64, device=xi.device)
    a = xi.abs()
    return a.amax() if xi.dim() < 2 else (a.sum(-2).amax(-1) * a.sum(-1).amax(-1)).sqrt().amax()


def _proven_limit(g: Tensor) -> float:
    """The bound b under which exp(xi) provably passes :meth:`Group.validate` (e^(-2 b) > 2 n eps, see ``_proven``)."""
    n = g.shape[-1] if g.dim() >= 2 else 1
    return -0.5 * math.log(2 * n * torch.finfo(g.dtype).eps)


def _storage(g: Tensor) -> tuple[int, tuple[int, ...], torch.dtype, torch.device, int]:
    """What identifies an element's values while a reference to it is held (views and ``detach`` share it)."""
    return (g.data_ptr(), tuple(g.shape), g.dtype, g.device, g._version)


def _unchanged(kept: Sequence[Tensor], versions: Sequence[int]) -> bool:
    """Whether tensors a memo keeps by reference are unchanged since (no in-place write bumped their versions)."""
    return all(t._version == v for t, v in zip(kept, versions))


def _equal(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    """Whether two lists of tensors hold the same values (shapes, dtypes and every entry), the memos' keys ``a``
    unchanged since (:func:`_unchanged`): a tensor reading the same memory as its key needs no comparison (the
    teleport asks again with the elements it was given), the others are compared with one read per device."""
    if len(a) != len(b) or any(x.shape != y.shape or x.dtype != y.dtype or x.device != y.device for x, y in zip(a, b)):
        return False
    rest = [(x, y) for x, y in zip(a, b) if not (x.data_ptr() == y.data_ptr() and x.stride() == y.stride())]
    return all(read_together([torch.eq(x, y).all() for x, y in rest]))


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
