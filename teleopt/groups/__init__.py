"""Groups that act on parameter tensors, with exact elements.

Every symmetry in Zhao 2026, Table 1.1 is a group acting on one axis of a set of
parameter tensors: the general linear group GL_n (Ex. 1.2.2, 1.2.11-1.2.13), the
orthogonal group O(n) (Ex. 1.2.6, eq. 4.33), the positive scaling group R_{>0}^n
(Ex. 1.2.4, 1.2.7), the sign-flip group Z_2^n (Ex. 1.2.5), the symmetric group S_n
(Ex. 1.2.9, 1.2.10, 1.2.12) and the additive group R^n (Ex. 1.2.8).  A block group
is ``blocks`` independent copies acting on consecutive chunks of the axis, as the
per-head groups (GL_{d_k})^h of multi-head attention (Ex. 1.2.12).

Elements are built exactly: ``exp`` uses ``torch.linalg.matrix_exp`` or the scalar
exponential, inverses use ``torch.linalg.solve``/``inv`` or transposition, never a
first-order expansion such as I - T for (I + T)^-1 (the shortcut Zhao 2026 Sec.
4.6.1 uses, which changes the loss it claims to preserve).

The *representation* used on a tensor axis is selected by ``power``:

* matrix groups: ``power=+1`` maps a vector x on the axis to g x, ``power=-1`` to
  g^{-T} x (the contragredient representation: input columns of the next layer);
* positive scaling: x -> c**power * x (``power=-alpha`` for homogeneous activations
  of degree alpha, ``power=2`` for BatchNorm running variances);
* signs: x -> s**power * x;  permutations: x -> P x whatever the power.

The contragredient of ``power`` is ``-power``; it is how gradients (covectors)
transform (Zhao 2026, Prop. 4.5.1, eq. 4.19).
"""

from teleopt.groups.base import BALANCE_RCOND, Group, GroupKind, apply_on_axis, is_validated, validated
from teleopt.groups.cache import GroupCache
from teleopt.groups.centred import OrthogonalFixingOnes
from teleopt.groups.diagonal import PositiveScaling, SignFlip
from teleopt.groups.discrete import Permutation, Translation
from teleopt.groups.matrix import GeneralLinear, Orthogonal

__all__ = [
    "BALANCE_RCOND",
    "Group",
    "GroupKind",
    "GroupCache",
    "GeneralLinear",
    "Orthogonal",
    "OrthogonalFixingOnes",
    "PositiveScaling",
    "SignFlip",
    "Permutation",
    "Translation",
    "apply_on_axis",
    "is_validated",
    "validated",
]
