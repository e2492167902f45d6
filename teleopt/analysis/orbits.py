"""Orbits of a model's parameters under its symmetry sites: points g . theta and curves exp(tM) . theta.

A group acting on the parameters sweeps out, from the trained point theta, its
orbit {g . theta : g in G}.  For an exact symmetry every point of the orbit has the
same loss (Zhao 2026, Sec. 1.1, Zhao et al. 2023, Prop. 3.2 / App. C.6), and a generator M
of the Lie algebra gives a curve of equal loss through theta, the one-parameter
subgroup t -> exp(tM) . theta (Zhao 2026, Sec. 2.9 and Ch. 3: curves on minima;
Zhao et al. 2023, Sec. 6: such points build ensembles without retraining).  For a
data-dependent action (Zhao 2026, Prop. 4.4.2 and eq. 4.16, Zhao et al. 2023, Theorem 4.1,
eq. 7) the output is kept on the batch the action is built on only.

The tools here are functional: they read the model's tensors and never modify the
model.  Every point is a ``dict`` from qualified ``state_dict`` names to tensors
holding the acted-on members (plus whatever the starting point ``at`` held), to be
evaluated with ``torch.func.functional_call(model, point, inputs)`` (names missing
from the point take the model's own values) or with :func:`orbit_outputs`.

Several sites act together by composition in list order, as in Teleport's general
path: each site acts on the values the sites before it produced, and a
data-dependent site reads its batch (the input of the module its ``data_input``
names) at those values.  Sites must act on disjoint tensors: where two sites share
a tensor (the two hidden-layer rescalings of an MLP share the middle weight, a
permutation and a rescaling of one layer share all three) the order would matter
and a curve would in general not be a one-parameter subgroup, so this raises; act
with one site and pass its point as ``at=`` to the next to compose them in an
order you choose.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from teleopt.actions.base import required
from teleopt.functional import FunctionalModel
from teleopt.site import Site, as_sites, lookup_tensor

__all__ = ["OrbitSample", "OrbitCurve", "orbit_point", "sample_orbit", "orbit_curve", "orbit_outputs"]

Point = dict[str, Tensor]


class _Points:
    """Sequence access to the ``points`` of an orbit result."""

    points: tuple[Point, ...]

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> Point:
        return self.points[index]

    def __iter__(self) -> Iterator[Point]:
        return iter(self.points)


@dataclass(frozen=True)
class OrbitSample(_Points):
    """Points g_k . theta of an orbit (:func:`sample_orbit`).

    Attributes
    ----------
    sites:
        The sites that acted, in composition order.
    elements:
        For each point, one group element per site.
    points:
        For each point, the acted-on tensors by qualified name (a ``functional_call`` dict).
    """

    sites: tuple[Site, ...]
    elements: tuple[tuple[Tensor, ...], ...]
    points: tuple[Point, ...]


@dataclass(frozen=True)
class OrbitCurve(_Points):
    """A one-parameter curve t -> exp(t M) . theta on the orbit (:func:`orbit_curve`).

    Attributes
    ----------
    sites:
        The sites that acted, in composition order.
    coords:
        The generator M of each site as Lie algebra coordinates.
    times:
        The grid of t (float64, one dimension).
    points:
        For each t, the acted-on tensors by qualified name.
    """

    sites: tuple[Site, ...]
    coords: tuple[Tensor, ...]
    times: Tensor
    points: tuple[Point, ...]


def _as_sites(sites: Site | Sequence[Site]) -> tuple[Site, ...]:
    sites = as_sites(sites)
    if not sites:
        raise ValueError("sites is empty: give at least one Site")
    owner: dict[str, str] = {}
    for site in sites:
        for name in dict.fromkeys(site.tensor_names):
            if name in owner:
                raise ValueError(
                    f"sites {owner[name]!r} and {site.name!r} both act on {name!r}: orbit tools compose sites on "
                    "disjoint tensors only (with shared tensors the order matters); act with one site and pass "
                    "its point as at= to the next"
                )
            owner[name] = site.name
    return sites


def _as_inputs(inputs: Any) -> tuple[Any, ...] | None:
    if inputs is None:
        return None
    if isinstance(inputs, Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    raise TypeError(f"inputs must be a tensor or a tuple of model inputs, got {type(inputs).__name__}")


def _start(model: nn.Module, sites: tuple[Site, ...], at: Mapping[str, Tensor] | None) -> Point:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if at is not None and not isinstance(at, Mapping):
        raise TypeError(f"at must be a mapping from tensor names to tensors, got {type(at).__name__}")
    point: Point = dict(at or {})
    for site in sites:
        for name in site.tensor_names:
            if name not in point:
                point[name] = lookup_tensor(model, name).detach()
    return point


def _params(site: Site, point: Mapping[str, Tensor]) -> tuple[Tensor | None, ...]:
    return tuple(None if n is None else point[n] for n in site.members)


class _Actor:
    """Acts with sites in order on a point, reading data-dependent batches at the current point."""

    def __init__(self, model: nn.Module, sites: tuple[Site, ...], inputs: Any) -> None:
        self.sites = sites
        self.inputs = _as_inputs(inputs)
        self.fmodel: FunctionalModel | None = None
        for site in sites:
            if site.action.needs_data or site.data_input is not None:
                if site.data_input is None:
                    raise ValueError(f"site {site.name!r} is data-dependent but names no data_input module")
                if self.inputs is None:
                    raise ValueError(
                        f"site {site.name!r} ({site.action.name}) is data-dependent: it keeps the output only on a "
                        "given batch, so pass inputs=<the model inputs of that batch>"
                    )
                self.fmodel = FunctionalModel(model, None)

    def act(self, elements: Sequence[Tensor], point: Point) -> Point:
        cur = dict(point)
        for site, g in zip(self.sites, elements):
            vals = _params(site, cur)
            data = None
            if self.fmodel is not None and site.data_input is not None:
                assert self.inputs is not None  # __init__ sets fmodel only when inputs were given
                data = self.fmodel.module_input(cur, (self.inputs, None), site.data_input)
            new = site.action.act(g, vals, data)
            for name, value in zip(site.members, new):
                if name is not None:
                    cur[name] = required(value, name)
        return cur


def _validated(site: Site, g: Any, params: tuple[Tensor | None, ...]) -> Tensor:
    if not isinstance(g, Tensor):
        raise TypeError(f"site {site.name!r}: group element must be a torch.Tensor, got {type(g).__name__}")
    try:
        site.action.validate_element(g, params)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"site {site.name!r}: {exc}") from None
    return g


def orbit_point(
    model: nn.Module,
    sites: Site | Sequence[Site],
    elements: Tensor | Sequence[Tensor],
    *,
    inputs: Any = None,
    at: Mapping[str, Tensor] | None = None,
) -> Point:
    """The point g . theta for one group element per site (Zhao 2026, Def. 1.1.1; Zhao et al. 2023, eq. 7).

    Parameters
    ----------
    model:
        The model whose tensors theta are read (never modified).
    sites:
        One site or several sites on disjoint tensors, composed in order.
    elements:
        One element per site (a tensor for a single site).
    inputs:
        The model inputs of the batch data-dependent sites hold on (required for them).
    at:
        The point theta to act on (names it lacks take the model's values); default the model itself.

    Returns
    -------
    dict
        ``at`` (if given) updated with every acted-on tensor, by qualified name.
    """
    sites = _as_sites(sites)
    if isinstance(elements, Tensor):
        elements = (elements,)
    elements = tuple(elements)
    if len(elements) != len(sites):
        raise ValueError(f"need one group element per site: {len(sites)} sites, {len(elements)} elements")
    point = _start(model, sites, at)
    checked = [_validated(site, g, _params(site, point)) for site, g in zip(sites, elements)]
    return _Actor(model, sites, inputs).act(checked, point)


def _check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
    return float(scale)


def sample_orbit(
    model: nn.Module,
    sites: Site | Sequence[Site],
    count: int,
    *,
    scale: float = 1.0,
    generator: torch.Generator | None = None,
    inputs: Any = None,
    at: Mapping[str, Tensor] | None = None,
) -> OrbitSample:
    """``count`` random points g . theta of the orbit (Zhao et al. 2023, Sec. 6, App. I).

    Elements come from ``GroupAction.random_element``: for continuous groups
    exp of random Lie algebra coordinates of size ``scale`` (GL/O(n): coordinates
    with N(0, scale^2 / n) entries; positive scalings: log-scales N(0, scale^2)),
    for finite groups uniformly random permutations or sign patterns (``scale``
    is unused).  Elements are drawn point by point, site by site, from
    ``generator``.  ``inputs`` and ``at`` are as in :func:`orbit_point`.
    """
    sites = _as_sites(sites)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    scale = _check_scale(scale)
    point = _start(model, sites, at)
    actor = _Actor(model, sites, inputs)
    elements = tuple(
        tuple(site.action.random_element(_params(site, point), generator=generator, scale=scale) for site in sites) for _ in range(count)
    )
    points = tuple(actor.act(gs, point) for gs in elements)
    return OrbitSample(sites, elements, points)


def _as_times(times: Any) -> Tensor:
    if isinstance(times, Tensor):
        if times.is_complex() or times.dtype == torch.bool:
            raise TypeError(f"times must be real numbers, got a {times.dtype} tensor")
        if times.ndim > 1:
            raise ValueError(f"times must be a scalar or one-dimensional, got shape {tuple(times.shape)}")
        t = times.detach().to(torch.float64, copy=True).reshape(-1)
    else:
        try:
            t = torch.tensor(times, dtype=torch.float64).reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"times must be a number, a sequence of numbers or a 1-D tensor, got {times!r}") from None
    if t.numel() == 0:
        raise ValueError("times is empty: give at least one t")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"times must be finite, got {t.tolist()}")
    return t


def _checked_coords(site: Site, coords: Any, params: tuple[Tensor | None, ...]) -> Tensor:
    shape = site.action.coord_shape(params)
    if shape is None:
        raise TypeError(
            f"site {site.name!r} ({site.action.group_name}) is a finite group: it has no Lie algebra, so no "
            "one-parameter curve; use orbit_point or sample_orbit"
        )
    if not isinstance(coords, Tensor):
        raise TypeError(f"site {site.name!r}: generator coordinates must be a torch.Tensor, got {type(coords).__name__}")
    if tuple(coords.shape) != tuple(shape):
        raise ValueError(f"site {site.name!r}: generator coordinates must have shape {tuple(shape)}, got {tuple(coords.shape)}")
    if not coords.is_floating_point():
        raise TypeError(f"site {site.name!r}: generator coordinates must be floating point, got {coords.dtype}")
    if not bool(torch.isfinite(coords).all()):
        raise ValueError(f"site {site.name!r}: generator coordinates have non-finite entries")
    ref = next(p for p in params if p is not None)
    return coords.to(ref.dtype)


def orbit_curve(
    model: nn.Module,
    sites: Site | Sequence[Site],
    coords: Tensor | Sequence[Tensor],
    times: Any,
    *,
    inputs: Any = None,
    at: Mapping[str, Tensor] | None = None,
) -> OrbitCurve:
    """The curve t -> exp(t M) . theta over a grid of t (Zhao 2026, Sec. 2.9, Ch. 3; Zhao et al. 2023, Sec. 3).

    ``coords`` are the Lie algebra coordinates of the generator M of each site
    (shape ``site.action.coord_shape``; for O(n) sites the skew-symmetric part
    generates).  For a linear action (and any true group action on a fixed batch)
    the curve is a one-parameter subgroup: curve(0) = theta and
    curve(t + s) = exp(s M) . curve(t).  For an exact symmetry the loss is constant
    along it.  ``inputs`` and ``at`` are as in :func:`orbit_point`.
    """
    sites = _as_sites(sites)
    if isinstance(coords, Tensor):
        coords = (coords,)
    if isinstance(coords, (str, bytes)) or not isinstance(coords, Sequence):
        raise TypeError(f"coords must be a tensor or a sequence of tensors (one per site), got {type(coords).__name__}")
    coords = tuple(coords)
    if len(coords) != len(sites):
        raise ValueError(f"need one generator per site: {len(sites)} sites, {len(coords)} generators")
    t = _as_times(times)
    point = _start(model, sites, at)
    checked = tuple(_checked_coords(site, c, _params(site, point)) for site, c in zip(sites, coords))
    actor = _Actor(model, sites, inputs)
    points = []
    for tk in t.tolist():
        elements = [site.action.exp(tk * c, _params(site, point)) for site, c in zip(sites, checked)]
        points.append(actor.act(elements, point))
    return OrbitCurve(sites, checked, t, tuple(points))


def orbit_outputs(model: nn.Module, points: OrbitSample | OrbitCurve | Sequence[Mapping[str, Tensor]], inputs: Any) -> Tensor:
    """The model's outputs at each point, stacked on a new leading axis (``functional_call``).

    Buffers are copied once, so BatchNorm running statistics of ``model`` are not
    touched even in training mode.  The model output must be a tensor.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    args = _as_inputs(inputs)
    if args is None:
        raise ValueError("orbit_outputs needs the model inputs")
    fmodel = FunctionalModel(model, None)
    outs = []
    for point in points:
        out = fmodel.output(point, (args, None))
        if not isinstance(out, Tensor):
            raise TypeError(f"orbit_outputs needs a model returning a tensor, got {type(out).__name__}")
        outs.append(out)
    if not outs:
        raise ValueError("points is empty")
    return torch.stack(outs)
