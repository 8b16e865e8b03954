"""A checkpoint's keys: optimizer state by parameter FQN, and torchtitan's names.

Optimizer state is keyed by parameter FQN, not by index into ``param_groups``
(indices restart at 0 on every stage and would collide). Under ``optim.``:

* ``state.<fqn>.<name>``: a tensor with elements (AdamW's ``exp_avg``);
* ``scalars.<fqn>``: ``[[name, value], ...]``, the rest of that parameter's
  entry in one item (``name`` is ``param_groups.<option>`` or
  ``state.<name>``; a 0-dim tensor is ``[name, number, dtype name]``;
  ``["group", index]`` is its param group's position).

A parameter whose gradient stayed None has ``scalars.<fqn>`` but no
``state.<fqn>.*``. FQNs and names may both hold dots, so a key is split where
a known FQN ends (:class:`OptimKeys`). :data:`LAYOUT_VERSION` numbers this
packing (none recorded: layout 1).

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

import re
from collections.abc import Iterable, Mapping, Set
from typing import Any

import torch
from torch import nn

from pippy.checkpoint.errors import CheckpointError

#: The optimizer layout this pippy writes (see the module docstring).
LAYOUT_VERSION = 1
_SECTIONS = ("state", "param_groups", "scalars")
# Where a key's optimizer section starts: after ``optim.`` at a segment start.
_OPTIM_SECTION = re.compile(r"(?:^|(?<=\.))optim\.(?=(?:state|param_groups|scalars)\.)")


class OptimKeys:
    """Optimizer keys split where the longest of the known ``fqns`` ends."""

    def __init__(self, fqns: Iterable[str]) -> None:
        self.fqns = frozenset(fqns)

    @classmethod
    def of_keys(cls, keys: Iterable[str], model_fqns: Iterable[str] = ()) -> OptimKeys:
        """The parser for the FQNs that ``scalars.`` and ``param_groups.`` keys name."""
        # A param_groups key no known FQN parses (torchtitan's) ends in its option.
        named = []  # (section, rest) of each scalars. or param_groups. key, any root
        for key in keys:
            for start in (0, *(m.end() for m in _OPTIM_SECTION.finditer(key))):
                section, _, rest = key[start:].partition(".")
                if section in ("scalars", "param_groups") and rest:
                    named.append((section, rest))
                    break
        known = cls([*model_fqns, *(rest for s, rest in named if s == "scalars")])
        derived = {  # the option: after the last dot
            rest.rpartition(".")[0]
            for section, rest in named
            if section == "param_groups" and not known.parse(f"{section}.{rest}")
        }
        return cls(known.fqns | (derived - {""}))

    def parse(self, key: str) -> tuple[str, str, str] | None:
        """``(section, fqn, name)`` of a section-relative key (name ``""``: scalars)."""
        section, _, rest = key.partition(".")
        if section not in _SECTIONS:
            return None
        if section == "scalars":
            return (section, rest, "") if rest in self.fqns else None
        end = len(rest)
        while (end := rest.rfind(".", 0, end)) > 0:  # the longest FQN first
            if rest[:end] in self.fqns and end + 1 < len(rest):
                return section, rest[:end], rest[end + 1 :]
        return None

    def split(self, key: str) -> tuple[str, str, str, str] | None:
        """``(root, section, fqn, name)`` of a whole key (``app.optim.state.w.L``)."""
        for match in _OPTIM_SECTION.finditer(key):
            parsed = self.parse(key[match.end() :])
            if parsed is not None:
                return key[: match.start()], *parsed
        return None

    def state_fqns(self, keys: Iterable[str]) -> set[str]:
        """The FQN of every ``state.`` key among section-relative keys."""
        parsed = (self.parse(k) for k in keys if k.startswith("state."))
        return {p[1] for p in parsed if p is not None}


def pack_scalars(
    optim_sd: Mapping[str, Any], groups: Mapping[str, int], keys: OptimKeys
) -> dict[str, Any]:
    """Puts a parameter's non-tensor optimizer entries in one ``scalars.<fqn>`` item."""
    # DCP writes each entry as an item at a fixed cost (a torch.save, a plan and
    # a metadata entry): AdamW gets 3 items per parameter instead of 14.
    packed: dict[str, Any] = {}
    scalars: dict[str, list[list[Any]]] = {}
    zero_dim: list[list[Any]] = []  # entries holding a 0-dim tensor
    for key, value in optim_sd.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            packed[key] = value
            continue
        parsed = keys.parse(key)
        if parsed is None:
            raise CheckpointError(
                f"the optimizer key {key!r} names no parameter known here: the "
                "optimizer holds a parameter that the module does not"
            )
        section, fqn, name = parsed
        entry = [f"{section}.{name}", value]
        if isinstance(value, torch.Tensor):
            entry.append(str(value.dtype).removeprefix("torch."))
            zero_dim.append(entry)
        scalars.setdefault(fqn, []).append(entry)
    for entry, number in zip(zero_dim, _numbers([e[1] for e in zero_dim]), strict=True):
        entry[1] = number
    for fqn, index in groups.items():
        if fqn in scalars:
            scalars[fqn].append(["group", index])
    packed.update((f"scalars.{fqn}", entries) for fqn, entries in scalars.items())
    return packed


