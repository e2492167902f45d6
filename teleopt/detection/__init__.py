"""Detection: find the symmetry sites of any ``nn.Module`` or timm model.

``teleopt.find_symmetries(model, example_inputs)`` traces the model with torch.fx,
follows every tensor axis through the graph with a union-find per group kind
(GL, positive scaling, permutations), recognises layers by what they compute, and
returns a :class:`SymmetryReport` whose sites bind the actions of Zhao 2026
Table 1.1 (and per-head attention GL, Ex. 1.2.11-1.2.12) to the model's
parameters and buffers by name.  Unknown ops fail closed: the axes they touch are
frozen and listed in the report.  Detection proposes, certification decides: every
proposed site is checked numerically on a float64 copy before it is reported
(``certify=True`` by default; ``report.certification`` lists each outcome).

``register_op_rule`` teaches detection an op it has no rule for.

Modules: ``tracing`` (fx graphs with shapes), ``fx_args`` (typed call arguments),
``axes`` (union-find over axes), ``ops`` (what a node computes), ``views`` (how
view ops relabel axes), ``relations`` and ``rules`` (how each op ties or blocks
axes: a table by op family), ``attention`` (head structure), ``sites`` (classes to
sites), ``certify`` (the numerical check), ``report`` (the result), ``detect`` (the pipeline).
"""

from teleopt.detection.certify import CertificationEntry, certify_sites
from teleopt.detection.detect import find_symmetries
from teleopt.detection.report import SkippedEntry, SymmetryReport
from teleopt.detection.rules import OpRuleHandle, RuleContext, pointwise_rule, register_op_rule
from teleopt.detection.tracing import DetectionError

__all__ = [
    "find_symmetries",
    "SymmetryReport",
    "SkippedEntry",
    "DetectionError",
    "CertificationEntry",
    "certify_sites",
    "register_op_rule",
    "pointwise_rule",
    "OpRuleHandle",
    "RuleContext",
]
