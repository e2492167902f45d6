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

from collections.abc import Sequence

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction, Member
from teleopt.actions.base import ExampleProblem, Params, required

__all__ = ["ResidualRotation", "residual_rotation", "rms_norm", "REFERENCE"]

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
