"""A submodule analysed on its own: its recorded call, a traceable wrapper that replays it, its names mapped back.

The children fallback of ``find_symmetries`` (a root whose ``forward`` torch.fx cannot
trace, as in transformers models) runs the model once with hooks that record every
submodule's arguments (:func:`record_calls`), wraps a submodule called once so that
its tensors are positional inputs fx can trace (:func:`call_module`), and renames the
wrapper's sites and entries as names of the model (:func:`under`, :func:`renamed`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from teleopt.site import Site

__all__ = ["Call", "call_module", "record_calls", "under", "renamed", "is_cache", "shared_tensor_names"]


class Call(nn.Module):
    """Calls ``module`` with recorded keyword arguments whose tensors are this wrapper's positional inputs."""

    def __init__(self, module: nn.Module, call: dict[str, Any]) -> None:
        from torch.utils._pytree import tree_flatten

        super().__init__()
        self.m = module
        self._leaves, self._spec = tree_flatten(call)
        self._slots = [i for i, v in enumerate(self._leaves) if isinstance(v, Tensor)]

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(self._leaves[i] for i in self._slots)

    def call(self, tensors: tuple) -> Any:
        from torch.utils._pytree import tree_unflatten

        leaves = list(self._leaves)
        for i, t in zip(self._slots, tensors):
            leaves[i] = t
        return self.m(**tree_unflatten(leaves, self._spec))


def call_module(module: nn.Module, call: dict[str, Any]) -> Call:
    """A ``Call`` whose ``forward`` takes one named positional input per tensor (fx cannot trace ``*args``)."""
    wrapper = Call(module, call)
    names = [f"t{i}" for i in range(len(wrapper._slots))]
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {', '.join(names)}):\n    return self.call(({''.join(n + ', ' for n in names)}))", namespace)  # noqa: S102
    wrapper.__class__ = type("_Call", (Call,), {"forward": namespace["forward"]})
    return wrapper


def record_calls(model: nn.Module, inputs, kwargs) -> dict[str, list[tuple[tuple, dict]]]:
    """The arguments every descendant module is called with, when the model runs once in eval mode."""
    import torch

    calls: dict[str, list[tuple[tuple, dict]]] = {}
    hooks = []
    for name, m in model.named_modules():
        if name:
            hooks.append(
                m.register_forward_pre_hook(lambda mod, a, k, name=name: calls.setdefault(name, []).append((a, dict(k))), with_kwargs=True)
            )
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*inputs, **kwargs)
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
    return calls


def under(name: str, path: str) -> str:
    """A name inside a ``Call`` wrapper ("m", "m.<rest>") as a name inside the model (``path``, "<path>.<rest>")."""
    if name == "m":
        return path
    return path + name[1:] if name.startswith("m.") else name


def renamed(site: Site, path: str) -> Site:
    """A site of the wrapper of the submodule at ``path`` with every name in it (members, info, action) the model's."""
    from teleopt.actions.axis import AxisAction

    info = dict(site.info)
    if isinstance(info.get("module"), str):
        info["module"] = under(info["module"], path)
    if isinstance(info.get("batchnorm"), list):
        info["batchnorm"] = [under(p, path) for p in info["batchnorm"]]
    action = site.action
    if isinstance(action, AxisAction):  # member roles carry the wrapper's tensor names (they name the site)
        cfg = action.config()
        for m in cfg["members"]:
            m["name"] = under(m["name"], path)
            if m.get("tensor"):
                m["tensor"] = under(m["tensor"], path)
        if isinstance(cfg.get("reference"), str):
            cfg["reference"] = under(cfg["reference"], path)
        action = AxisAction.from_config(cfg)
    return Site(action, tuple(None if m is None else under(m, path) for m in site.members), "", site.data_input, info)


def is_cache(value: Any) -> bool:
    """A transformers key/value cache: stateful (each call appends to it), so a submodule is analysed without it."""
    return any(c.__name__.endswith("Cache") and c.__module__.startswith("transformers") for c in type(value).__mro__)


def shared_tensor_names(model: nn.Module) -> set[str]:
    """Qualified names of parameters/buffers reachable under more than one name (tied weights)."""
    seen: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        seen.setdefault(id(t), []).append(name)
    return {n for names in seen.values() if len(names) > 1 for n in names}
