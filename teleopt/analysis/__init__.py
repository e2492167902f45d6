"""Analysis tools built on parameter-space symmetries.

* conserved quantities of gradient flow Q_M = <theta, M . theta> for every exact
  linear site, the angular-momentum relation of orthogonal sites, eq. 2.17 for
  whitened input, and a monitor of their drift in training (Zhao 2026, Sec. 2.5-2.6,
  App. A.4; Zhao et al. 2023, Sec. 5);
* an RK4 gradient-flow integrator to check conservation laws;
* orbit points g . theta, one-parameter curves exp(tM) . theta and group-action
  ensembles with the paper's random baselines (Zhao 2026, Sec. 2.9, Zhao et al. 2023, Sec. 6);
* learned invariance of linear models: finite linear groups on inputs, the Reynolds
  split of weights, the asymmetry measure and the closed-form flow (Gideoni 2023).

Names are imported lazily (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from teleopt._lazy import lazy_attributes

_LAZY = {
    "ConservedQuantities": "teleopt.analysis.conserved",
    "conserved_quantities": "teleopt.analysis.conserved",
    "conserved_quantity_kind": "teleopt.analysis.conserved",
    "angular_momentum": "teleopt.analysis.conserved",
    "whitened_conserved_quantity": "teleopt.analysis.conserved",
    "expected_whitened_quantity": "teleopt.analysis.conserved",
    "ConservationMonitor": "teleopt.analysis.monitor",
    "MonitorRecord": "teleopt.analysis.monitor",
    "GradientFlowTrajectory": "teleopt.analysis.gradient_flow",
    "integrate_gradient_flow": "teleopt.analysis.gradient_flow",
    "OrbitSample": "teleopt.analysis.orbits",
    "OrbitCurve": "teleopt.analysis.orbits",
    "orbit_point": "teleopt.analysis.orbits",
    "sample_orbit": "teleopt.analysis.orbits",
    "orbit_curve": "teleopt.analysis.orbits",
    "orbit_outputs": "teleopt.analysis.orbits",
    "ParameterEnsemble": "teleopt.analysis.ensemble",
    "GroupEnsemble": "teleopt.analysis.ensemble",
    "BaselineEnsemble": "teleopt.analysis.ensemble",
    "BASELINES": "teleopt.analysis.ensemble",
    "COMBINE": "teleopt.analysis.ensemble",
    "FiniteLinearGroup": "teleopt.analysis.invariance",
    "WeightSplit": "teleopt.analysis.invariance",
    "split_weights": "teleopt.analysis.invariance",
    "asymmetry": "teleopt.analysis.invariance",
    "orbit_closure": "teleopt.analysis.invariance",
    "LinearRegressionFlow": "teleopt.analysis.invariance",
    "linear_regression_flow": "teleopt.analysis.invariance",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

if TYPE_CHECKING:
    from teleopt.analysis.conserved import (
        ConservedQuantities,
        angular_momentum,
        conserved_quantities,
        conserved_quantity_kind,
        expected_whitened_quantity,
        whitened_conserved_quantity,
    )
    from teleopt.analysis.ensemble import BASELINES, COMBINE, BaselineEnsemble, GroupEnsemble, ParameterEnsemble
    from teleopt.analysis.gradient_flow import GradientFlowTrajectory, integrate_gradient_flow
    from teleopt.analysis.invariance import (
        FiniteLinearGroup,
        LinearRegressionFlow,
        WeightSplit,
        asymmetry,
        linear_regression_flow,
        orbit_closure,
        split_weights,
    )
    from teleopt.analysis.monitor import ConservationMonitor, MonitorRecord
    from teleopt.analysis.orbits import OrbitCurve, OrbitSample, orbit_curve, orbit_outputs, orbit_point, sample_orbit
