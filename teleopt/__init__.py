"""teleopt: parameter-space symmetries for everyday PyTorch training.

Group actions and their registry (papers/001 Table 1.1), symmetry teleportation
(papers/001 Ch. 4-5), symmetry removal with syre (papers/003) and learned group
actions (papers/000), as drop-in ``torch.optim`` wrappers.
"""

from teleopt import actions
from teleopt.actions.axis import AxisAction, Member
from teleopt.actions.base import ExampleProblem, GroupAction
from teleopt.registry import get_action, list_actions, register_action, unregister_action
from teleopt.site import Site

__version__ = "0.1.0.dev0"

__all__ = [
    "GroupAction",
    "AxisAction",
    "Member",
    "ExampleProblem",
    "Site",
    "register_action",
    "unregister_action",
    "get_action",
    "list_actions",
    "actions",
    "__version__",
]
