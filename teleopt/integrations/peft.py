"""PEFT LoRA adapters as GL_r symmetry sites, recognised by their module structure.

A LoRA layer (Hu et al., ICLR 2022) adds ``scaling * B A x`` to a frozen base
layer, with A (r x in) and B (out x r).  Every g in GL_r leaves the product, hence
the model, unchanged: (B g^{-1}) (g A) = B A (Zhao 2026, Ex. 1.2.13, registry name
``lora_gl``).  peft's ``LoraLayer`` keeps one pair per adapter name:

* ``lora_A[adapter]`` / ``lora_B[adapter]``: ``nn.Linear`` (Linear layers, GPT-2's
  ``Conv1D`` with ``fan_in_fan_out``, quantised bases) or ``nn.Conv1d/2d/3d`` with
  a 1x1 ``lora_B`` (convolutions);
* ``lora_embedding_A[adapter]`` / ``lora_embedding_B[adapter]``: parameters
  (r x num_embeddings) and (embedding_dim x r) (embeddings);
* ``scaling[adapter]`` (alpha / r or alpha / sqrt(r)), ``lora_dropout[adapter]``
  (applied to x before A, so it commutes with the action), an optional bias of
  ``lora_B`` (not on the rank axis, so untouched).

Nothing here imports peft: a module is a LoRA layer if it has ``base_layer``, the
``lora_A``/``lora_B`` module dicts and a ``scaling`` dict.  The rule fails closed:
an adapter is a site only when its forward is known to read the pair through B A
alone, and is otherwise reported in ``skipped`` with the reason:

* merged (``merged_adapters``): B A was added into the base weight; the pair no
  longer enters the forward, gets no gradient, and a teleport would be invisible;
  unmerge to teleport it;
* disabled adapters, or an adapter that is not active (it does not enter the forward);
* LoRA variants (DoRA, and every entry of peft's ``lora_variant``): their forward
  is not checked here;
* a rank axis that is not the adapter's ``r`` (mixtures of experts), a ``lora_A``
  with a bias, a grouped or non-1x1 convolutional ``lora_B``;
* a frozen pair (``requires_grad=False``, unless ``include_frozen``) or one whose
  tensors are shared under several names (tied adapters).

``teleopt.find_symmetries`` adds these sites to what it traces (peft's layers are
not torch.fx-traceable) and certifies them numerically like every other site.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from teleopt.actions.axis import AxisAction, Member
from teleopt.site import Site

__all__ = ["LoRASites", "is_lora_layer", "lora_sites"]

_REFERENCE = "Zhao 2026, Ex. 1.2.13; LoRA: Hu et al., ICLR 2022"
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class LoRASites:
    """The LoRA sites of a model (``sites``) and the adapters left out, as ``(where, reason)`` (``skipped``)."""

    sites: list[Site] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __iter__(self) -> Iterator[Site]:
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` has the structure of a peft ``LoraLayer`` (see module docs)."""
    return (
        hasattr(module, "base_layer")
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
        and isinstance(getattr(module, "scaling", None), dict)
    )


def _shared_names(model: nn.Module) -> set[str]:
    seen: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(t), []).append(name)
    return {n for names in seen.values() if len(names) > 1 for n in names}


