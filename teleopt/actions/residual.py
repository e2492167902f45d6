"""The orthogonal symmetry of a pre-RMSNorm residual stream: SliceGPT's computational invariance.

Ashkboos et al. 2024a (SliceGPT, ICLR 2024), Theorem 1 (computational invariance); Ashkboos
et al. 2024b (QuaRot, NeurIPS 2024), which rotates the same stream.  In a transformer whose blocks read the residual stream
x (a column of length d_model) through RMSNorm with unit gains and write back by
addition, an orthogonal Q maps the stream to Q x when, in ``torch.nn.Linear``'s
(out, in) layout,

* every tensor writing the stream moves its stream axis by Q: the embedding table
  E (vocab, d) -> E Q^T (rows are stream vectors, ``axis=1``), the rows of each writer
  W (d, h) -> Q W and its bias b -> Q b (``axis=0``);
* every tensor reading the stream moves its columns by Q^{-1} = Q^T: W (h, d) -> W Q^T
  (q/k/v, gate/up, the output head; ``axis=1``).

The norm commutes with Q because ||Q x|| = ||x||: RMSNorm(Q x) = Q RMSNorm(x) when the
gain is all ones (eps included), so each reader sees W Q^T Q RMSNorm(x) = W RMSNorm(x)
and the output head's logits are unchanged.  A gain diag(w) != I breaks it
(diag(w) Q != Q diag(w)); LayerNorm's mean subtraction commutes only with the Q that fix
the all-ones vector.  For orthogonal Q the contragredient Q^{-T} equals Q, so the writer
(``power=+1``) and reader (``power=-1``) representations agree on a tied embedding/head
matrix, and gradients and first moments move by the same Q (Zhao 2026, Prop. 4.5.1:
grad at Q . w is J^{-T} grad = Q-moved grad).  Adam's elementwise second moment has no
exact rule under a rotation (:meth:`AxisAction.transport_second_moment` returns ``None``);
the teleport's state policy treats it as it does GL sites'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.axis import CONFIG_VARIANTS, AxisAction, Member
from teleopt.actions.base import Exactness, ExampleProblem, GroupAction, Params, required
from teleopt.groups import Group, Orthogonal, OrthogonalFixingOnes, is_validated

__all__ = ["GainedResidualRotation", "ResidualRotation", "residual_rotation", "rms_norm", "REFERENCE"]

REFERENCE = "Ashkboos et al. 2024a (SliceGPT), Theorem 1 (computational invariance)"
NAME = "residual_rotation"


def rms_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm with unit gain over the last axis: x / sqrt(mean(x^2) + eps)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def residual_rotation(members: Sequence[Member], *, name: str = NAME) -> AxisAction:
    """O(d_model) acting on a residual stream's writers (``power=+1``) and readers (``power=-1``).

    ``members`` name each tensor's stream axis: 1 for embedding tables and readers'
    weights, 0 for writers' weights and biases.  Detection
    (:func:`teleopt.detection.residual.find_residual_sites`) builds one per stream.
    """
    members = tuple(members)
    for m in members:
        if m.outer != 1 or m.inner != 1 or m.groups != 1 or m.start is not None:
            raise ValueError(f"member {m.name!r}: a residual rotation acts on a whole axis (no slice or view)")
    return AxisAction(name, "orthogonal", members, reference=REFERENCE, group_name="O(d_model)")


def _example(generator: torch.Generator | None, dtype: torch.dtype, vocab: int = 7, d: int = 4, h: int = 6) -> ExampleProblem:
    """A one-block pre-RMSNorm language model: logits = H rms(x + W2 relu(W1 rms(x)) + b2), x = E[ids]."""

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)

    params = (randn(vocab, d), randn(h, d), randn(d, h), randn(d), randn(vocab, d))
    ids = torch.randint(0, vocab, (2, 5), generator=generator)

    def fn(p: Params, tokens: Tensor) -> Tensor:
        E, W1, W2 = required(p[0], "embedding"), required(p[1], "W_in"), required(p[2], "W_out")
        b2, H = p[3], required(p[4], "head")
        x = E[tokens]
        y = torch.relu(rms_norm(x) @ W1.T) @ W2.T
        x = x + (y if b2 is None else y + b2)
        return rms_norm(x) @ H.T

    return ExampleProblem(params, ids, fn)


class ResidualRotation(AxisAction):
    """O(d_model) on a one-block pre-RMSNorm language model (the registry's canonical form).

    Members: (embedding, W_in, W_out, b_out, head): the embedding and the output
    projection's rows write the stream, the block's input and the head's columns read it
    (Ashkboos et al. 2024a, SliceGPT, Theorem 1).  Detected sites use
    :func:`residual_rotation` with every writer and reader of a model's stream.
    """

    def __init__(self) -> None:
        super().__init__(
            NAME,
            "orthogonal",
            (
                Member("embedding", 1, 1),
                Member("W_in", 1, -1),
                Member("W_out", 0, 1),
                Member("b_out", 0, 1, optional=True),
                Member("head", 1, -1),
            ),
            reference=REFERENCE,
            group_name="O(d_model)",
        )

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        return _example(generator, dtype)


class GainedResidualRotation(GroupAction):
    """The residual stream's rotation with its norms' gains left as they are (no folding).

    A norm with gain g (effective D = diag(g + offset): ``offset`` 1 for a (1 + w)
    parametrisation) outputs D Q x / rms(x) on a rotated stream, so its output moves by the
    conjugate P = D Q D^{-1}: a reader W of it becomes W P^{-1} = W D Q^T D^{-1}, and a
    LayerNorm bias b becomes P b (LayerNorm(Q x) with bias P b is P LayerNorm(x)).
    ``members`` are :class:`~teleopt.actions.axis.Member` s as for :func:`residual_rotation`;
    ``gains`` maps those behind a norm to (its gain tensor, offset); the gains become members
    that are read, never moved (``power=0``).  With ``fixes_ones`` the group is the rotations
    fixing the all-ones vector (:class:`~teleopt.groups.OrthogonalFixingOnes`), which
    LayerNorm's mean subtraction commutes with.

    The action is exact for every nonzero gain but not linear in (W, g) jointly, so its covector
    rule reads the point (:meth:`transport_gradient_at`): for the gains fixed it is linear in the
    moved members, whose gradients move by the contragredient (a reader's G -> G D^{-1} Q^T D, a
    bias's G -> D^{-1} Q D G; writers' and embeddings' by Q as without gains), and a gain's
    gradient at the moved point follows from the inverse transposed Jacobian (Zhao 2026, eq. 4.19).
    """

    exactness: Exactness = "exact"
    transport_reads_params = True

    def __init__(
        self, members: Sequence[Member], gains: Mapping[str, tuple[str, float]], *, fixes_ones: bool = False, name: str = NAME
    ) -> None:
        acting = tuple(members)
        known = {m.name for m in acting}
        if not acting or any(
            m.power not in (1, -1) or m.outer != 1 or m.inner != 1 or m.groups != 1 or m.start is not None for m in acting
        ):
            raise ValueError("members must be whole-axis members with power +1 or -1")
        for member, (gain, offset) in gains.items():
            if member not in known or gain in known or not isinstance(offset, (int, float)):
                raise ValueError(f"gains[{member!r}]: need a member, a gain tensor that is not one, and a numeric offset")
        self.name = name
        self.reference = REFERENCE
        self.group_name = "O(d_model) fixing 1" if fixes_ones else "O(d_model)"
        self.group_type = OrthogonalFixingOnes if fixes_ones else Orthogonal
        self.linear = False
        self.members = acting + tuple(Member(n, 0, 0) for n in dict.fromkeys(g for g, _ in gains.values()))
        self.member_names = tuple(m.name for m in self.members)
        self.optional_members = frozenset()
        self.gains = {k: (str(g), float(o)) for k, (g, o) in gains.items()}
        self.fixes_ones = bool(fixes_ones)

    def config(self) -> dict[str, Any]:
        """Plain data that :meth:`AxisAction.from_config <teleopt.actions.axis.AxisAction.from_config>` rebuilds."""
        return {
            "variant": type(self).__name__,
            "name": self.name,
            "members": [asdict(m) for m in self.members if m.power != 0],
            "gains": {k: list(v) for k, v in self.gains.items()},
            "fixes_ones": self.fixes_ones,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GainedResidualRotation:
        """Inverse of :meth:`config`."""
        gains = {k: (v[0], v[1]) for k, v in config["gains"].items()}
        return cls([Member(**m) for m in config["members"]], gains, fixes_ones=config["fixes_ones"], name=config["name"])

    def acted_axes(self) -> tuple[int | None, ...]:
        return tuple(None if m.power == 0 else m.axis for m in self.members)

    def group(self, params: Params) -> Group:
        params = self.check_params(params)
        m, p = next((m, p) for m, p in zip(self.members, params) if p is not None and m.power != 0)
        n = p.shape[m.axis]
        return OrthogonalFixingOnes(n) if self.fixes_ones else Orthogonal(n)

    def act(self, g: Tensor, params: Params, data: Any = None) -> Params:
        """g . params: writers by Q, readers by Q^{-T}, each conjugated by its norm's gain (see class docs)."""
        params = self.check_params(params)
        if not is_validated(g):
            self.group(params).validate(g.detach())
        return self._apply(g, params, params, +1)

    @property
    def has_gradient_transport(self) -> bool:
        """Closed form at a given point (:meth:`transport_gradient_at`)."""
        return True

    def transport_gradient(self, g: Tensor, grads: Params) -> Params:
        raise TypeError(f"{self.name}: the gradient transport reads the gains: use transport_gradient_at(g, grads, params)")

    def transport_gradient_at(self, g: Tensor, grads: Params, params: Params) -> Params:
        """Gradients at g . w from the gradients ``grads`` at w = ``params``: (J^{-1})^T grad (Zhao 2026, eq. 4.19).

        With the gains fixed, each moved member X -> X' = A X is linear, so G_X' = A^{-T} G_X (the
        contragredient).  Differentiating L(A_d(X), d) = L(X, d) in the gain d (effective, g + offset) gives,
        per gain, G_d' = G_d - sum_X p_X (s(X', G_X') - s(X, G_X)) / d, where s(X, G) sums X * G over every
        axis but the stream's and p_X is the member's power (-1 readers, +1 LayerNorm biases).
        """
        grads, params = self.check_params(grads), self.check_params(params)
        if not is_validated(g):
            self.group(params).validate(g.detach())
        moved = list(self._apply(g, grads, params, -1))
        if not self.gains:
            return tuple(moved)
        there = self._apply(g, params, params, +1)
        index = {n: i for i, n in enumerate(self.member_names)}
        for i, m in enumerate(self.members):
            if m.name not in self.gains or grads[i] is None:
                continue
            gain, offset = self.gains[m.name]
            k = index[gain]
            x, x2 = required(params[i], m.name), required(there[i], m.name)
            g0, g2 = required(grads[i], m.name), required(moved[i], m.name)
            axis = m.axis % x.ndim
            others = [a for a in range(x.ndim) if a != axis]
            change = (x2 * g2).sum(others) - (x * g0).sum(others) if others else x2 * g2 - x * g0
            d = required(params[k], gain).to(change.dtype) + offset
            moved[k] = required(moved[k], gain) - (m.power * change / d).to(required(moved[k], gain).dtype)
        return tuple(moved)

    def _apply(self, g: Tensor, values: Params, params: Params, sign: int) -> Params:
        grp = self.group(params)
        given = dict(zip(self.member_names, params))
        current: dict[str, Tensor] = {}
        low = _low_rank(g)  # Q = I + L R^T of low rank: D^p Q D^-p = I + (D^p L)(D^-p R)^T, O(n r) per vector
        for m, p in zip(self.members, values):
            if p is None or m.power == 0:
                continue
            power = int(sign * m.power)
            base = current.get(m.tensor_key, p)
            axis = m.axis % p.ndim
            d = None
            if m.name in self.gains:
                gain, offset = self.gains[m.name]
                d = required(given[gain], gain).to(p.dtype) + offset
                if not bool((d != 0).all()):
                    raise ValueError(f"{self.name}: the gain {gain!r} has a zero entry: no conjugate rotation exists")
            if low is not None:
                left, right = low[0].to(p.dtype), low[1].to(p.dtype)
                if d is not None:
                    left, right = left * d.pow(power).unsqueeze(1), right * d.pow(-power).unsqueeze(1)
                current[m.tensor_key] = _low_rank_update(base, axis, left, right)
            elif d is None:
                current[m.tensor_key] = grp.act_on_axis(g, base, axis, 1)  # Q^{-T} = Q: one representation
            else:  # P^power on the axis, P = D Q D^-1: x -> D^power Q D^-power x
                shape = [1] * p.ndim
                shape[axis] = d.numel()
                dv = d.reshape(shape)
                current[m.tensor_key] = grp.act_on_axis(g, base * dv.pow(-power), axis, 1) * dv.pow(power)
        return tuple(p if p is None or m.power == 0 else current[m.tensor_key] for m, p in zip(self.members, values))

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        raise TypeError(f"{self.name}: a detected action has no example problem")


def _low_rank(g: Tensor) -> tuple[Tensor, Tensor] | None:
    """(L, R) with g - I = L R^T when that has rank <= n / 8 (outside autograd, n >= 128), else ``None``:
    certification's elements rotate a few directions (:func:`~teleopt.detection.certify.edge_element`)."""
    n = g.shape[-1]
    if g.requires_grad or g.ndim != 2 or n < 128:
        return None
    U, S, Vh = torch.linalg.svd(g.to(torch.float64) - torch.eye(n, dtype=torch.float64, device=g.device))
    r = int((S > 1e-12 * max(1.0, float(S[0]))).sum())
    return (U[:, :r] * S[:r], Vh[:r].mT) if r <= n // 8 else None


def _low_rank_update(x: Tensor, axis: int, left: Tensor, right: Tensor) -> Tensor:
    """x + L R^T x on ``axis`` (one fused product for matrices)."""
    if x.ndim == 2:
        return torch.addmm(x, x @ right, left.mT) if axis == 1 else torch.addmm(x, left, right.mT @ x)
    moved = x.movedim(axis, -1)
    return (moved + (moved @ right) @ left.mT).movedim(-1, axis)


CONFIG_VARIANTS[GainedResidualRotation.__name__] = GainedResidualRotation
