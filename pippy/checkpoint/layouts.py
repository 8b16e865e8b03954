"""Checkpoint layouts: pippy's, and torchtitan's, and the map between them.

Both are DCP checkpoints keyed by the un-split model's FQNs, in ``step-<N>``
folders; they differ in where things sit:

* model weights: pippy ``model.<fqn>``; torchtitan ``<fqn>``, at the root;
* optimizer tensors: ``optim.state.<fqn>.<name>``; ``optimizer.state.<fqn>.<name>``;
* optimizer options and 0-dim state: ``optim.scalars.<fqn>``, one packed item
  per parameter; ``optimizer.param_groups.<fqn>.<option>`` and
  ``optimizer.state.<fqn>.step``;
* LR scheduler: ``lr_scheduler.<name>`` in both;
* step: ``step``; ``train_state.step`` (with ``train_state.ntokens_seen``);
* other state (a ``StageState`` ``extra``, such as a data sampler):
  ``<extra name>.<name>``; ``dataloader.<extra name>.<name>``, in the
  section torchtitan keeps its data loader's state in, never at the root
  among the weights.

torchtitan's own data loader state is flat (``dataloader.dp_rank_<N>``,
``dataloader.world_size``): a ``dataloader.`` key with no further dot reads
as itself, for an extra named ``dataloader``, and other ``train_state.``
keys do too. The position of each parameter's param group, which pippy
keeps for its LR scheduler check and torchtitan's layout has no place for,
is written (on request) as one ``train_state.pippy_param_groups`` item,
which torchtitan's loads ignore. Each map is then the other's inverse;
:func:`to_torchtitan` refuses a key that would not read back as itself (a
root key outside any section, a model whose top-level module is named like
one of torchtitan's sections).

:func:`from_torchtitan` and :func:`to_torchtitan` convert flat
``{key: value}`` dicts; everything that reads (``read_checkpoint``,
``load_model``, ``python -m pippy inspect|export``) sees a torchtitan
checkpoint through pippy's names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pippy.checkpoint.state import (
    OptimKeys,
    pack_scalars,
    saved_groups,
    unpack_scalars,
)

__all__ = [
    "PIPPY",
    "TORCHTITAN",
    "detect_layout",
    "from_torchtitan",
    "pippy_name",
    "to_torchtitan",
    "torchtitan_optim_keys",
]

PIPPY = "pippy"
TORCHTITAN = "torchtitan"
#: torchtitan's top-level sections that are not the model (its CheckpointManager).
_TT_SECTIONS = ("optimizer.", "lr_scheduler.", "train_state.", "dataloader.")
_DATALOADER = "dataloader."
#: Each parameter's param group index, ``[[fqn, index], ...]``: pippy keeps it
#: in ``optim.scalars.<fqn>`` (for its LR scheduler check); torchtitan's layout
#: has no place for it, and torchtitan's loads read no key they do not name.
_PARAM_GROUPS = "train_state.pippy_param_groups"


def detect_layout(keys: Iterable[str]) -> str:
    """Tells pippy's layout from torchtitan's by a checkpoint's keys.

    Args:
        keys: The checkpoint's keys (``state_dict_metadata``).

    Returns:
        :data:`PIPPY` if a key is ``step``; else :data:`TORCHTITAN` if a
        key is under ``optimizer.`` or ``train_state.``, or if none is under
        ``model.`` (a model-only torchtitan checkpoint); else :data:`PIPPY`.

    Note:
        A torchtitan checkpoint holding only model weights whose FQNs all
        start with ``model.`` reads as pippy's layout; both then name the
        same weights.
    """
    keys = list(keys)
    if "step" in keys:  # torchtitan's step is train_state.step
        return PIPPY
    if any(k.startswith(("optimizer.", "train_state.")) for k in keys):
        return TORCHTITAN
    return PIPPY if any(k.startswith("model.") for k in keys) else TORCHTITAN


def torchtitan_optim_keys(keys: Iterable[str]) -> OptimKeys:
    """The parser of a torchtitan checkpoint's optimizer keys.

    Args:
        keys: The checkpoint's keys (or a flat state_dict's): its root model
            keys and ``optimizer.param_groups.<fqn>.<option>`` name the FQNs.

    Returns:
        An :class:`~pippy.checkpoint.state.OptimKeys` for the keys
        without their ``optimizer.`` prefix.
    """
    keys = list(keys)
    return OptimKeys.of_keys(
        (k.removeprefix("optimizer.") for k in keys if k.startswith("optimizer.")),
        model_fqns=(k for k in keys if not k.startswith(_TT_SECTIONS)),
    )


def pippy_name(key: str, keys: OptimKeys | None = None) -> str:
    """Names a torchtitan key in pippy's layout.

    Args:
        key: A key of a torchtitan checkpoint.
        keys: The parser of its optimizer keys
            (:func:`torchtitan_optim_keys` of the checkpoint's keys). Without
            it, a param-group key names its own FQN, and ``state.<fqn>.step``
            is taken for a parameter's own step.

    Returns:
        The pippy key its value goes into; a parameter's options and its
        ``step`` all go into its ``optim.scalars.<fqn>``;
        ``dataloader.<extra name>.<name>`` goes into ``<extra name>.<name>``.
    """
    if not key.startswith("optimizer."):
        if key == "train_state.step":
            return "step"
        rest = key.removeprefix(_DATALOADER)
        if rest != key and "." in rest:  # an extra's section, as pippy writes it
            return rest
        return key if key.startswith(_TT_SECTIONS) else "model." + key
    rest = key.removeprefix("optimizer.")
    if keys is None and rest.startswith("state.") and rest.endswith(".step"):
        keys = OptimKeys([rest.removeprefix("state.").removesuffix(".step")])
    elif keys is None:
        keys = OptimKeys.of_keys([rest])
    parsed = keys.parse(rest)
    if parsed is not None and (parsed[0] == "param_groups" or parsed[2] == "step"):
        return f"optim.scalars.{parsed[1]}"
    return "optim." + rest


def from_torchtitan(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Renames a flat torchtitan state_dict into pippy's layout.

    Args:
        flat: ``{torchtitan key: value}``, e.g. read from a torchtitan step.

    Returns:
        ``{pippy key: value}``; tensors are the same objects. A
        ``train_state.pippy_param_groups`` item goes back into the
        parameters' ``optim.scalars.<fqn>``.
    """
    out: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith("optimizer."):
            optim[key.removeprefix("optimizer.")] = value
        elif key == "train_state.step":
            out["step"] = int(value)
        elif key != _PARAM_GROUPS:
            out[pippy_name(key)] = value
    groups = {fqn: index for fqn, index in flat.get(_PARAM_GROUPS) or ()}
    packed = pack_scalars(optim, groups, keys=torchtitan_optim_keys(flat))
    out.update((f"optim.{k}", v) for k, v in packed.items())
    return out


def to_torchtitan(
    flat: Mapping[str, Any], *, param_groups: bool = False
) -> dict[str, Any]:
    """Renames a flat pippy state_dict into torchtitan's layout.

    Args:
        flat: ``{pippy key: value}``, e.g. ``read_checkpoint(step)``.
        param_groups: Also keep each parameter's param group index (in
            ``optim.scalars.<fqn>``) as one ``train_state.pippy_param_groups``
            item, which torchtitan's loads ignore: for writing a checkpoint,
            not for naming the keys to read from one (torchtitan's own lack
            it).

    Returns:
        ``{torchtitan key: value}``; tensors are the same objects, 0-dim
        optimizer state (``step``) a new tensor of the saved dtype. With
        ``param_groups``, :func:`from_torchtitan` of it gives ``flat`` back.

    Raises:
        ValueError: A key would not read back as itself (see the module
            docstring), naming it.
    """
    out: dict[str, Any] = {}
    optim = {
        k.removeprefix("optim."): v for k, v in flat.items() if k.startswith("optim.")
    }
    for key, value in flat.items():
        if key == "step":
            out["train_state.step"] = int(value)
        elif not key.startswith("optim."):
            out[_torchtitan_name(key)] = value
    out.update((f"optimizer.{k}", v) for k, v in unpack_scalars(optim).items())
    if param_groups and (groups := saved_groups(optim)):
        out[_PARAM_GROUPS] = [[fqn, index] for fqn, index in groups.items()]
    return out


def _torchtitan_name(key: str) -> str:
    """A pippy key's torchtitan name (outside ``optim.``), if it reads back."""
    if key.startswith("model."):
        name = key.removeprefix("model.")
    else:  # extra state goes into the data loader's section, never the root
        name = key if pippy_name(key) == key else _DATALOADER + key
    if pippy_name(name) != key:
        raise ValueError(
            f"{key!r} has no place in torchtitan's layout: written as {name!r}, it "
            f"would read back as {pippy_name(name)!r}. Keep other state in a "
            "section (<name>.<entry>) and the model's top-level modules out of "
            "torchtitan's section names (optimizer, lr_scheduler, train_state, "
            "dataloader)"
        )
    return name
