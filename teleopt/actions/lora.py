"""GL_r symmetry of a low-rank adaptation W + U V: Zhao 2026, Ex. 1.2.13.

g . (U, V) = (U g^{-1}, g V) for g in GL_r; U is (out, r), V is (r, in) as in
``y = x (W + U V)^T``.  In LoRA (Hu et al., ICLR 2022) and peft's naming U is
``lora_B`` and V is ``lora_A``: B -> B g^{-1}, A -> g A.
``teleopt.integrations.peft.lora_sites`` binds this action to every peft adapter;
``Teleport(..., objective="balance")`` (:class:`teleopt.teleport.Balance`) moves
the pair to the element with A A^T = B^T B after it (the balanced point,
Zhao 2026, Ex. 2.5.3; :meth:`teleopt.groups.GeneralLinear.balance`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction, Member
from teleopt.actions.base import ExampleProblem, required

__all__ = ["LoRAGL"]


def _example(generator: torch.Generator | None, dtype: torch.dtype, out: int = 6, inp: int = 5, r: int = 3) -> ExampleProblem:
    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)

    W, U, V, X = randn(out, inp), randn(out, r), randn(r, inp), randn(7, inp)
    return ExampleProblem((U, V), X, lambda p, x: x @ (W + required(p[0]) @ required(p[1])).T)


class LoRAGL(AxisAction):
    """GL_r on the LoRA factors (U, V) = (lora_B, lora_A): Zhao 2026, Ex. 1.2.13; Hu et al., ICLR 2022."""

    def __init__(self) -> None:
        super().__init__(
            "lora_gl",
            "general",
            (Member("U", 1, -1), Member("V", 0, 1)),
            reference="Zhao 2026, Ex. 1.2.13",
            group_name="GL_r(R)",
        )

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        return _example(generator, dtype)
