"""How a stage's optimizer state is keyed, packed and parsed in a checkpoint.

Optimizer state is keyed by parameter FQN (``state.layers.3.w.exp_avg``), not
by index into ``param_groups``: indices restart at 0 on every stage, so
indexed keys would collide across ranks and DCP would keep one stage's state.
DCP's ``flatten_optimizer_state_dict`` gives that, with one entry per
parameter and option; :func:`pack_scalars` puts each parameter's options and
0-dim state into one item, ``scalars.<fqn>``, so that a save writes a few
items per parameter instead of about fifteen. The layout on disk, under a
stage's ``optim.`` section:

* ``state.<fqn>.<name>``: a tensor with elements (AdamW's ``exp_avg``);
* ``scalars.<fqn>``: ``[[name, value], ...]`` with ``name`` either
  ``param_groups.<option>`` or ``state.<name>``; a 0-dim tensor is stored as
  ``[name, number, dtype name]``; and ``["group", index]``, the position of
  the parameter's group in its optimizer (an LR scheduler's per-group lists
  are positional).

A parameter whose gradient stayed None (an unused head, an expert no token
reached) has ``scalars.<fqn>`` but no ``state.<fqn>.*``: it had no state.

The grammar of a key is ``<section>.<fqn>[.<name>]``, and both the FQN and
the name may hold dots: DCP flattens nested state (Shampoo's
``state[p]["precond"] = {"L": ..., "R": ...}``) into ``state.<fqn>.precond.L``.
A key is therefore split where a known parameter FQN ends, never at a dot;
:class:`OptimKeys` owns that grammar, and every reader of these keys goes
through it.

:data:`LAYOUT_VERSION` numbers this packing. Layout 1 is the one above, the
first pippy wrote (checkpoints that record no version are layout 1); a
change that an older pippy would misread gets a new number, and
:func:`check_layout_version` refuses a checkpoint of a layout it does not
read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# The FQNs DCP's state_dict helpers name a module's parameter by (without the
# wrappers' prefixes of torch.compile, DDP, activation checkpointing).
from torch.distributed.checkpoint.state_dict import StateDictOptions, _get_fqns

from pippy.checkpoint.errors import CheckpointError

#: Optimizer state keyed by parameter FQN, as DCP's state_dict helpers give it.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

#: The optimizer layout this pippy writes (see the module docstring).
LAYOUT_VERSION = 1

_SECTIONS = ("state", "param_groups", "scalars")
# Where a key's optimizer section starts: after ``optim.`` at a segment start.
_OPTIM_SECTION = re.compile(r"(?:^|(?<=\.))optim\.(?=(?:state|param_groups|scalars)\.)")
# What DCP's flattening stores as a leaf of optimizer state (dicts nest them).
_STORABLE = (torch.Tensor, int, float)


def _naming_section(key: str) -> tuple[str, str] | None:
    """The section and rest of a ``scalars.`` or ``param_groups.`` key, at any root."""
    for start in (0, *(m.end() for m in _OPTIM_SECTION.finditer(key))):
        section, _, rest = key[start:].partition(".")
        if section in ("scalars", "param_groups") and rest:
            return section, rest
    return None


class OptimKeys:
    """The grammar of optimizer keys, parsed against the parameters' FQNs.

    A key is ``state.<fqn>.<name>``, ``param_groups.<fqn>.<option>`` or
    ``scalars.<fqn>`` (section-relative), or any of them after a root and
    ``optim.`` (``app.optim.state.<fqn>.<name>``, a whole checkpoint's key).
    It is split where the longest known FQN ends, so nested state
    (``precond.L``) and dotted FQNs both parse.

    Args:
        fqns: The FQNs of the parameters whose keys are parsed.

    Attributes:
        fqns: The known FQNs, as a frozenset.
    """

    def __init__(self, fqns: Iterable[str]) -> None:
        self.fqns = frozenset(fqns)

    @classmethod
    def of_module(cls, module: nn.Module) -> OptimKeys:
        """The parser for a module's parameters, each under every name it has.

        Args:
            module: A stage's module, possibly wrapped (DDP, FSDP2, compile).

        Returns:
            An :class:`OptimKeys` knowing every FQN DCP may give a parameter
            (a shared one's too).
        """
        return cls(
            fqn
            for name, _ in module.named_parameters(remove_duplicate=False)
            for fqn in _get_fqns(module, name)
        )

    @classmethod
    def of_keys(cls, keys: Iterable[str], model_fqns: Iterable[str] = ()) -> OptimKeys:
        """The parser for the FQNs a set of keys names.

        Each ``scalars.<fqn>`` item names its FQN whole. A
        ``param_groups.<fqn>.<option>`` entry that no FQN known so far parses
        (torchtitan's layout, which has no ``scalars`` items) names the key but
        its last segment: a param-group option is a keyword of the optimizer,
        an identifier. State keys name no FQN on their own.

        Args:
            keys: Keys, section-relative or under ``<root>optim.``.
            model_fqns: Further known FQNs (a torchtitan checkpoint's model keys).

        Returns:
            An :class:`OptimKeys` knowing those FQNs.
        """
        named = [pair for pair in map(_naming_section, keys) if pair is not None]
        known = cls([*model_fqns, *(rest for s, rest in named if s == "scalars")])
        derived = {  # the option: after the last dot
            rest.rpartition(".")[0]
            for section, rest in named
            if section == "param_groups" and not known.parse(f"{section}.{rest}")
        }
        return cls(known.fqns | (derived - {""}))

    def parse(self, key: str) -> tuple[str, str, str] | None:
        """Splits a section-relative key into section, FQN and name.

        Args:
            key: ``state.<fqn>.<name>``, ``param_groups.<fqn>.<option>`` or
                ``scalars.<fqn>``.

        Returns:
            ``(section, fqn, name)``, name ``""`` for a ``scalars`` item; None
            for a key of another section or of no known FQN.
        """
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
        """Splits a dotted checkpoint key into root, section, FQN and name.

        Args:
            key: A key such as ``app.optim.state.layers.0.w.precond.L``.

        Returns:
            ``("app.", "state", "layers.0.w", "precond.L")`` for that key: the
            root is what stands before ``optim.`` (empty when
            ``StageState``'s state_dict is the whole state_dict); None for a
            key that is no optimizer entry of a known FQN.
        """
        for match in _OPTIM_SECTION.finditer(key):
            parsed = self.parse(key[match.end() :])
            if parsed is not None:
                return key[: match.start()], *parsed
        return None

    def state_fqns(self, keys: Iterable[str]) -> set[str]:
        """The FQNs that have state among section-relative keys.

        Args:
            keys: Keys of a flattened optimizer state_dict.

        Returns:
            The FQN of every ``state.`` key that :meth:`parse` parses.
        """
        return {p[1] for p in map(self.parse, keys) if p and p[0] == "state"}


def pack_scalars(
    optim_sd: dict[str, Any],
    groups: dict[str, int] | None = None,
    keys: OptimKeys | None = None,
) -> dict[str, Any]:
    """Puts all of a parameter's optimizer entries but its tensors in one item.

    ``flatten_optimizer_state_dict`` gives one entry per parameter and name:
    AdamW's 11 options (``param_groups.<fqn>.lr``, ``...betas``, ...) and its
    0-dim ``state.<fqn>.step`` beside the moments. DCP writes each entry as an
    item of its own, at a fixed CPU cost per item (a ``torch.save``, a plan
    entry, a metadata entry). Packed: three items per parameter for AdamW
    (two moments and this list) instead of fourteen, still keyed by FQN, so
    any split of the model loads it. ``bench/README.md`` measures the gain.

    Args:
        optim_sd: A flattened optimizer state_dict (``get_state_dict`` with
            ``flatten_optimizer_state_dict=True``).
        groups: The index of each parameter's param group, by FQN.
        keys: The parser of ``optim_sd``'s keys; by default
            ``OptimKeys.of_keys(optim_sd)``.

    Returns:
        Tensors with elements under their keys; for each parameter,
        ``scalars.<fqn>``: a list of ``[name, value]`` pairs as the module
        docstring describes. DCP keeps such a list, with no tensor inside, as
        one item.

    Raises:
        CheckpointError: A key names no parameter ``keys`` knows.
    """
    keys = OptimKeys.of_keys(optim_sd) if keys is None else keys
    packed: dict[str, Any] = {}
    scalars: dict[str, list[list[Any]]] = {}
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
            entry = [entry[0], value.item(), str(value.dtype).removeprefix("torch.")]
        scalars.setdefault(fqn, []).append(entry)
    for fqn, index in (groups or {}).items():
        if fqn in scalars:
            scalars[fqn].append(["group", index])
    packed.update((f"scalars.{fqn}", entries) for fqn, entries in scalars.items())
    return packed


def unpack_scalars(packed: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`pack_scalars`: the flattened optimizer state_dict.

    A 0-dim tensor comes back on the CPU with its saved dtype and value
    (``.item()`` of a real dtype is exact); ``optimizer.load_state_dict``
    moves ``step`` to the parameter's device where the optimizer wants it
    there (``capturable``, ``fused``).

    Args:
        packed: An optimizer state_dict as :func:`pack_scalars` returns it.

    Returns:
        The flattened optimizer state_dict DCP's ``set_state_dict`` takes.
    """
    flat: dict[str, Any] = {}
    for key, value in packed.items():
        if not key.startswith("scalars."):
            flat[key] = value
            continue
        fqn = key.removeprefix("scalars.")
        for name, item, *dtype in value:
            if name == "group":
                continue
            section, name = name.split(".", 1)
            if dtype:
                item = torch.tensor(item, dtype=getattr(torch, dtype[0]))
            flat[f"{section}.{fqn}.{name}"] = item
    return flat


def saved_groups(packed: dict[str, Any]) -> dict[str, int]:
    """The index each parameter's param group had when saved, by FQN.

    Args:
        packed: An optimizer state_dict as :func:`pack_scalars` returns it.

    Returns:
        ``{fqn: group index}``; empty for checkpoints saved before pippy
        recorded it.
    """
    return {
        key.removeprefix("scalars."): entry[1]
        for key, value in packed.items()
        if key.startswith("scalars.")
        for entry in value
        if entry[0] == "group"
    }


def param_fqns(module: nn.Module) -> dict[nn.Parameter, str]:
    """Maps each parameter of ``module`` to the FQN DCP's state_dicts give it.

    Args:
        module: A stage's module, possibly wrapped (DDP, FSDP2, compile).

    Returns:
        ``{parameter: fqn}``, without the wrappers' prefixes.
    """
    return {
        param: next(iter(_get_fqns(module, name)))
        for name, param in module.named_parameters()
    }


def stateless_keys(wanted: Iterable[str], saved: Iterable[str]) -> set[str]:
    """Keys of optimizer state to skip: their parameter had none when saved.

    A parameter that requires grad but whose gradient stayed None gets no
    state from ``optimizer.step()``, so its checkpoint has its
    ``optim.scalars.<fqn>`` but no ``optim.state.<fqn>.*``. A fresh optimizer
    to load into has state for every such parameter (DCP's ``get_state_dict``
    creates it), so those keys are wanted but cannot be read. The keys are
    parsed against the FQNs of the ``scalars`` items of both.

    Args:
        wanted: The dotted keys of the state_dict to load into.
        saved: The checkpoint's keys.

    Returns:
        The keys of ``wanted`` whose parameter had no state in the checkpoint.
    """
    saved, wanted = set(saved), list(wanted)
    keys = OptimKeys.of_keys([*wanted, *saved])

    def state_of(key: str) -> tuple[str, str] | None:  # its (root, fqn)
        parsed = keys.split(key)
        return (parsed[0], parsed[2]) if parsed and parsed[1] == "state" else None

    had_state = set(map(state_of, saved))
    return {
        key
        for key in wanted
        if (param := state_of(key))
        and param not in had_state
        and f"{param[0]}optim.scalars.{param[1]}" in saved
    }


def _leaves(state: Mapping[Any, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Each non-dict value of nested optimizer state, with its dotted name."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def check_storable(
    optimizers: Sequence[torch.optim.Optimizer], fqn_of: Mapping[Any, str]
) -> None:
    """Refuses optimizer state that DCP's flattening cannot store.

    ``flatten_optimizer_state_dict`` takes tensors, ints and floats, nested
    in dicts, and raises a bare ``NotImplementedError`` on anything else (a
    ``str``, ``None``); this names the entry, before anything is written.

    Args:
        optimizers: The optimizers whose ``state`` is checked.
        fqn_of: The FQN of each parameter, for the message.

    Raises:
        CheckpointError: An entry (``precond.kind`` for a nested one) is of
            another type, naming the parameter's FQN, the entry and its type.
    """
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            for name, value in _leaves(state):
                if isinstance(value, _STORABLE):
                    continue
                fqn = fqn_of.get(param, "<not in the stage's module>")
                raise CheckpointError(
                    f"optimizer state {name!r} of parameter {fqn!r} is a "
                    f"{type(value).__name__}; DCP stores only tensors, ints, "
                    "floats and dicts of them in optimizer state. Keep it as a "
                    "number or a tensor (an enum as its int), or as a param-group "
                    "option, which may hold any picklable value"
                )


def check_layout_version(version: object, where: str) -> None:
    """Refuses a checkpoint whose optimizer layout this pippy does not read.

    Args:
        version: The layout recorded with the checkpoint; None for one that
            records none (written before the field existed: layout 1).
        where: The checkpoint, for the message (``"step-20"``).

    Raises:
        CheckpointError: ``version`` is neither None nor
            :data:`LAYOUT_VERSION`: one line naming both, and the fix.
    """
    if version is None or (type(version) is int and version == LAYOUT_VERSION):
        return
    newer = type(version) is int and version > LAYOUT_VERSION
    raise CheckpointError(
        f"{where} was written with optimizer layout {version!r}; this pippy "
        f"reads layout {LAYOUT_VERSION}; "
        + ("upgrade pippy" if newer else "no pippy writes it: the record is damaged")
    )


@contextmanager
def without_empty_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Hides param groups without parameters from DCP's ``set_state_dict``.

    The flattened optimizer state is keyed by parameter FQN, so a group with
    no parameters has no entries (nothing to lose), and torch 2.13's
    ``_unflatten_optim_state_dict`` fails on it with an ``IndexError``
    (it reads the group's first parameter). A stage can own no parameters
    of some group, e.g. a no-decay group for biases on a stage with none.

    Args:
        optimizer: The optimizer to load into; its groups are restored, in
            order, on exit.
    """
    groups = optimizer.param_groups
    kept = [i for i, group in enumerate(groups) if group["params"]]
    if len(kept) == len(groups):
        yield
        return
    optimizer.param_groups = [groups[i] for i in kept]
    try:
        yield
    finally:  # loading replaced the kept groups' dicts: put those back in place
        merged = list(groups)
        for i, group in zip(kept, optimizer.param_groups, strict=True):
            merged[i] = group
        optimizer.param_groups = merged
