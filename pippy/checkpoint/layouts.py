"""Step layouts: torchtitan's names for a stage's state, mapped to pippy's and back.

torchtitan's names for the same state (pippy's; torchtitan's):

* weights: ``model.<fqn>``; ``<fqn>``, at the root;
* optimizer tensors: ``optim.state.<fqn>.<name>``; ``optimizer.state.<fqn>.<name>``;
* options and 0-dim state: ``optim.scalars.<fqn>``;
  ``optimizer.param_groups.<fqn>.<option>`` and ``optimizer.state.<fqn>.step``;
* step: ``step``; ``train_state.step`` (with ``train_state.ntokens_seen``);
* an extra (a data sampler): ``<extra name>.<name>``;
  ``dataloader.<extra name>.<name>``, never at the root among the weights;
* param group indices: in ``optim.scalars.<fqn>``; on request one
  ``train_state.pippy_param_groups`` item, which torchtitan's loads ignore.

Other ``dataloader.`` and ``train_state.`` keys read as themselves.
:func:`from_torchtitan` and :func:`to_torchtitan` map flat dicts, each the
other's inverse; all reading sees a torchtitan checkpoint in pippy's names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from typing import Any

# _get_fqns: the FQNs DCP's state_dict helpers give a parameter (no wrapper prefixes).
from pippy.checkpoint.optim_keys import OptimKeys, pack_scalars, unpack_scalars

# How a step is computed, not what it computes: param groups need not agree.
PIPPY = "pippy"
TORCHTITAN = "torchtitan"
#: torchtitan's top-level sections that are not the model (its CheckpointManager).
_TT_SECTIONS = ("optimizer.", "lr_scheduler.", "train_state.", "dataloader.")
_DATALOADER = "dataloader."
#: Each parameter's param group index, ``[[fqn, index], ...]``.
_PARAM_GROUPS = "train_state.pippy_param_groups"


def detect_layout(keys: Iterable[str]) -> str:
    """Tells pippy's layout from torchtitan's by a checkpoint's keys.

    Args:
        keys: The checkpoint's keys (``state_dict_metadata``).

    Returns:
        :data:`PIPPY` if a key is ``step``; else :data:`TORCHTITAN` if a
        key is under ``optimizer.`` or ``train_state.``, or if none is under
        ``model.``; else :data:`PIPPY` (a model-only torchtitan checkpoint
        whose FQNs start with ``model.`` names the same weights either way).
    """
    if not isinstance(keys, Mapping | Set):  # a mapping's "in" takes no loop
        keys = list(keys)
    if "step" in keys:  # torchtitan's step is train_state.step
        return PIPPY
    if any(k.startswith(("optimizer.", "train_state.")) for k in keys):
        return TORCHTITAN
    return PIPPY if any(k.startswith("model.") for k in keys) else TORCHTITAN


def pippy_name(key: str, keys: OptimKeys | None = None) -> str:
    """The pippy key a torchtitan key's value goes into (``keys``: its parser)."""
    if not key.startswith("optimizer."):
        if key == "train_state.step":
            return "step"
        rest = key.removeprefix(_DATALOADER)
        if rest != key and "." in rest:  # an extra's section, as pippy writes it
            return rest
        return key if key.startswith(_TT_SECTIONS) else "model." + key
    rest = key.removeprefix("optimizer.")
    if keys is None:  # no FQN known: it ends at the last dot (before an option)
        keys = OptimKeys([rest.partition(".")[2].rpartition(".")[0]])
    parsed = keys.parse(rest)
    if parsed is not None and (parsed[0] == "param_groups" or parsed[2] == "step"):
        return f"optim.scalars.{parsed[1]}"
    return "optim." + rest


def from_torchtitan(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Renames a flat torchtitan state_dict into pippy's layout (same tensors)."""
    out: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith("optimizer."):
            optim[key.removeprefix("optimizer.")] = value
        elif key != _PARAM_GROUPS:
            out[pippy_name(key)] = int(value) if key == "train_state.step" else value
    groups = {fqn: index for fqn, index in flat.get(_PARAM_GROUPS) or ()}
    model_fqns = (k for k in flat if not k.startswith(_TT_SECTIONS))
    packed = pack_scalars(optim, groups, OptimKeys.of_keys(optim, model_fqns))
    out.update((f"optim.{k}", v) for k, v in packed.items())
    return out


def to_torchtitan(
    flat: Mapping[str, Any], *, param_groups: bool = False
) -> dict[str, Any]:
    """Renames a pippy state_dict to torchtitan's; ValueError: a key can't map back."""
    out: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith("optim."):
            optim[key.removeprefix("optim.")] = value
        elif key == "step":
            out["train_state.step"] = int(value)
        else:
            out[_torchtitan_name(key)] = value
    unpacked, groups = unpack_scalars(optim)
    out.update((f"optimizer.{k}", v) for k, v in unpacked.items())
    if param_groups and groups:
        out[_PARAM_GROUPS] = [[fqn, index] for fqn, index in groups.items()]
    return out


def _torchtitan_name(key: str) -> str:
    """A pippy key's torchtitan name (outside ``optim.``), if it reads back."""
    if key.startswith("model."):
        name = key.removeprefix("model.")
    else:  # extra state goes into the data loader's section, never the root
        name = key if pippy_name(key) == key else _DATALOADER + key
    if (back := pippy_name(name)) != key:
        raise ValueError(
            f"{key!r} has no place in torchtitan's layout: written as {name!r}, it "
            f"would read back as {back!r}. Keep other state in a section "
            "(<name>.<entry>) and the model's top-level modules out of torchtitan's "
            "section names (optimizer, lr_scheduler, train_state, dataloader)"
        )
    return name
