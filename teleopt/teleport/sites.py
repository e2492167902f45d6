"""Binding sites to the model and optimizer a ``Teleport`` wraps: checks and ``sites="auto"`` detection.

A site names tensors of ``model.state_dict()``; a teleport needs every member to
be a floating-point tensor of the model, every parameter member trainable and
updated by the optimizer, one device and one dtype per site, and a data input
for data-dependent actions.  Each check fails with an error naming the site and
the member.  Detected sites (``sites="auto"``) whose parameters the optimizer does
not update, or which are frozen, are left out with the reason instead; so are, under
optimizers with scale-free steps (:func:`scale_free_updates`), the rescalings of
normalisation layers' affine parameters (:func:`normalization_affine`) whose other
weights are not scale-invariant (:mod:`teleopt.teleport.norm_sites`; the wrapper
leaves them out).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.site import Site, lookup_tensor
from teleopt.teleport.optimizer_model import OptimizerModel
from teleopt.teleport.schedule import Schedule

__all__ = [
    "active_sites",
    "check_model_matches_optimizer",
    "validate_sites",
    "detect_sites",
    "unusable",
    "normalization_affine",
    "is_norm",
    "scale_free_updates",
    "warn_scale_free_objective",
    "unsharded_twin",
    "warn_left_out",
]

_NORMS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()
)


def _optimized(param_groups: Sequence[dict[str, Any]]) -> set[int]:
    return {id(p) for g in param_groups for p in g["params"]}


def check_model_matches_optimizer(module: nn.Module, param_groups: Sequence[dict[str, Any]]) -> None:
    """``ValueError`` unless the optimizer updates some parameter of ``module``."""
    optimized = _optimized(param_groups)
    params = list(module.parameters())
    if not params or not any(id(p) in optimized for p in params):
        raise ValueError(
            f"the optimizer does not update any parameter of the model ({type(module).__name__}): "
            "pass the model whose parameters were given to the optimizer"
        )


def _resolve_name(module: nn.Module, name: str) -> str:
    """``name``, or ``name`` without DDP's ``module.`` prefixes, as a tensor of ``module``."""
    try:
        lookup_tensor(module, name)
        return name
    except KeyError:
        if name.startswith("module."):
            return _resolve_name(module, name[len("module.") :])
        raise ValueError(f"site member {name!r} is not a parameter or buffer of {type(module).__name__}") from None


def _check_member(
    site: Site,
    name: str,
    tensor: Tensor,
    params: dict[str, nn.Parameter],
    optimized: set[int],
) -> None:
    if name in params:
        p = params[name]
        if not p.requires_grad:
            raise ValueError(f"site {site.name!r} acts on the frozen parameter {name!r} (requires_grad=False)")
        if id(p) not in optimized:
            raise ValueError(f"site {site.name!r}: parameter {name!r} is not updated by the optimizer")
    if not tensor.is_floating_point():
        raise TypeError(f"site {site.name!r}: member {name!r} has dtype {tensor.dtype}; teleports need floating point")


def _bind(site: Site, module: nn.Module, params: dict[str, nn.Parameter], optimized: set[int]) -> Site:
    members = tuple(None if m is None else _resolve_name(module, m) for m in site.members)
    if members != site.members:
        site = Site(site.action, members, site.name, site.data_input, dict(site.info))
    devices, dtypes = set(), set()
    moved = moved_names(site)
    for m in site.tensor_names:
        t = lookup_tensor(module, m)
        devices.add(t.device)
        dtypes.add(t.dtype)
        if m in moved:
            _check_member(site, m, t, params, optimized)
    if len(devices) > 1:
        raise ValueError(f"site {site.name!r} has members on several devices ({sorted(map(str, devices))}); move them to one")
    if len(dtypes) > 1:
        raise ValueError(f"site {site.name!r} mixes dtypes ({sorted(map(str, dtypes))}); teleports need one dtype per site")
    if site.action.needs_data and site.data_input is None:
        raise ValueError(f"site {site.name!r} is data-dependent but names no data_input module")
    site.action.group(site.tensors(module))  # shape check, raises ValueError on mismatch
    return site


def moved_names(site: Site) -> list[str]:
    """The site's tensors the action moves: all but the members it only reads (``power`` 0, the gains the
    residual rotation is conjugated by)."""
    read = {n for a, n in zip(getattr(site.action, "members", ()), site.members) if getattr(a, "power", 1) == 0}
    return [n for n in site.tensor_names if n not in read]


def unusable(site: Site, module: nn.Module, params: dict[str, nn.Parameter], optimized: set[int]) -> str | None:
    """Why a teleport cannot move ``site`` now (a frozen member, one the optimizer does not update), or ``None``."""
    for m in moved_names(site):
        name = _resolve_name(module, m)
        if name in params:
            p = params[name]
            if not p.requires_grad:
                return f"parameter {name!r} is frozen (requires_grad=False)"
            if id(p) not in optimized:
                return f"parameter {name!r} is not updated by the optimizer"
    return None


