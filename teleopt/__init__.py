"""teleopt: parameter-space symmetries for everyday PyTorch training.

Group actions and their registry (Zhao 2026, Table 1.1), symmetry teleportation
(Zhao 2026, Ch. 4-5), symmetry removal with syre (Ziyin et al. 2025) and learned group
actions (Zhao et al. 2024b), as drop-in ``torch.optim`` wrappers; conserved quantities,
orbits, ensembles and learned invariance in ``teleopt.analysis`` (Zhao 2026, Ch. 2,
Zhao et al. 2023, Gideoni 2023).

Public names are imported lazily (PEP 562), so ``import teleopt`` is cheap and the
pytest plugin ``teleopt.testing.plugin`` does not import torch until a fixture runs.
Importing any of them imports ``teleopt.actions``, which registers the known actions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from teleopt._lazy import lazy_attributes
from teleopt._version import __version__

# public name -> module that defines it (add new public names here)
_LAZY = {
    "GroupAction": "teleopt.actions.base",
    "ExampleProblem": "teleopt.actions.base",
    "AxisAction": "teleopt.actions.axis",
    "Member": "teleopt.actions.axis",
    "Site": "teleopt.site",
    "register_action": "teleopt.registry",
    "unregister_action": "teleopt.registry",
    "get_action": "teleopt.registry",
    "list_actions": "teleopt.registry",
    "Syre": "teleopt.syre",
    "Teleport": "teleopt.teleport",
    "find_symmetries": "teleopt.detection",
    "SymmetryReport": "teleopt.detection",
    "register_op_rule": "teleopt.detection",
    "lora_sites": "teleopt.integrations.peft",
    "qk_head_scalings": "teleopt.integrations.qk_clip",
    "discover": "teleopt.discovery",
    "LearnedAction": "teleopt.discovery",
    "conserved_quantities": "teleopt.analysis.conserved",
    "ConservationMonitor": "teleopt.analysis.monitor",
    "sample_orbit": "teleopt.analysis.orbits",
    "orbit_curve": "teleopt.analysis.orbits",
    "GroupEnsemble": "teleopt.analysis.ensemble",
    "FiniteLinearGroup": "teleopt.analysis.invariance",
    "split_weights": "teleopt.analysis.invariance",
    "asymmetry": "teleopt.analysis.invariance",
    "TeleportPolicy": "teleopt.learned_teleport",
    "meta_train": "teleopt.learned_teleport",
}

__all__ = [*_LAZY, "__version__"]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if TYPE_CHECKING:
    from teleopt.actions.axis import AxisAction, Member
    from teleopt.actions.base import ExampleProblem, GroupAction
    from teleopt.analysis.conserved import conserved_quantities
    from teleopt.analysis.ensemble import GroupEnsemble
    from teleopt.analysis.invariance import FiniteLinearGroup, asymmetry, split_weights
    from teleopt.analysis.monitor import ConservationMonitor
    from teleopt.analysis.orbits import orbit_curve, sample_orbit
    from teleopt.detection import SymmetryReport, find_symmetries, register_op_rule
    from teleopt.discovery import LearnedAction, discover
    from teleopt.integrations.peft import lora_sites
    from teleopt.integrations.qk_clip import qk_head_scalings
    from teleopt.learned_teleport import TeleportPolicy, meta_train
    from teleopt.registry import get_action, list_actions, register_action, unregister_action
    from teleopt.site import Site
    from teleopt.syre import Syre
    from teleopt.teleport import Teleport
