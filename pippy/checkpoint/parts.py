"""A rank's model parts (several pipeline stages) seen as one module.

Interleaved and zero-bubble schedules give a rank several stages, for example
stages 1 and 3 of 4. Each stage module keeps the un-split model's FQNs, so the
union of their state_dicts is this rank's share of the model, keyed as in the
un-split model. :func:`merge_parts` builds one module whose ``state_dict`` is
that union, from the same parameter and buffer objects, so DCP's state_dict
helpers (and one optimizer over all parts) work on it as on one stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pippy.checkpoint.errors import KeyCollisionError

__all__ = ["merge_parts"]


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module a DDP wrapper holds (its keys have no ``module.`` prefix)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def _check_one(held: Any, new: Any, fqn: str) -> None:
    """Refuses two different tensors saved under one FQN."""
    if held is not None and held is not new:
        raise KeyCollisionError(
            f"two parts of this rank hold different tensors named {fqn!r}: DCP "
            "would save one of them. Each part must hold what it owns, under the "
            "un-split model's FQN"
        )


def _merge(modules: list[nn.Module], path: str) -> nn.Module:
    """One container holding the union of the modules' entries under ``path``."""
    if len(modules) == 1:
        return modules[0]
    merged = nn.Module()
    for module in modules:
        for name, param in module._parameters.items():
            if param is not None:
                _check_one(merged._parameters.get(name), param, path + name)
                merged.register_parameter(name, param)
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            persistent = name not in module._non_persistent_buffers_set
            if persistent:  # a copy that is not saved (RoPE tables) may differ
                _check_one(merged._buffers.get(name), buffer, path + name)
            merged.register_buffer(name, buffer, persistent=persistent)
    names = dict.fromkeys(n for m in modules for n, c in m._modules.items() if c)
    for name in names:
        children = [m._modules[name] for m in modules if m._modules.get(name)]
        unique = list({id(c): c for c in children if c is not None}.values())
        merged.add_module(name, _merge(unique, f"{path}{name}."))
    return merged


def merge_parts(parts: Sequence[nn.Module]) -> nn.Module:
    """One module whose state_dict is the union of the parts' state_dicts.

    The parts are a rank's stage modules, each keeping the un-split model's
    FQNs (``layers.1.*`` in one, ``layers.3.*`` in another). Modules that
    only one part has are kept as they are (hooks and all); modules that
    several parts have (the root, a ``layers`` ModuleDict or ModuleList) are
    merged into plain ``nn.Module`` containers holding the union of their
    parameters, persistent and non-persistent buffers, and children. A DDP
    wrapper around a part is looked through. Nothing is copied: the merged
    module's parameters are the parts' own.

    Args:
        parts: The stage modules, in any order; one part is returned as is.

    Returns:
        The merged module, for ``StageState`` and DCP's state_dict helpers;
        it is not meant to run a forward pass.

    Raises:
        ValueError: ``parts`` is empty.
        KeyCollisionError: Two parts hold different parameters, or different
            persistent buffers, under one FQN.
    """
    if not parts:
        raise ValueError("merge_parts needs at least one stage module")
    return _merge([_unwrapped(p) for p in parts], "")
