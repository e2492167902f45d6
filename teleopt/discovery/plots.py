"""Pictures of learned symmetries: generator heatmaps (Zhao et al. 2024b, Fig. 2-4, Zhao 2026, Fig. 6.3-6.5, 6.7)
and loss along learned vs random curves (Zhao 2026, Fig. 6.6).

matplotlib is imported inside the functions (it is an optional dependency, extra
``demo``); both functions return the figure and save it when given a path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from teleopt.discovery.action import LearnedAction
from teleopt.discovery.diagnostics import CurveComparison

__all__ = ["plot_generators", "plot_curves"]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'teleopt[demo]'") from e
    return plt


def plot_generators(
    generators: LearnedAction | Tensor,
    path: str | os.PathLike | None = None,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Any:
    """Heatmaps of the generators h_i (top row) and of exp(h_i) (bottom row), as Zhao 2026, Fig. 6.4-6.7.

    ``labels`` name the parameter entries along the axes (e.g. ``W1[0,0]``); by
    default the entries are numbered.  Returns the matplotlib figure.
    """
    plt = _pyplot()
    gens = generators.generators if isinstance(generators, LearnedAction) else generators
    if not isinstance(gens, Tensor) or gens.ndim != 3 or gens.shape[1] != gens.shape[2]:
        raise ValueError("plot_generators needs generators of shape (n, p, p) or a LearnedAction")
    gens = gens.detach().to(torch.float64).cpu()
    n, p = gens.shape[0], gens.shape[1]
    elements = torch.linalg.matrix_exp(gens)
    size = max(2.2, min(4.0, 0.12 * p + 1.5))
    fig, axes = plt.subplots(2, n, figsize=(size * n + 0.8, 2 * size + 0.6), squeeze=False)
    for i in range(n):
        for row, (mat, name) in enumerate(((gens[i], f"$h_{{{i + 1}}}$"), (elements[i], f"$\\exp(h_{{{i + 1}}})$"))):
            ax = axes[row][i]
            vmax = float(mat.abs().max()) or 1.0
            im = ax.imshow(mat.numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax)
            ax.set_title(name)
            if labels is not None and p <= 16:
                ax.set_xticks(range(p), labels, rotation=90, fontsize=6)
                ax.set_yticks(range(p), labels, fontsize=6)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_curves(comparison: CurveComparison, path: str | os.PathLike | None = None, title: str | None = None) -> Any:
    """Loss variation vs arc length: median and interquartile band of learned, random-Lie-algebra
    and straight random curves (Zhao 2026, Fig. 6.6), on a log scale.  Returns the figure."""
    plt = _pyplot()
    s = comparison.arc_length.numpy()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    floor = torch.finfo(torch.float64).tiny
    for curves, label, color in (
        (comparison.learned, "learned generators", "C0"),
        (comparison.random, "random Lie algebra elements", "C3"),
        (comparison.straight, "random straight lines", "C7"),
    ):
        flat = curves.reshape(-1, curves.shape[-1]).clamp_min(floor)
        q = torch.quantile(flat, torch.tensor([0.25, 0.5, 0.75], dtype=flat.dtype), dim=0).numpy()
        ax.plot(s[1:], q[1, 1:], color=color, label=label)  # s = 0 has variation 0
        ax.fill_between(s[1:], q[0, 1:], q[2, 1:], color=color, alpha=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("arc length along the curve")
    ax.set_ylabel("|L(gamma(s)) - L(gamma(0))|")
    ax.set_title(title or f"invariance ratio {comparison.invariance_ratio:.3g} ({comparison.learned.shape[0]} samples)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
