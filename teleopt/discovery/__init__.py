"""Learned group actions: discover parameter-space symmetries and use them like known ones (Zhao et al. 2024b).

``teleopt.discover(loss_fn, param_shapes, sampler, ...)`` trains an action network
a_X(g, theta) and Lie algebra generators with the infinitesimal losses of
Zhao et al. 2024b, Sec. 5 and returns a :class:`LearnedAction`, a
:class:`~teleopt.GroupAction` that acts with finite elements exp(t h) by
integrating its learned flow, saves to and loads from one file, registers with
``teleopt.register_action``, binds to matching subnetworks of larger models
(Zhao et al. 2024b, Prop. 4.1, Cor. 4.2-4.3; :func:`bind`) and comes with the diagnostics
of Zhao 2026, Fig. 6.6 (:func:`compare_curves`) and Zhao et al. 2024b, Fig. 2-4
(:func:`plot_generators`).

Modules: ``network`` (the action network), ``losses`` (eq. 5-11), ``training``
(``discover``), ``config`` (its options), ``group`` (the learned Lie group, matrix
logarithm), ``flow`` (RK4), ``action`` (``LearnedAction``, files), ``binding`` (sites in larger
models), ``diagnostics`` and ``plots``, ``problems`` (the papers' problems),
``samples`` (shapes and sampling).
"""

from teleopt.discovery import problems
from teleopt.discovery.action import FILE_FORMAT, FORMAT_VERSION, LearnedAction
from teleopt.discovery.binding import SubnetworkAction, bind, module_input
from teleopt.discovery.config import DiscoveryConfig
from teleopt.discovery.diagnostics import (
    CurveComparison,
    abs_cosine,
    compare_curves,
    data_sensitivity,
    principal_angles,
    span_residual,
)
from teleopt.discovery.group import LearnedLieGroup, matrix_log
from teleopt.discovery.losses import LossWeights, discovery_losses, infinitesimal_action
from teleopt.discovery.network import ActionNetwork
from teleopt.discovery.plots import plot_curves, plot_generators
from teleopt.discovery.training import discover

__all__ = [
    "discover",
    "DiscoveryConfig",
    "LearnedAction",
    "LearnedLieGroup",
    "ActionNetwork",
    "LossWeights",
    "discovery_losses",
    "infinitesimal_action",
    "matrix_log",
    "bind",
    "module_input",
    "SubnetworkAction",
    "CurveComparison",
    "compare_curves",
    "data_sensitivity",
    "span_residual",
    "principal_angles",
    "abs_cosine",
    "plot_generators",
    "plot_curves",
    "problems",
    "FILE_FORMAT",
    "FORMAT_VERSION",
]
