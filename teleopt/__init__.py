"""teleopt: parameter-space symmetries for everyday PyTorch training.

Group actions and their registry (papers/001 Table 1.1), symmetry teleportation
(papers/001 Ch. 4-5), symmetry removal with syre (papers/003) and learned group
actions (papers/000), as drop-in ``torch.optim`` wrappers.

Public names are imported lazily (PEP 562), so ``import teleopt`` is cheap and the
pytest plugin ``teleopt.testing.plugin`` does not import torch until a fixture runs.
Importing any of them imports ``teleopt.actions``, which registers the known actions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from teleopt._lazy import lazy_attributes

__version__ = "0.1.0.dev0"

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
    "discover": "teleopt.discovery",
    "LearnedAction": "teleopt.discovery",
}

__all__ = [*_LAZY, "__version__"]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if TYPE_CHECKING:
    from teleopt.actions.axis import AxisAction, Member
    from teleopt.actions.base import ExampleProblem, GroupAction
    from teleopt.detection import SymmetryReport, find_symmetries
    from teleopt.discovery import LearnedAction, discover
    from teleopt.registry import get_action, list_actions, register_action, unregister_action
    from teleopt.site import Site
    from teleopt.syre import Syre
    from teleopt.teleport import Teleport
