"""Symmetry teleportation (Zhao 2026, Ch. 4-5) as a drop-in optimizer wrapper.

:class:`Teleport` wraps any ``torch.optim`` optimizer.  On a :class:`Schedule` it
searches the continuous symmetry groups of the model's sites for the element
that best serves an objective, applies it exactly, moves ``.grad`` and the
optimizer state consistently, checks the result and lets the base optimizer
step.  The concepts live in one module each:

* :mod:`~teleopt.teleport.optimizer`: the wrapper (``Teleport``), configured by
  :mod:`~teleopt.teleport.config` (group objects and keyword shortcuts);
* :mod:`~teleopt.teleport.engine`: one teleport as a pipeline of four phases (plan,
  :mod:`~teleopt.teleport.search_phase`, :mod:`~teleopt.teleport.apply_phase`,
  :mod:`~teleopt.teleport.verify_phase`) handing on the frozen values of
  :mod:`~teleopt.teleport.phases`; :mod:`~teleopt.teleport.evaluator`: the protocol objectives
  evaluate g . w through; :mod:`~teleopt.teleport.search`: the pluggable search
  (``SearchStrategy``, default ``GradientAscent``; ``ClosedForm`` for objectives
  solved in closed form, such as ``"balance"``); :mod:`~teleopt.teleport.sites`:
  binding sites to the model and optimizer; :mod:`~teleopt.teleport.site_selection`:
  which sites each teleport moves (``sites="auto"`` and what it leaves out);
* :mod:`~teleopt.teleport.schedule`: when to teleport (Algorithm 1's set K);
* :mod:`~teleopt.teleport.objectives`: gradient norm, preconditioned norm,
  one-step lookahead loss, sharpness (eq. 5.1), curvature (eq. 5.2), balance
  (least weight norm on the orbit, the balanced point A A^T = B^T B of GL sites
  such as LoRA pairs; closed form in :mod:`~teleopt.teleport.balance`);
* :mod:`~teleopt.teleport.coordinates` and :mod:`~teleopt.teleport.ascent`:
  Lie-algebra coordinates, trust region, projected ascent;
* :mod:`~teleopt.teleport.fast_path`: closed-form gradient transport over the
  group coordinates, no model pass (Prop. 4.5.1);
* :mod:`~teleopt.teleport.general_path`: ``torch.func`` evaluation on a batch for
  data-dependent, approximate and learned sites;
* :mod:`~teleopt.teleport.transport`: composition order of overlapping sites;
* :mod:`~teleopt.teleport.optimizer_model` and :mod:`~teleopt.teleport.state_policy`:
  the base optimizer's update and its state under teleports;
* :mod:`~teleopt.teleport.check`: every teleport's check of the model outputs
  (teleport batch, closure or probe inputs);
* :mod:`~teleopt.teleport.safety`, :mod:`~teleopt.teleport.watch` and
  :mod:`~teleopt.teleport.rollback`: caps, post-conditions, rollback and the watch;
* :mod:`~teleopt.teleport.distributed`: identical parameters on every rank;
* :mod:`~teleopt.teleport.paper_compat`: the papers' first-order, non-invariant
  teleport, for comparisons.
"""

from teleopt.teleport.evaluator import Evaluator
from teleopt.teleport.objectives import (
    Balance,
    Curvature,
    GradientNorm,
    Lookahead,
    Objective,
    PreconditionedNorm,
    Sharpness,
    get_objective,
)
from teleopt.teleport.optimizer import Teleport
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import SafetyConfig
from teleopt.teleport.schedule import Schedule
from teleopt.teleport.search import (
    BoundaryStep,
    ClosedForm,
    GradientAscent,
    SearchConfig,
    SearchProblem,
    SearchResult,
    SearchStrategy,
)
from teleopt.teleport.state_policy import StatePolicy

__all__ = [
    "Teleport",
    "TeleportReport",
    "Schedule",
    "SafetyConfig",
    "StatePolicy",
    "SearchConfig",
    "SearchStrategy",
    "SearchProblem",
    "SearchResult",
    "GradientAscent",
    "BoundaryStep",
    "ClosedForm",
    "Evaluator",
    "Objective",
    "GradientNorm",
    "PreconditionedNorm",
    "Lookahead",
    "Sharpness",
    "Curvature",
    "Balance",
    "get_objective",
]