def validate_sites(
    sites: Sequence[Site],
    module: nn.Module,
    param_groups: Sequence[dict[str, Any]],
    given: bool,
    skipped: dict[str, str] | None = None,
) -> list[Site]:
    """The continuous sites of ``sites`` bound to ``module`` (see module docs).

    A discrete site is an error when the user ``given`` it, and skipped when detection found it.
    A detected site with a frozen member or one the optimizer does not update is skipped, its
    reason recorded in ``skipped`` (site name -> reason); a given one is an error.
    """
    if isinstance(sites, (str, Site)) or not isinstance(sites, Sequence):
        raise TypeError(f"sites must be 'auto' or a list of Site, got {type(sites).__name__}")
    optimized = _optimized(param_groups)
    params = dict(module.named_parameters())
    out = []
    for site in sites:
        if not isinstance(site, Site):
            raise TypeError(f"sites must contain teleopt Site objects, got {type(site).__name__}")
        if not site.action.continuous:
            if given:
                raise ValueError(
                    f"site {site.name!r} has a discrete group ({site.action.group_name}): Teleport searches "
                    "continuous groups by ascent on Lie-algebra coordinates"
                )
            continue
        if not given:
            why = unusable(site, module, params, optimized)
            if why is not None:
                if skipped is not None:
                    skipped[site.name] = why
                continue
        out.append(_bind(site, module, params, optimized))
    if given:  # sites sharing an axis search one trust region between them (teleopt.detection.overlap)
        from teleopt.detection.overlap import compose_overlapping

        out = compose_overlapping(module, out)
    return out


def detect_sites(
    module: nn.Module,
    param_groups: Sequence[dict[str, Any]],
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    searched: bool = False,
) -> tuple[list[Site], dict[str, str]]:
    """The exact continuous sites ``teleopt.find_symmetries`` finds on ``module`` with ``example_inputs``
    (and ``example_kwargs``) whose parameters the optimizer updates, and the others with the reason.

    ``searched``: the objective is searched by ascent (no closed form); sites whose gradient transport
    reads the point (:attr:`GroupAction.transport_reads_params`, the gained residual rotation) are then
    left out, since every ascent step would transport them and the sites sharing their axes under autograd."""
    try:
        from teleopt.detection import find_symmetries
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("sites='auto' needs teleopt.detection (find_symmetries); pass a list of sites instead") from exc
    if isinstance(example_inputs, Mapping):  # keyword inputs (transformers models)
        example_inputs, example_kwargs = None, {**example_inputs, **(example_kwargs or {})}
    if example_inputs is None:
        inputs: tuple[Any, ...] = ()
    else:
        inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    found = find_symmetries(module, inputs or None, example_kwargs=example_kwargs or None)
    # exact sites only: an approximate site (BatchNorm input scaling, exact up to eps) would fail the
    # invariance post-condition; pass such sites explicitly with a loss tolerance
    skipped: dict[str, str] = {}
    for s in found.sites:  # an exact action with no closed-form covector rule (none at a point either)
        if s.action.exactness == "exact" and not s.action.has_gradient_transport:
            skipped[s.name] = "exact but no closed-form gradient transport: pass it explicitly, with a batch (the general path)"
        elif searched and s.action.transport_reads_params:
            skipped[s.name] = (
                "its gradient transport reads the point, so a searched objective would transport it and every site "
                "sharing its axes under autograd at each ascent step: pass it explicitly, or use objective='balance'"
            )
    sites = validate_sites(
        [s for s in found.sites if s.name not in skipped and s.action.exactness == "exact"],
        module,
        param_groups,
        given=False,
        skipped=skipped,
    )
    return sites, skipped


def unsharded_twin(module: nn.Module, param_groups: Sequence[dict[str, Any]]) -> tuple[nn.Module, list[dict[str, Any]]]:
    """For ``sites="auto"`` on an FSDP2 model: an unsharded copy to detect on
    (:func:`teleopt.sharding.unsharded_copy`, a collective) and ``param_groups`` with each
    parameter replaced by the copy's parameter of the same name; detected sites name the
    original's tensors."""
    from teleopt.sharding import unsharded_copy

    twin = unsharded_copy(module)
    names = {id(p): n for n, p in module.named_parameters()}
    params = dict(twin.named_parameters())
    groups = [{**g, "params": [params[names[id(p)]] for p in g["params"] if id(p) in names]} for g in param_groups]
    return twin, groups


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer (BatchNorm, LayerNorm, GroupNorm, RMSNorm, or its class name says Norm)."""
    return isinstance(module, _NORMS) or "Norm" in type(module).__name__


def normalization_affine(site: Site, module: nn.Module) -> bool:
    """Whether ``site`` moves the affine parameters of a normalisation layer (BatchNorm, LayerNorm,
    GroupNorm, RMSNorm, or a module whose class name says Norm): the rescaling of gamma and beta against
    the next layer's input columns."""
    owners = dict(module.named_modules())
    for name in moved_names(site):
        prefix, _, leaf = name.rpartition(".")
        owner = owners.get(prefix)
        if owner is not None and leaf in dict(owner.named_parameters(recurse=False)) and is_norm(owner):
            return True
    return False


