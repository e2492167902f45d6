"""Hypothesis strategies for group elements (Zhao 2026, Ch. 1 symmetries).

Following the conventions of property testing with torch, hypothesis never draws
raw matrices or tensors entry by entry: it draws an integer seed and a bounded
size, and torch builds the tensor from a ``torch.Generator``.  Continuous elements
are exp of Lie algebra coordinates of bounded norm (so a GL element has a bounded
condition number), discrete ones are permutations and sign patterns.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from teleopt.actions.base import GroupAction, Params
from teleopt.groups import Group

__all__ = [
    "seeds",
    "generators",
    "lie_algebra_coordinates",
    "group_elements",
    "permutations",
    "sign_patterns",
    "default_max_norm",
    "coordinates_norm",
]

_SEED_MAX = 2**32 - 1


def seeds() -> st.SearchStrategy[int]:
    """Integer seeds for ``torch.Generator`` (hypothesis does not manage torch's RNG)."""
    return st.integers(min_value=0, max_value=_SEED_MAX)


def generators() -> st.SearchStrategy[torch.Generator]:
    """CPU ``torch.Generator`` objects seeded from :func:`seeds`."""
    return seeds().map(lambda s: torch.Generator().manual_seed(s))


def coordinates_norm(coords: Tensor) -> Tensor:
    """Size of Lie algebra coordinates: spectral norm for matrices (max over blocks), max |x| for vectors.

    exp of matrix coordinates of spectral norm r has condition number <= e^{2r};
    exp of log-scales of max-norm r lies in [e^{-r}, e^{r}].
    """
    if coords.ndim >= 2:
        return torch.linalg.matrix_norm(coords, ord=2).max()
    return coords.abs().max()


def default_max_norm(group: Group) -> float:
    """Default bound on coordinates: GL condition number < 10, scales in [1/4, 4], any rotation."""
    return {
        "general": math.log(9.9) / 2,
        "diagonal": math.log(4),
        "orthogonal": math.pi,
        "translation": 1.0,
    }.get(group.kind, 1.0)


def lie_algebra_coordinates(
    shape: tuple[int, ...],
    max_norm: float = 1.0,
    dtype: torch.dtype = torch.float64,
    min_norm: float = 0.0,
) -> st.SearchStrategy[Tensor]:
    """Coordinates of the given shape whose :func:`coordinates_norm` lies in [min_norm, max_norm].

    The norm is drawn by hypothesis (so it shrinks towards ``min_norm``, by
    default the identity), the direction from a seeded ``torch.Generator``.
    """
    if not 0 <= min_norm <= max_norm:
        raise ValueError(f"need 0 <= min_norm <= max_norm, got {min_norm}, {max_norm}")

    @st.composite
    def build(draw: Any) -> Tensor:
        size = draw(st.floats(min_value=min_norm, max_value=max_norm, allow_nan=False))
        seed = draw(seeds())
        direction = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        norm = coordinates_norm(direction)
        coords = direction * (size / norm) if float(norm) > 0 else direction * 0
        return coords.to(dtype)

    return build()


def permutations(n: int) -> st.SearchStrategy[Tensor]:
    """Permutations of ``range(n)`` as ``torch.long`` index tensors."""
    return st.permutations(list(range(n))).map(lambda p: torch.tensor(p, dtype=torch.long))


def sign_patterns(n: int, dtype: torch.dtype = torch.float64) -> st.SearchStrategy[Tensor]:
    """Vectors of +-1 of length n."""
    return st.lists(st.booleans(), min_size=n, max_size=n).map(lambda bits: torch.tensor([-1.0 if b else 1.0 for b in bits], dtype=dtype))


def group_elements(
    action: GroupAction,
    params: Params,
    max_norm: float | None = None,
    min_norm: float = 0.0,
) -> st.SearchStrategy[Tensor]:
    """Elements of the group ``action`` uses on ``params``.

    Continuous groups: ``exp`` of coordinates from :func:`lie_algebra_coordinates`
    (``max_norm`` defaults to :func:`default_max_norm`); permutations and sign flips:
    :func:`permutations` and :func:`sign_patterns`.
    """
    group = action.group(action.check_params(params))
    ref = next(p for p in params if p is not None)
    if group.kind == "permutation":
        return permutations(group.n)
    if group.kind == "sign":
        return sign_patterns(group.dim, ref.dtype)
    bound = default_max_norm(group) if max_norm is None else max_norm
    coord_shape = group.coord_shape
    assert coord_shape is not None
    return lie_algebra_coordinates(coord_shape, bound, ref.dtype, min_norm=min_norm).map(group.exp)
