"""The known group actions (Zhao 2026, Table 1.1 and Ch. 4, Zhao et al. 2023).

``KNOWN_ACTIONS`` is what :mod:`teleopt.registry` registers before its first use; this
package does not import the registry (actions sit below it in teleopt's layers).
"""

from teleopt.actions.attention import AttentionHeadPermutation, AttentionQK, AttentionVO
from teleopt.actions.axis import AxisAction, Member
from teleopt.actions.base import ExampleProblem, GroupAction
from teleopt.actions.batchnorm import BatchNormScaling
from teleopt.actions.data_dependent import DataDependentGL, DataDependentGLLstsq
from teleopt.actions.feedforward import (
    GLLinear,
    HiddenPermutation,
    PositiveRescaling,
    RadialOrthogonal,
    RBFPermutation,
    SignFlipAction,
)
from teleopt.actions.lora import LoRAGL
from teleopt.actions.nonlinear import NonlinearGL
from teleopt.actions.residual import ResidualRotation
from teleopt.actions.softmax import SoftmaxTranslation
from teleopt.actions.test_functions import Booth, QuadraticOrthogonal, Rosenbrock

KNOWN_ACTIONS = (
    GLLinear,
    PositiveRescaling,
    SignFlipAction,
    RadialOrthogonal,
    BatchNormScaling,
    SoftmaxTranslation,
    HiddenPermutation,
    RBFPermutation,
    AttentionQK,
    AttentionVO,
    AttentionHeadPermutation,
    ResidualRotation,
    LoRAGL,
    DataDependentGL,
    DataDependentGLLstsq,
    NonlinearGL,
    Rosenbrock,
    Booth,
    QuadraticOrthogonal,
)

__all__ = [
    "GroupAction",
    "AxisAction",
    "Member",
    "ExampleProblem",
    "KNOWN_ACTIONS",
    *[c.__name__ for c in KNOWN_ACTIONS],
]
