"""Symmetries of multi-head attention: Zhao 2026, Ex. 1.2.11 and 1.2.12.

Projections follow ``torch.nn.Linear`` (weight (out, in)): for head i,
q_i = W_Q[i] x + b_Q[i], k_i = W_K[i] x + b_K[i], v_i = W_V[i] x + b_V[i], where
W[i] are rows i*d .. (i+1)*d of the stacked (H*d, d_model) weight, and the output
is W_O concat_i(softmax(q_i k_i^T / sqrt(d)) v_i) + b_O.  Then:

* GL_{d_k} per head on (Q, K) (Ex. 1.2.11): q_i -> A_i q_i, k_i -> A_i^{-T} k_i keeps
  every score q_i^T k_i; weights and biases of Q by A_i, of K by A_i^{-T};
* GL_{d_v} per head on (V, O) (Ex. 1.2.12): v_i -> B_i v_i (weight and bias), the
  columns of W_O reading head i by B_i^{-1};
* S_h permuting whole heads in Q, K, V and the columns of W_O (Ex. 1.2.12).

In the papers' row convention the Q/K action reads (W^Q g^{-1}, W^K g^T); it is
the same action with A = g^{-T}.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction, Member
from teleopt.actions.base import ExampleProblem, Params, required
from teleopt.groups import Permutation

__all__ = ["AttentionQK", "AttentionVO", "AttentionHeadPermutation", "multi_head_attention"]

_ALL = ("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V", "W_O")


def multi_head_attention(p: Params, x: Tensor, num_heads: int) -> Tensor:
    """Self-attention of x (batch, tokens, d_model) with stacked projections p (see module docs)."""
    W_Q, b_Q, W_K, b_K, W_V, b_V, W_O = p
    W_Q, W_K, W_V, W_O = required(W_Q, "W_Q"), required(W_K, "W_K"), required(W_V, "W_V"), required(W_O, "W_O")
    B, T, _ = x.shape

    def heads(W: Tensor, b: Tensor | None) -> Tensor:
        y = x @ W.T if b is None else x @ W.T + b
        return y.reshape(B, T, num_heads, -1).transpose(1, 2)

    q, k, v = heads(W_Q, b_Q), heads(W_K, b_K), heads(W_V, b_V)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, -1)
    return out @ W_O.T


def _attention_example(
    num_heads: int, members: tuple[str, ...], generator: torch.Generator | None, dtype: torch.dtype, d_model: int = 6, d_head: int = 3
) -> ExampleProblem:
    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(dtype)

    hd = num_heads * d_head
    s = 1 / math.sqrt(d_model)
    params = (
        randn(hd, d_model, scale=s),
        randn(hd),
        randn(hd, d_model, scale=s),
        randn(hd),
        randn(hd, d_model, scale=s),
        randn(hd),
        randn(d_model, hd, scale=s),
    )
    x = randn(2, 5, d_model)
    full = dict(zip(_ALL, params))
    mine = tuple(full[m] for m in members)

    def fn(p: Params, x: Tensor) -> Tensor:
        values = dict(full, **dict(zip(members, p)))
        return multi_head_attention(tuple(values[m] for m in _ALL), x, num_heads)

    return ExampleProblem(mine, x, fn)


def _members(layout: dict[str, tuple[int, int]]) -> tuple[Member, ...]:
    """Members (name -> (axis, power)); biases are optional."""
    return tuple(Member(name, axis, power, optional=name.startswith("b_")) for name, (axis, power) in layout.items())


def _check_heads(num_heads: int) -> int:
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    return num_heads


class AttentionQK(AxisAction):
    """(GL_{d_k})^h on the query and key projections of every head: Zhao 2026, Ex. 1.2.11-1.2.12.

    Members: (W_Q, b_Q, W_K, b_K).  Its example problem takes all seven projections.
    """

    def __init__(self, num_heads: int = 2) -> None:
        self.num_heads = _check_heads(num_heads)
        super().__init__(
            "attention_qk_gl",
            "general",
            _members({"W_Q": (0, 1), "b_Q": (0, 1), "W_K": (0, -1), "b_K": (0, -1)}),
            reference="Zhao 2026, Ex. 1.2.11-1.2.12",
            group_name="(GL_{d_k}(R))^h",
            blocks=num_heads,
        )

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        return _attention_example(self.num_heads, ("W_Q", "b_Q", "W_K", "b_K"), generator, dtype)


class AttentionVO(AxisAction):
    """(GL_{d_v})^h on the value projection and the output projection's columns: Zhao 2026, Ex. 1.2.12.

    Members: (W_V, b_V, W_O).
    """

    def __init__(self, num_heads: int = 2) -> None:
        self.num_heads = _check_heads(num_heads)
        super().__init__(
            "attention_vo_gl",
            "general",
            _members({"W_V": (0, 1), "b_V": (0, 1), "W_O": (1, -1)}),
            reference="Zhao 2026, Ex. 1.2.12",
            group_name="(GL_{d_v}(R))^h",
            blocks=num_heads,
        )

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        return _attention_example(self.num_heads, ("W_V", "b_V", "W_O"), generator, dtype)


class AttentionHeadPermutation(AxisAction):
    """S_h permuting whole heads of Q, K, V and the columns of W_O: Zhao 2026, Ex. 1.2.12.

    Members: (W_Q, b_Q, W_K, b_K, W_V, b_V, W_O).  Needs d_k = d_v (as in
    ``nn.MultiheadAttention`` and timm); the head dimension is read from the shapes.
    """

    def __init__(self, num_heads: int = 2) -> None:
        self.num_heads = _check_heads(num_heads)
        super().__init__(
            "attention_head_permutation",
            "permutation",
            _members({"W_Q": (0, 1), "b_Q": (0, 1), "W_K": (0, 1), "b_K": (0, 1), "W_V": (0, 1), "b_V": (0, 1), "W_O": (1, 1)}),
            reference="Zhao 2026, Ex. 1.2.12",
            group_name="S_h",
        )

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        return _attention_example(self.num_heads, _ALL, generator, dtype)

    def group(self, params: Params):
        n = self.axis_length(params)
        if n % self.num_heads:
            raise ValueError(f"{self.name}: projection width {n} is not divisible by num_heads={self.num_heads}")
        return Permutation(self.num_heads, unit_size=n // self.num_heads)