def scale_free_updates(optimizer: Optimizer) -> bool:
    """Whether the optimizer's step does not scale with the gradient (per-coordinate normalised: Adam, AdamW,
    Adagrad, RMSprop; and, to be safe, every optimizer teleopt has no model of).  Under such steps a
    rescaled normalisation gain moves by the same absolute amount whatever its size, so shrinking it
    (as the gradient-norm and balance objectives do) multiplies its relative learning rate."""
    return OptimizerModel(optimizer).family != "sgd"


def warn_left_out(skipped: dict[str, str], stacklevel: int = 2, none_left: dict[str, str] | None = None) -> None:
    """One ``UserWarning`` listing the sites ``sites="auto"`` detection left out (the first five with the reason).

    ``none_left`` (every site left out, with the reasons): the warning says instead that no site is left
    and every teleport would be declined, and what to do.
    """
    if none_left is not None:
        listed = "; ".join(f"{name}: {why}" for name, why in list(none_left.items())[:5])
        found = f" (left out: {listed}{' and more' if len(none_left) > 5 else ''})" if none_left else ""
        warnings.warn(
            f"Teleport(sites='auto') found no continuous site it can teleport on this model{found}; every teleport "
            "would be declined. Pass sites explicitly (teleopt.find_symmetries lists what the model has), use "
            "teleopt.Syre instead, or leave the optimizer unwrapped",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
        return
    if not skipped:
        return
    listed = "; ".join(f"{name}: {why}" for name, why in list(skipped.items())[:5])
    more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
    warnings.warn(
        f"Teleport(sites='auto'): {len(skipped)} detected site(s) left out ({listed}{more}); "
        "each teleport's report lists them in report.skipped",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


def movable_sites(sites: Sequence[Site], module: nn.Module, warned: set[str]) -> list[Site]:
    """The sites a teleport may move now: none with a member whose gradient is sparse.

    A sparse COO gradient (``nn.Embedding(sparse=True)``) has no dense layout to
    transport along a site's axes, and densifying it would change what the base
    optimizer receives (``SparseAdam`` refuses dense gradients); such a site sits
    out until its gradient is dense again, with a warning once per site (``warned``
    holds the names already warned about).
    """
    params = dict(module.named_parameters())
    kept = []
    for site in sites:
        sparse = [n for n in site.tensor_names if n in params and getattr(params[n].grad, "is_sparse", False)]
        if not sparse:
            kept.append(site)
        elif site.name not in warned:
            warned.add(site.name)
            warnings.warn(
                f"Teleport: site {site.name!r} sits out teleports while {sparse[0]!r} has a sparse gradient "
                "(sparse gradients cannot be transported along the site's axes)",
                stacklevel=4,
            )
    return kept


def warn_scale_free_objective(objective: str, schedule: Schedule, optimizer: Optimizer) -> None:
    """Warn when scheduled ``"grad_norm"`` teleports run under scale-free steps (:func:`scale_free_updates`).

    The gradient-norm objective (Zhao 2026, Sec. 5.1) grows ||grad L||^2 by shrinking layers; a step that does
    not scale with the gradient (Adam family, Yogi, Lamb) is then large relative to the shrunk weights, and the
    harm compounds over teleports where each one's watch sees nothing wrong (docs/teleport.md, "Scale-free
    optimizers").  ``"balance"`` has no such effect on the step sizes.
    """
    if objective != "grad_norm" or schedule.manual or not scale_free_updates(optimizer):
        return
    warnings.warn(
        f"Teleport(objective='grad_norm') on a schedule under {type(optimizer).__name__}, whose steps do not scale "
        "with the gradient: grad-norm teleports shrink layers, and scale-free steps are then large relative to them "
        "(training diverged under Yogi and Lamb in examples/03_torch_optimizer.py). Prefer objective='balance'.",
        UserWarning,
        stacklevel=4,  # the user's line: through Teleport.__init__ and its keyword check
    )


def active_sites(
    sites: Sequence[Site], module: nn.Module, param_groups: Sequence[dict[str, Any]], enabled_key: str, left_out: dict[str, str]
) -> tuple[list[Site], dict[str, str]]:
    """The sites a teleport moves now, and those left out with the reason (``left_out``: detection's, kept)."""
    enabled = {id(p) for g in param_groups if g[enabled_key] for p in g["params"]}
    optimized = {id(p) for g in param_groups for p in g["params"]}
    params = dict(module.named_parameters())
    active, skipped = [], dict(left_out)
    for site in sites:
        why = unusable(site, module, params, optimized)
        if why is None and not all(n not in params or id(params[n]) in enabled for n in moved_names(site)):
            why = "teleports are disabled for its param group"
        if why is None:
            active.append(site)
        else:
            skipped[site.name] = why
    return active, skipped