def _numbers(tensors: list[torch.Tensor]) -> list[Any]:
    """The Python numbers of 0-dim tensors: one host copy per device and dtype.

    Not ``.item()`` on each: fused AdamW's ``step``s on a GPU, one sync each.
    """
    numbers: list[Any] = [None] * len(tensors)
    alike: dict[tuple[Any, ...], list[int]] = {}
    for i, tensor in enumerate(tensors):
        if type(tensor) in (torch.Tensor, nn.Parameter):
            alike.setdefault((tensor.device, tensor.dtype), []).append(i)
        else:  # a tensor subclass: its own item()
            numbers[i] = tensor.item()
    for indices in alike.values():
        stacked = torch.stack([tensors[i].detach() for i in indices])
        for i, number in zip(indices, stacked.tolist(), strict=True):
            numbers[i] = number
    return numbers


def unpack_scalars(packed: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """Inverse of :func:`pack_scalars`, and each FQN's group (0-dim tensors on CPU)."""
    flat: dict[str, Any] = {}
    groups: dict[str, int] = {}
    for key, value in packed.items():
        if not key.startswith("scalars."):
            flat[key] = value
            continue
        fqn = key.removeprefix("scalars.")
        for name, item, *dtype in value:
            if name == "group":
                groups[fqn] = item
                continue
            section, name = name.split(".", 1)
            if dtype:
                item = torch.tensor(item, dtype=getattr(torch, dtype[0]))
            flat[f"{section}.{fqn}.{name}"] = item
    return flat, groups


def check_layout_version(version: object, where: str) -> None:
    """Refuses (CheckpointError) a layout not None (1) or :data:`LAYOUT_VERSION`."""
    if version is None or (type(version) is int and version == LAYOUT_VERSION):
        return
    newer = type(version) is int and version > LAYOUT_VERSION
    raise CheckpointError(
        f"{where} was written with optimizer layout {version!r}; this pippy "
        f"reads layout {LAYOUT_VERSION}; "
        + ("upgrade pippy" if newer else "no pippy writes it: the record is damaged")
    )


# ---- torchtitan's names ----

PIPPY = "pippy"
TORCHTITAN = "torchtitan"
#: torchtitan's top-level sections that are not the model (its CheckpointManager).
_TT_SECTIONS = ("optimizer.", "lr_scheduler.", "train_state.", "dataloader.")
_DATALOADER = "dataloader."
#: Each parameter's param group index, ``[[fqn, index], ...]``.
_PARAM_GROUPS = "train_state.pippy_param_groups"


def detect_layout(keys: Iterable[str]) -> str:
    """:data:`PIPPY` or :data:`TORCHTITAN`: the layout a checkpoint's keys are in.

    A model-only torchtitan checkpoint whose FQNs start with ``model.`` reads
    as pippy's: it names the same weights either way.
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
            f"would read back as {back!r}; keep other state in a section "
            "(<name>.<entry>) and the model's top-level modules out of torchtitan's "
            "section names (optimizer, lr_scheduler, train_state, dataloader)"
        )
    return name
