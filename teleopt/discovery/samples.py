"""Parameters and data of a discovery problem: shapes, flattening, sampling.

Zhao et al. 2024b, Sec. 3.2 writes the parameter space as R^p: the learned group acts on
theta, the concatenation of the flattened parameter tensors, and the action
network reads the data X flattened (Sec. 5.3).  :class:`SampleSpec` records the
shapes once (from ``param_shapes`` and the sampler's first draw) and converts
between the tensors a loss function takes and the flat vectors the network uses;
:func:`draw` samples a fresh batch of (theta, X) per training step, as the papers
do (Zhao 2026, Sec. 6.5.5: "for each training step, parameters are freshly
initialized, and data tensors are sampled i.i.d.").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["SampleSpec", "Sampler", "draw", "check_shapes"]

Sampler = Callable[[torch.Generator], tuple[Sequence[Tensor], Any]]


def check_shapes(shapes: Any, what: str) -> tuple[tuple[int, ...], ...]:
    """Validate a sequence of tensor shapes and return it as a tuple of tuples."""
    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence) or len(shapes) == 0:
        raise TypeError(f"{what} must be a non-empty sequence of shapes, got {shapes!r}")
    out = []
    for shape in shapes:
        if isinstance(shape, torch.Size):
            shape = tuple(shape)
        if not isinstance(shape, Sequence) or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise TypeError(f"{what}: every shape must be a sequence of positive ints, got {shape!r}")
        out.append(tuple(int(d) for d in shape))
    return tuple(out)


@dataclass(frozen=True)
class SampleSpec:
    """Shapes of the parameter tensors and of the data leaves of one sample.

    ``data_is_tensor`` says whether the data is one tensor (``True``) or a tuple of
    tensors (``False``); a loss function receives it in the same form.
    """

    param_shapes: tuple[tuple[int, ...], ...]
    member_names: tuple[str, ...]
    data_shapes: tuple[tuple[int, ...], ...]
    data_is_tensor: bool

    @property
    def num_params(self) -> int:
        """p, the length of theta."""
        return sum(math.prod(s) for s in self.param_shapes)

    @property
    def data_features(self) -> int:
        """The number of data entries the action network reads."""
        return sum(math.prod(s) for s in self.data_shapes)

    # -- parameters ---------------------------------------------------------
    def check_params(self, params: Sequence[Tensor | None], what: str = "params") -> tuple[Tensor, ...]:
        """Raise ``ValueError`` unless ``params`` are tensors with the learned shapes."""
        if isinstance(params, Tensor) or not isinstance(params, Sequence):
            raise TypeError(f"{what} must be a tuple of tensors ({', '.join(self.member_names)}), got {type(params).__name__}")
        if len(params) != len(self.param_shapes):
            raise ValueError(f"{what}: expected {len(self.param_shapes)} tensors ({', '.join(self.member_names)}), got {len(params)}")
        checked: list[Tensor] = []
        for name, shape, p in zip(self.member_names, self.param_shapes, params):
            if not isinstance(p, Tensor):
                raise TypeError(f"{what}: member {name!r} must be a tensor, got {type(p).__name__}")
            if tuple(p.shape) != shape:
                raise ValueError(f"{what}: member {name!r} has shape {tuple(p.shape)}, but the learned action acts on shape {shape}")
            checked.append(p)
        return tuple(checked)

    def flatten(self, params: Sequence[Tensor]) -> Tensor:
        """theta = concatenation of the flattened members (shapes checked)."""
        params = self.check_params(params)
        return torch.cat([p.reshape(-1) for p in params])

    def unflatten(self, theta: Tensor) -> tuple[Tensor, ...]:
        """The member tensors of a flat theta (leading batch axes are kept)."""
        sizes = [math.prod(s) for s in self.param_shapes]
        parts = torch.split(theta, sizes, dim=-1)
        return tuple(part.reshape(*theta.shape[:-1], *shape) for part, shape in zip(parts, self.param_shapes))

    # -- data -------------------------------------------------------------
    def data_leaves(self, data: Any, what: str = "data") -> tuple[Tensor, ...]:
        """The data tensors of one sample, shapes checked (a bare tensor is one leaf)."""
        leaves = (data,) if isinstance(data, Tensor) else data
        if isinstance(leaves, Tensor) or not isinstance(leaves, (tuple, list)):
            raise TypeError(f"{what} must be a tensor or a tuple of tensors, got {type(data).__name__}")
        if len(leaves) != len(self.data_shapes):
            raise ValueError(f"{what}: expected {len(self.data_shapes)} tensor(s) of shapes {list(self.data_shapes)}, got {len(leaves)}")
        for i, (leaf, shape) in enumerate(zip(leaves, self.data_shapes)):
            if not isinstance(leaf, Tensor):
                raise TypeError(f"{what}[{i}] must be a tensor, got {type(leaf).__name__}")
            if tuple(leaf.shape) != shape:
                raise ValueError(
                    f"{what}[{i}] has shape {tuple(leaf.shape)}, but the action was learned on data of shape {shape} "
                    "(a data-dependent symmetry holds for batches of the learned size; Zhao et al. 2024b, Prop. 4.4)"
                )
        return tuple(leaves)

    def rebuild_data(self, leaves: Sequence[Tensor]) -> Any:
        """The form a loss function takes: one tensor or a tuple."""
        return leaves[0] if self.data_is_tensor else tuple(leaves)

    def features(self, leaves: Sequence[Tensor], batch_dims: int = 0) -> Tensor:
        """vec(X): the data leaves flattened and concatenated (keeping ``batch_dims`` leading axes)."""
        flat = [leaf.reshape(*leaf.shape[:batch_dims], -1) for leaf in leaves]
        return torch.cat(flat, dim=-1)

    @classmethod
    def from_sample(cls, param_shapes: Sequence[Sequence[int]], member_names: Sequence[str] | None, data: Any) -> SampleSpec:
        """The spec of a problem from its declared parameter shapes and one data sample."""
        shapes = check_shapes(param_shapes, "param_shapes")
        if member_names is None:
            names = tuple(f"theta{i}" for i in range(len(shapes)))
        else:
            names = tuple(member_names)
            if len(names) != len(shapes) or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"member_names must be {len(shapes)} non-empty strings, got {member_names!r}")
            if len(set(names)) != len(names):
                raise ValueError(f"member_names must be distinct, got {names!r}")
        is_tensor = isinstance(data, Tensor)
        leaves = (data,) if is_tensor else data
        if not isinstance(leaves, (tuple, list)) or not leaves or not all(isinstance(t, Tensor) for t in leaves):
            raise TypeError(f"the sampler's data must be a tensor or a non-empty tuple of tensors, got {type(data).__name__}")
        return cls(shapes, names, tuple(tuple(t.shape) for t in leaves), is_tensor)

    def config(self) -> dict:
        """Plain data for saving."""
        return {
            "param_shapes": [list(s) for s in self.param_shapes],
            "member_names": list(self.member_names),
            "data_shapes": [list(s) for s in self.data_shapes],
            "data_is_tensor": self.data_is_tensor,
        }

    @classmethod
    def from_config(cls, config: dict) -> SampleSpec:
        """Inverse of :meth:`config`."""
        return cls(
            tuple(tuple(s) for s in config["param_shapes"]),
            tuple(config["member_names"]),
            tuple(tuple(s) for s in config["data_shapes"]),
            bool(config["data_is_tensor"]),
        )


def _first_non_finite(t: Tensor) -> int:
    return int((~torch.isfinite(t)).reshape(t.shape[0], -1).any(dim=1).nonzero()[0])


def draw(
    sampler: Sampler, generator: torch.Generator, batch_size: int, spec: SampleSpec, dtype: torch.dtype
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """A batch of ``batch_size`` samples: theta (B, p) and the stacked data leaves (B, ...).

    A sampler with a ``sample_batch(generator, n)`` method (returning the parameters
    and data leaves stacked on a new first axis, as :class:`GaussianSampler
    <teleopt.discovery.problems.GaussianSampler>` does) is asked for the whole batch
    at once.  Raises ``ValueError`` naming the member or data leaf when the sampler
    returns a wrong shape or a non-finite value.
    """
    if hasattr(sampler, "sample_batch"):
        params, data = sampler.sample_batch(generator, batch_size)
        if any(t.shape[0] != batch_size for t in (*params, *data)):
            raise ValueError(f"sampler.sample_batch must return tensors with a first axis of length {batch_size}")
        spec.check_params([p[0] for p in params], "sampler params")
        spec.data_leaves([d[0] for d in data], "sampler data")
        theta = torch.cat([p.reshape(batch_size, -1) for p in params], dim=1).to(dtype)
        stacked = tuple(leaf.to(dtype) for leaf in data)
    else:
        thetas, leaves = [], []
        for _ in range(batch_size):
            params, data = sampler(generator)
            thetas.append(spec.flatten(spec.check_params(params, "sampler params")))
            leaves.append(spec.data_leaves(data, "sampler data"))
        theta = torch.stack(thetas).to(dtype)
        stacked = tuple(torch.stack([sample[i] for sample in leaves]).to(dtype) for i in range(len(spec.data_shapes)))
    if not bool(torch.isfinite(theta).all()):
        i = _first_non_finite(theta)
        bad = [n for n, t in zip(spec.member_names, spec.unflatten(theta[i])) if not bool(torch.isfinite(t).all())]
        raise ValueError(f"the sampler returned non-finite parameters (member {bad[0]!r} of sample {i} in the batch)")
    for j, leaf in enumerate(stacked):
        if not bool(torch.isfinite(leaf).all()):
            raise ValueError(f"the sampler returned non-finite data (data[{j}] of sample {_first_non_finite(leaf)} in the batch)")
    return theta, stacked
