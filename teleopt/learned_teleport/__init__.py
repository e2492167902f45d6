"""Meta-learned teleportation: Zhao 2026, *Symmetry in Neural Networks*, Sec. 5.5, Algorithm 3.

* :class:`TeleportPolicy`: coordinate-wise LSTMs m1 (update f_t) and m2 (group
  element g_t = exp(xi_t), exactly in the site's group); :meth:`TeleportPolicy.elements`
  is the entry point for ``Teleport``'s search phase.
* :func:`meta_train`: Algorithm 3 over a user-supplied sampler of problems.
* :class:`TwoLayerProblems`: the thesis' problem distribution.
* :class:`LearnedTeleportOptimizer`: run a policy in place on a model.
* :class:`PolicySearch`: a trained policy as ``Teleport``'s search
  (``Teleport(opt, model, sites, search=SearchConfig(strategy=PolicySearch(policy)))``).
"""

from teleopt.learned_teleport.meta_training import (
    MetaTrainResult,
    evaluate,
    meta_train,
    rollout,
)
from teleopt.learned_teleport.policy import (
    CoordinateLSTM,
    LearnedTeleportOptimizer,
    TeleportPolicy,
    preprocess_gradient,
)
from teleopt.learned_teleport.problems import MetaProblem, TwoLayerProblems
from teleopt.learned_teleport.search import PolicySearch

__all__ = [
    "CoordinateLSTM",
    "LearnedTeleportOptimizer",
    "MetaProblem",
    "MetaTrainResult",
    "PolicySearch",
    "TeleportPolicy",
    "TwoLayerProblems",
    "evaluate",
    "meta_train",
    "preprocess_gradient",
    "rollout",
]