def _pair(layer: nn.Module, adapter: str) -> tuple[str, str, str, int] | str:
    """(B's and A's names under the layer, kind, rank) or why the adapter is not a site."""
    dicts: dict[str, Any] = {key: getattr(layer, key, {}) for key in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")}
    names: tuple[str, str, str, int]
    if adapter in dicts["lora_A"] and adapter in dicts["lora_B"]:
        A, B = dicts["lora_A"][adapter], dicts["lora_B"][adapter]
        if isinstance(A, nn.Linear) and isinstance(B, nn.Linear):
            if B.in_features != A.out_features:
                return f"lora_A has {A.out_features} outputs but lora_B {B.in_features} inputs"
            names = (f"lora_B.{adapter}.weight", f"lora_A.{adapter}.weight", "linear", A.out_features)
        elif isinstance(A, _CONV) and type(B) is type(A):
            if B.in_channels != A.out_channels or B.groups != 1 or any(k != 1 for k in B.kernel_size) or any(s != 1 for s in B.stride):
                return "lora_B is not a 1x1, stride-1, ungrouped convolution over the rank"
            names = (f"lora_B.{adapter}.weight", f"lora_A.{adapter}.weight", "conv", A.out_channels)
        else:
            return f"lora_A/lora_B are {type(A).__name__}/{type(B).__name__}, not a Linear or Conv pair"
        if A.bias is not None:
            return "lora_A has a bias (it would move with the rank axis)"
    elif adapter in dicts["lora_embedding_A"] and adapter in dicts["lora_embedding_B"]:
        EA, EB = dicts["lora_embedding_A"][adapter], dicts["lora_embedding_B"][adapter]
        if EA.ndim != 2 or EB.ndim != 2 or EA.shape[0] != EB.shape[1]:
            return f"embedding factors of shapes {tuple(EA.shape)} and {tuple(EB.shape)} do not share a rank axis"
        names = (f"lora_embedding_B.{adapter}", f"lora_embedding_A.{adapter}", "embedding", int(EA.shape[0]))
    else:
        return "no lora_A/lora_B (or lora_embedding_A/B) pair"
    r = getattr(layer, "r", {}).get(adapter)
    if r is not None and r != names[3]:
        return f"the rank axis has {names[3]} entries but the adapter's r is {r} (experts or another layout)"
    return names


def _why_not(layer: nn.Module, adapter: str) -> str | None:
    """Why ``adapter`` of ``layer`` does not read the pair through B A in the forward, or None."""
    if adapter in list(getattr(layer, "merged_adapters", [])):
        return "merged into the base weight: B A no longer enters the forward (no gradient, a teleport is invisible); unmerge it first"
    if bool(getattr(layer, "disable_adapters", False)):
        return "adapters are disabled on this layer"
    active = getattr(layer, "active_adapters", None)
    if active is not None and adapter not in list(active if not isinstance(active, str) else [active]):
        return "not an active adapter: it does not enter the forward"
    variant = getattr(layer, "lora_variant", {}).get(adapter)
    if variant is not None:
        return f"LoRA variant {type(variant).__name__}: its forward is not checked (fail closed)"
    if getattr(layer, "use_dora", {}).get(adapter, False):
        return "DoRA: its forward is not checked (fail closed)"
    return None


def _adapters(layer: nn.Module) -> list[str]:
    """The adapter names of a LoRA layer: ``lora_A``'s, then embedding adapters not among them."""
    plain = getattr(layer, "lora_A", {})
    return list(plain.keys()) + [a for a in getattr(layer, "lora_embedding_A", {}).keys() if a not in plain]


def _unusable_factors(params: dict[str, nn.Parameter], shared: set[str], names: tuple[str, str], include_frozen: bool) -> str | None:
    """Why the factors (B, A) named ``names`` cannot carry a site, or None."""
    if any(n not in params for n in names):
        return "its factors are not parameters of the model"
    if set(names) & shared:
        return "its factors are shared with another part of the model (tied adapters)"
    if not include_frozen and not all(params[n].requires_grad for n in names):
        return "frozen (requires_grad=False)"
    return None


def _lora_gl(b_name: str, a_name: str, rank: int) -> AxisAction:
    """GL_rank acting as B -> B g^-1 (rank axis 1), A -> g A (rank axis 0)."""
    members = (Member(b_name, 1, -1), Member(a_name, 0, 1))
    return AxisAction("lora_gl", "general", members, reference=_REFERENCE, group_name=f"GL_{rank}(R)")


def lora_sites(model: nn.Module, *, include_frozen: bool = False) -> LoRASites:
    """One ``lora_gl`` site per LoRA pair of ``model`` (Zhao 2026, Ex. 1.2.13; see module docs).

    Each site is an :class:`~teleopt.actions.axis.AxisAction` named ``lora_gl`` whose
    members are the qualified names of B (rank axis 1, g^{-T}) and A (rank axis 0, g)
    in ``model.state_dict()``: B -> B g^{-1}, A -> g A.  Site names are
    ``lora_gl@<layer>[<adapter>]``; ``site.info`` holds the layer, adapter, kind
    (``linear``, ``conv``, ``embedding``), rank and ``scaling``.

    ``include_frozen`` keeps pairs whose parameters have ``requires_grad=False``
    (default: left out, as ``find_symmetries`` does).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = LoRASites()
    shared = _shared_names(model)
    params = dict(model.named_parameters())
    for path, layer in model.named_modules():
        if not is_lora_layer(layer):
            continue
        for adapter in _adapters(layer):
            where = f"{path}[{adapter}]"
            pair = _pair(layer, adapter)
            if isinstance(pair, str):
                found.skipped.append((where, pair))
                continue
            b_local, a_local, kind, rank = pair
            prefix = f"{path}." if path else ""
            b_name, a_name = prefix + b_local, prefix + a_local
            why = _why_not(layer, adapter) or _unusable_factors(params, shared, (b_name, a_name), include_frozen)
            if why is not None:
                found.skipped.append((where, why))
                continue
            scaling = float(layer.scaling.get(adapter, 1.0))
            info: dict[str, Any] = {"module": path, "adapter": adapter, "kind": kind, "rank": int(rank), "scaling": scaling}
            found.sites.append(Site(_lora_gl(b_name, a_name, rank), (b_name, a_name), f"lora_gl@{where}", None, info))
    return found
