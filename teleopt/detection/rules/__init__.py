"""Op rules: how each op of a traced graph ties, blocks or reshapes the axes it touches.

For every node, the rule of its op (``teleopt.detection.ops`` names it) states,
per group kind, the relations between the axes of its inputs, outputs and
parameters (see ``teleopt.detection.relations``).  The facts used are those of
Zhao 2026, Sec. 1.2:

* a layer y = W x + b is a boundary: its output axis is written by the rows of W
  and by b (g), its input axis read by the columns of W (g^{-T}), Prop. 1.2.3;
* pointwise maps pass permutations (Ex. 1.2.9), positively homogeneous ones of
  degree alpha pass positive scaling with power alpha (Ex. 1.2.4), linear ones
  pass GL (Ex. 1.2.2);
* BatchNorm's output scaling is written by its affine weight and bias (exact);
  scaling its input is invariant up to eps with the running mean times c and
  the running variance times c^2 (Ex. 1.2.7, declared approximate);
* LayerNorm/RMSNorm/GroupNorm normalise: they block scaling of their input,
  permutations pass with their affine parameters permuted;
* attention contracts queries with keys: their channels carry g and g^{-T}
  (Ex. 1.2.11); values pass to the output linearly (Ex. 1.2.12);
* reshapes merge or split axes into row-major products (``kron``), concatenation
  and chunking cut axes into segments; a merged axis that is cut freezes with
  its factors;
* a comparison is a mask entry by entry: permutations pass, positive scaling
  only through a sign test; ``topk``/``argmax`` freeze the axis they select along;
* everything else fails closed (a non-float tensor no rule declared is fixed).

Layout: ``context`` (what a rule receives), one module per op family
(``pointwise``, ``arithmetic``, ``reductions``, ``shapes``, ``layers``, ``norms``,
``attention``, ``masks``), ``table`` (op -> rule), ``driver`` (walks a graph),
``register`` (``register_op_rule`` for user ops).
"""

from teleopt.detection.ops import identify_node
from teleopt.detection.rules.context import OpRule, RuleContext
from teleopt.detection.rules.driver import run_rules
from teleopt.detection.rules.pointwise import pointwise_rule
from teleopt.detection.rules.register import OpRuleHandle, register_op_rule
from teleopt.detection.rules.table import BUILTIN_RULES, RULES
from teleopt.detection.views import reshape_groups

__all__ = [
    "run_rules",
    "RULES",
    "BUILTIN_RULES",
    "OpRule",
    "RuleContext",
    "register_op_rule",
    "OpRuleHandle",
    "pointwise_rule",
    "identify_node",
    "reshape_groups",
]
