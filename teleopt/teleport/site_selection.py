"""Which sites a ``Teleport``'s teleports move: the given ones, or ``sites="auto"`` detection and its policy; and
what an FSDP2 model supports.

Detection (:func:`~teleopt.teleport.sites.detect_sites`, ``teleopt.find_symmetries``) runs on the example inputs,
else on the first teleport batch or the last forward's inputs; an FSDP2 model is detected on an unsharded twin
and keeps fast-path sites only.  Under a base optimizer whose steps are scale-free (Adam family, Adagrad,
RMSprop, unmodelled ones) the normalisation-affine rescalings are left out as well, unless every weight they
rescale besides the norms' own is scale-invariant (:func:`~teleopt.teleport.norm_sites.norm_sites_left_out`):
rescaling a norm's gain against a weight that is not changes effective learning rates for good.  One
``UserWarning`` lists what was left out and why (``report.skipped`` repeats it on every teleport).

Each teleport moves the sites whose members are usable now (:func:`~teleopt.teleport.sites.active_sites`:
trainable, updated by the optimizer, teleports enabled for their param group).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.optim import Optimizer

from teleopt.functional import Batch
from teleopt.site import Site
from teleopt.teleport.fast_path import fast_path_eligible
from teleopt.teleport.norm_sites import norm_sites_left_out
from teleopt.teleport.objectives import Objective
from teleopt.teleport.paper_compat import check_paper_compat_sites
from teleopt.teleport.safety import SafetyConfig
from teleopt.teleport.search import SearchConfig
from teleopt.teleport.sites import detect_sites, unsharded_twin, validate_sites, warn_left_out

__all__ = ["AutoSites", "check_sharded_support"]


@dataclass(frozen=True)
class AutoSites:
    """Detection for one ``Teleport``: its model and innermost base optimizer; ``searched``: the objective searches
    (not closed form); ``sharded``: an FSDP2 model.  The param groups are passed per call (``load_state_dict``
    gives the wrapper new ones)."""

    module: nn.Module
    optimizer: Optimizer
    searched: bool
    sharded: bool

    def initial(
        self, sites: str | Sequence[Site], param_groups: Sequence[dict[str, Any]], example: Batch | None, paper_compat: bool
    ) -> tuple[list[Site] | None, dict[str, str]]:
        """The sites given (validated), else those detected on ``example`` (``None`` without one: detected at the first
        teleport), and those left out with the reason; ``paper_compat`` takes explicit GL sites only."""
        found: list[Site] | None = None
        skipped: dict[str, str] = {}
        if isinstance(sites, str):
            if sites != "auto":
                raise ValueError(f"sites must be 'auto' or a list of Site, got {sites!r}")
            if example is not None:
                found, skipped = self.detect(example, param_groups, stacklevel=6)  # the user line that builds Teleport
        else:
            found = validate_sites(sites, self.module, param_groups, given=True)
        if paper_compat:
            if found is None:
                raise ValueError("paper_compat needs explicit GL sites (sites='auto' finds exact ones only)")
            check_paper_compat_sites(found)
        return found, skipped

    def detect(self, batch: Batch, param_groups: Sequence[dict[str, Any]], stacklevel: int = 3) -> tuple[list[Site], dict[str, str]]:
        """The sites found on ``batch``'s inputs under ``param_groups`` and those left out with the reason; warns
        about the latter."""
        module, groups = self.module, param_groups
        if self.sharded:  # detection traces the whole module: an unsharded twin, gathered once (same names)
            module, groups = unsharded_twin(module, groups)
        found, skipped = detect_sites(module, groups, batch.inputs, batch.kwargs, self.searched)
        if self.sharded:
            for site in [s for s in found if not fast_path_eligible(s)]:
                skipped[site.name] = "not a fast-path site (an FSDP2 teleport takes the fast path only)"
            found = [s for s in found if fast_path_eligible(s)]
        norm = norm_sites_left_out(found, module, self.optimizer, batch, groups)
        if norm:
            self._warn_norm(norm, stacklevel + 1)
            found = [s for s in found if s.name not in set(norm)]
        why = f"normalisation-affine rescaling of weights not scale-invariant or not under decoupled decay under {self._base_name}"
        reasons = {**skipped, **{n: why for n in norm}}
        warn_left_out(skipped, stacklevel=stacklevel, none_left=None if found else reasons)
        return found, reasons

    @property
    def _base_name(self) -> str:
        return type(self.optimizer).__name__

    def _warn_norm(self, norm: list[str], stacklevel: int) -> None:
        shown = ", ".join(norm[:3]) + (f" and {len(norm) - 3} more" if len(norm) > 3 else "")
        warnings.warn(
            f"Teleport(sites='auto') leaves out {len(norm)} normalisation-affine rescaling site(s) ({shown}): under "
            f"{self._base_name}, whose steps do not scale with the gradient, rescaling a norm's gain "
            "against weights that are not scale-invariant (no norm after them) or not under decoupled decay changes their effective "
            "learning rates for good (it collapsed a ViT under AdamW); those of decayed BatchNorm'd convolutions are "
            "kept. Pass the sites explicitly to include them.",
            UserWarning,
            stacklevel=stacklevel,
        )


def check_sharded_support(sites: Sequence[Site] | None, search: SearchConfig, objective: Objective, safety: SafetyConfig) -> None:
    """Raise ``ValueError`` unless an FSDP2 (``fully_shard``) model can teleport so: explicit fast-path sites
    (``sites`` ``None``: ``"auto"`` without example inputs) and objectives without a batch."""
    why = None
    if sites is None:
        why = "sites='auto' without example_inputs (detection runs on an unsharded copy, built when Teleport is)"
    elif search.paper_compat:
        why = "paper_compat (its engine evaluates the model functionally)"
    elif objective.needs_batch:
        why = f"objective {objective.name!r} (it evaluates the model functionally on a batch)"
    elif search.path == "general" or not all(fast_path_eligible(s) for s in sites):
        why = "the general path (data-dependent, approximate or learned sites evaluate the model functionally)"
    elif safety.stability_margin is not None:
        why = "SafetyConfig(stability_margin=...) (the sharpness cap evaluates the model functionally)"
    if why is not None:
        raise ValueError(
            f"Teleport on an FSDP2 (fully_shard) model supports the fast path only (explicit exact linear sites, "
            f"objectives without a batch); not {why}"
        )
