"""What a rank's pipeline stage(s) checkpoint: ``StageState``, one state_dict.

:class:`StageState` is a rank's model, optimizer, scheduler, step and extra
state as one state_dict; :func:`merge_parts` makes a rank's several stages one
module, keyed as in the un-split model.

Optimizer state is keyed by parameter FQN, and a step in torchtitan's layout
is read in pippy's names (:mod:`~pippy.checkpoint.keys`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# _get_fqns: the FQNs DCP's state_dict helpers give a parameter (no wrapper prefixes).
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from pippy.checkpoint.checks import fingerprint, named_leaves
from pippy.checkpoint.errors import AS_SAVED, CheckpointError, KeyCollisionError, listed
from pippy.checkpoint.keys import OptimKeys, pack_scalars, unpack_scalars

# How a step is computed, not what it computes: param groups need not agree.
_IMPLEMENTATION_OPTIONS = {"params", "foreach", "fused", "capturable", "differentiable"}
#: Optimizer state keyed by parameter FQN, as DCP's state_dict helpers give it.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _as_list(value: Any) -> list[Any]:
    """None as [], one object as [it], a sequence as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, Sequence) else [value]


@contextmanager
def _named_renames(module: nn.Module) -> Iterator[None]:
    """Turns DCP's AttributeError on a key a state_dict hook renamed into ours."""
    try:
        yield
    except AttributeError as e:
        found = []  # the renaming hooks (torchtitan's fused QKV split into wq, wk, wv)
        for name, sub in module.named_modules():
            hooks = list(sub._state_dict_hooks.values())
            hooks += sub._state_dict_pre_hooks.values()
            own = dict(sub.named_parameters()).keys() | dict(sub.named_buffers()).keys()
            if hooks and (renamed := sorted(set(sub.state_dict(keep_vars=True)) - own)):
                hook = ", ".join(getattr(h, "__qualname__", repr(h)) for h in hooks)
                found.append(
                    f"module {name or '(root)'!r} ({type(sub).__name__}) has the "
                    f"state_dict hook {hook}, which gives it the key {renamed[0]!r}"
                )
        if not found:
            raise
        raise CheckpointError(
            f"{'; '.join(found)}: DCP's state_dict helpers map each key back to "
            "the parameter of that name and fail on it: checkpoint the "
            "parameters under their own names (remove the hook from the stage "
            "and convert keys when exporting)"
        ) from e


class StageState(Stateful):
    """The checkpointable state of the pipeline stage(s) a rank holds.

    Keys are ``model.<fqn>``, ``optim.*`` (see the module), ``lr_scheduler.*``,
    ``step`` and ``<extra name>.<name>``, with the un-split model's FQNs: the
    ranks' keys are disjoint (or equal across data-parallel replicas); the
    scheduler, step and extra state, equal on every rank, are stored once.

    Args:
        module: The stage's module, keeping the un-split model's FQNs (never
            renumbered), or a list of the stage modules this rank holds,
            merged with :func:`merge_parts`. DDP or FSDP2 wrapped is fine.
        optimizer: The optimizer over the modules' parameters, or one per
            module; None for the weights alone (no ``optim`` section).
        lr_scheduler: Optional LR scheduler, or one per optimizer (all with
            equal state: one copy is saved and loaded into each).
        step: Number of optimizer steps taken so far.
        extra: Further ``Stateful`` objects saved under their names (a data
            sampler), equal on every rank.

    Attributes:
        module: The one module (the parts merged) whose state is saved.
        modules: The stage modules as given, as a list.
        optimizer, lr_scheduler: As given; they may be replaced later.
        optimizers, lr_schedulers: The same, as lists (maybe empty).

    Raises:
        ValueError: An ``extra`` name is reserved or holds a module or an
            optimizer, a scheduler is given without an optimizer, or the
            lists' lengths do not match.
        KeyCollisionError: Two modules hold different parameters under one FQN.

    Note:
        DCP loads in place. Build the stage and its optimizer first, take
        ``sd = state.state_dict()`` (this creates the empty optimizer state to
        load into), ``dcp.load(sd, ...)``, then ``state.load_state_dict(sd)``;
        :func:`pippy.checkpoint.load_stage` does all three.
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        optimizer: Optimizer | Sequence[Optimizer] | None = None,
        lr_scheduler: LRScheduler | Sequence[LRScheduler] | None = None,
        *,
        step: int = 0,
        extra: Mapping[str, Stateful] | None = None,
    ) -> None:
        self.modules = _as_list(module)
        self.module = module if isinstance(module, nn.Module) else merge_parts(module)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.step = step
        self.extra = dict(extra or {})
        reserved = {"model", "optim", "lr_scheduler", "step"} & self.extra.keys()
        if reserved:
            raise ValueError(f"extra state may not use the reserved names {reserved}")
        held = [
            n for n, o in self.extra.items() if isinstance(o, nn.Module | Optimizer)
        ]
        if held:
            raise ValueError(
                f"extra state {held} is a module or optimizer: its keys would name "
                "this layout; pass all stage modules (and optimizers) as the "
                "first arguments"
            )
        if self.lr_schedulers and not self.optimizers:
            raise ValueError("an LR scheduler needs the optimizer it schedules")
        if len(self.optimizers) not in (0, 1, len(self.modules)):
            raise ValueError("give one optimizer, or one per module")
        if len(self.lr_schedulers) not in (0, 1, len(self.optimizers)):
            raise ValueError("give one LR scheduler, or one per optimizer")

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizer(s), as a list (empty without one)."""
        return _as_list(self.optimizer)

    @property
    def lr_schedulers(self) -> list[LRScheduler]:
        """The LR scheduler(s), as a list (empty without one)."""
        return _as_list(self.lr_scheduler)

    def state_dict(self) -> dict[str, Any]:
        """Returns the stage's state as a nested dict for ``dcp.save``/``load``.

        Returns:
            The sections the class names, nested (``optim`` and
            ``lr_scheduler`` only if given), holding the live tensors.

        Raises:
            CheckpointError: A submodule's state_dict hook renames its keys;
                the LR schedulers of a list hold different state; or an
                optimizer's state holds an entry DCP cannot store (a ``str``).
        """
        with _named_renames(self.module):
            if not self.optimizers:
                sd: dict[str, Any] = {"model": get_model_state_dict(self.module)}
            else:
                fqn_of, keys = _param_fqns(self.module)
                _check_storable(self.optimizers, fqn_of)
                model_sd, optim_sd = get_state_dict(
                    self.module, self.optimizers, options=OPTIONS
                )
                groups = {  # each parameter's index within its own optimizer
                    fqn_of[p]: i
                    for i, group in self._all_groups()
                    for p in group["params"]
                    if p in fqn_of
                }
                sd = {"model": model_sd, "optim": pack_scalars(optim_sd, groups, keys)}
        sd["step"] = self.step
        if self.lr_schedulers:
            sd["lr_scheduler"] = self._scheduler_state()
        for name, obj in self.extra.items():
            if not isinstance(obj, Stateful):
                raise TypeError(
                    f"extra state {name!r} is a {type(obj).__name__}, not a Stateful "
                    "(an object with state_dict() and load_state_dict()): loading "
                    "could not put its values back; wrap it in one"
                )
            sd[name] = obj.state_dict()
        return sd

    def _scheduler_state(self) -> dict[str, Any]:
        """The LR schedulers' one state; refuses schedulers that differ."""
        states = [s.state_dict() for s in self.lr_schedulers]
        if any(fingerprint(s) != fingerprint(states[0]) for s in states[1:]):
            raise CheckpointError(
                "the LR schedulers of this rank's parts hold different state, "
                "but one copy is saved for all of them: give every part the same "
                "schedule, stepped together"
            )
        return states[0]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Applies a state_dict from :meth:`state_dict` (after ``dcp.load``).

        All checks run before anything is applied. A parameter saved without
        optimizer state (no ``optim.state.`` entries) ends with none.

        Args:
            state_dict: The dict that ``dcp.load`` filled in place.

        Raises:
            CheckpointError: A state_dict hook renames keys; an
                ``optim.scalars.<fqn>`` item lacks an entry this optimizer has,
                or has one it lacks other than ``initial_lr``
                (``set_state_dict`` would load an empty dict for a missing
                ``step`` and ignore extra ones); part of a parameter's state is
                missing; a param group here joins parameters saved with
                different options (``set_state_dict`` would give them all the
                first one's); param groups here with different options hold
                parameters of one saved group (they would all get its
                options); or, with an LR scheduler, it was saved for another
                number of param groups or the groups were built in another order.
            RuntimeError: A model key is missing or unexpected
                (``set_state_dict`` is strict).
            KeyError: A section (``model``, ``optim``, ...) is missing.
        """
        with _named_renames(self.module):
            if not self.optimizers:
                set_model_state_dict(self.module, state_dict["model"])
            else:
                self._load_with_optimizer(state_dict)
        for scheduler in self.lr_schedulers:
            scheduler.load_state_dict(state_dict["lr_scheduler"])
        self.step = int(state_dict["step"])
        for name, obj in self.extra.items():
            obj.load_state_dict(state_dict[name])

    def _load_with_optimizer(self, state_dict: dict[str, Any]) -> None:
        """Checks optimizer and scheduler state, then applies model and optimizer."""
        optim_sd, saved_groups = unpack_scalars(state_dict["optim"])
        wanted = get_optimizer_state_dict(self.module, self.optimizers, options=OPTIONS)
        fqn_of, keys = _param_fqns(self.module)
        stateless = self._check_entries(wanted, optim_sd, keys)
        self._check_groups(optim_sd, fqn_of)
        self._check_split_groups(saved_groups, fqn_of)
        if self.lr_schedulers:
            self._check_scheduler(state_dict["lr_scheduler"], saved_groups, fqn_of)
        for param, fqn in fqn_of.items():
            if fqn in stateless:  # none was saved: none to fill
                for optimizer in self.optimizers:
                    optimizer.state.pop(param, None)
        with ExitStack() as stack:
            for optimizer in self.optimizers:
                stack.enter_context(_without_empty_groups(optimizer))
            set_state_dict(
                self.module,
                self.optimizers,
                model_state_dict=state_dict["model"],
                optim_state_dict=optim_sd,
                options=OPTIONS,
            )
        # No state, as saved: set_state_dict makes an empty entry for each
        # parameter without state (all of them for SGD without momentum).
        for param in fqn_of:
            for optimizer in self.optimizers:
                if not optimizer.state.get(param, True):
                    optimizer.state.pop(param, None)

    @staticmethod
    def _check_entries(
        wanted: Mapping[str, Any], loaded: Mapping[str, Any], keys: OptimKeys
    ) -> set[str]:
        """The FQNs saved without state; refuses other entries than the wanted."""
        stateless = keys.state_fqns(wanted) - keys.state_fqns(loaded)
        missing = sorted(
            k
            for k in wanted.keys() - loaded.keys()
            if not keys.state_fqns([k]) & stateless
        )
        # An LR scheduler's initial_lr may stay behind when loading into an
        # optimizer without one; any other entry is another optimizer's.
        extra = sorted(
            k
            for k in loaded.keys() - wanted.keys()
            if (p := keys.parse(k)) is None
            or (p[0], p[2]) != ("param_groups", "initial_lr")
        )
        lost = [k for k in missing if k.startswith("state.")]
        if lost:  # a parameter with none of its state is taken as stateless
            raise CheckpointError(
                f"the checkpoint's optimizer state has no {listed(lost)}, though it "
                "has other state of the same parameters: it was saved by another "
                f"optimizer class (or edited); build the optimizer {AS_SAVED}"
            )
        for what, odd in (("has no", missing), ("has entries this one lacks:", extra)):
            if odd:
                raise CheckpointError(
                    f"the checkpoint's optimizer state {what} {listed(odd)}: it was "
                    "saved by another optimizer class or with other param-group "
                    "options (an LR scheduler adds 'initial_lr'); build the "
                    f"optimizer (and scheduler) {AS_SAVED}"
                )
        return stateless

    def _all_groups(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Each param group with its index within its own optimizer."""
        for optimizer in self.optimizers:
            yield from enumerate(optimizer.param_groups)

    def _check_groups(
        self, optim_sd: Mapping[str, Any], fqn_of: Mapping[nn.Parameter, str]
    ) -> None:
        """Refuses a param group here whose parameters were saved with other options."""

        def comparable(value: Any) -> str:  # (0.9, 0.999) and [0.9, 0.999] agree
            return fingerprint(list(value) if isinstance(value, tuple) else value)

        for index, group in self._all_groups():
            fqns = [fqn_of[p] for p in group["params"] if p in fqn_of]
            differ: dict[str, tuple[str, Any, Any]] = {}
            options = sorted(group.keys() - _IMPLEMENTATION_OPTIONS, key="lr".__ne__)
            for option in options:
                here = group[option]
                saved = [optim_sd.get(f"param_groups.{f}.{option}") for f in fqns]
                if isinstance(here, bool) and any(  # a switch of the algorithm
                    isinstance(v, bool) and v != here for v in saved
                ):
                    raise CheckpointError(
                        f"param group {index} here has {option}={here}, the "
                        f"checkpoint {option}={not here} for {fqns[0]!r}: it "
                        "was saved by another optimizer class (AdamW is Adam "
                        "with decoupled_weight_decay=True) or with that option "
                        "switched, which loading would switch back; build the "
                        f"optimizer {AS_SAVED}"
                    )
                for fqn, value in zip(fqns[1:], saved[1:], strict=True):
                    if comparable(value) != comparable(saved[0]):
                        differ.setdefault(option, (fqn, saved[0], value))
            if differ:
                option, (fqn, first, other) = next(iter(differ.items()))
                raise CheckpointError(
                    f"param group {index} here holds parameters saved with different "
                    f"{', '.join(map(repr, differ))}: {option} {first!r} for "
                    f"{fqns[0]!r}, {other!r} for {fqn!r}; one group would silently "
                    f"get the first one's; build the param groups {AS_SAVED}"
                )

    def _check_split_groups(
        self, saved_groups: Mapping[str, int], fqn_of: Mapping[nn.Parameter, str]
    ) -> None:
        """Refuses groups with options of their own holding one saved group's params.

        Loading would give them all the saved group's options.
        """
        first: dict[tuple[int, int], tuple[int, str]] = {}
        for number, optimizer in enumerate(self.optimizers):
            groups = optimizer.param_groups
            for index, group in enumerate(groups):
                for param in group["params"]:
                    fqn = fqn_of.get(param, "")
                    if (saved := saved_groups.get(fqn)) is None:
                        continue  # not saved in groups (older steps)
                    other, other_fqn = first.setdefault((number, saved), (index, fqn))
                    if other == index:
                        continue
                    differ = sorted(
                        option
                        for option in groups[other].keys() - _IMPLEMENTATION_OPTIONS
                        if option != "initial_lr"
                        and fingerprint(groups[other][option])
                        != fingerprint(group.get(option))
                    )
                    if differ:
                        raise CheckpointError(
                            f"param groups {other} and {index} here hold "
                            f"{other_fqn!r} and {fqn!r}, saved in one group: "
                            f"loading would give both its {', '.join(differ)}, "
                            f"not this run's; build the param groups {AS_SAVED}, "
                            "or load the weights alone (a StageState without the "
                            "optimizer)"
                        )

    def _check_scheduler(
        self,
        saved: Mapping[str, Any],
        saved_groups: Mapping[str, int],
        fqn_of: Mapping[nn.Parameter, str],
    ) -> None:
        """Refuses param groups unlike the saved ones in number or order."""
        # Loaded for another number of groups, LambdaLR, CosineAnnealingLR and
        # SequentialLR fail at their first step, others run on misaligned.
        for key in ("base_lrs", "min_lrs", "_last_lr"):
            for scheduler in self.lr_schedulers:
                ours, theirs = scheduler.state_dict().get(key), saved.get(key)
                if not (isinstance(ours, list) and isinstance(theirs, list)):
                    continue
                if len(ours) != len(theirs):
                    raise CheckpointError(
                        f"the LR scheduler was saved for {len(theirs)} param "
                        f"group(s) (its {key!r}), this one has {len(ours)}: its "
                        "per-group schedule would not line up; build the param "
                        f"groups {AS_SAVED}"
                    )
        for index, group in self._all_groups():
            for param in group["params"]:
                if (was := saved_groups.get(fqn_of.get(param, ""), index)) != index:
                    raise CheckpointError(
                        f"param group {index} here holds {fqn_of[param]!r}, which "
                        f"was in group {was} when saved: the LR scheduler's "
                        "per-group lists (base_lrs, ...) are by position, so two "
                        "groups would swap schedules; build the param groups in "
                        "the order of the run that saved it"
                    )


def _check_one(held: Any, new: Any, fqn: str) -> None:
    """Refuses two different tensors saved under one FQN."""
    if held is not None and held is not new:
        raise KeyCollisionError(
            f"two parts of this rank hold different tensors named {fqn!r}: DCP "
            "would save one of them; each part must hold what it owns, under the "
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
        children = {id(c): c for m in modules if (c := m._modules.get(name))}
        merged.add_module(name, _merge(list(children.values()), f"{path}{name}."))
    return merged


def merge_parts(parts: Sequence[nn.Module]) -> nn.Module:
    """The parts as one module holding all their entries (no forward; no copies)."""
    if not parts:
        raise ValueError("merge_parts needs at least one stage module")
    # A DDP wrapper's keys have no ``module.`` prefix: merge what it holds.
    return _merge([p.module if isinstance(p, DDP) else p for p in parts], "")


def _param_fqns(module: nn.Module) -> tuple[dict[nn.Parameter, str], OptimKeys]:
    """Each parameter's FQN in DCP's state_dicts, and the parser for all of them."""
    fqn_of: dict[nn.Parameter, str] = {}
    every: list[str] = []  # every FQN DCP may give a (maybe wrapped, tied) parameter
    for name, param in module.named_parameters(remove_duplicate=False):
        fqns = _get_fqns(module, name)
        fqn_of.setdefault(param, next(iter(fqns)))
        every += fqns
    return fqn_of, OptimKeys(every)


def stateless_keys(wanted: Iterable[str], saved: Iterable[str]) -> set[str]:
    """Keys of ``wanted`` to skip: their parameter was saved with scalars, no state."""
    saved = saved if isinstance(saved, Mapping | Set) else set(saved)
    wanted = [k for k in wanted if k not in saved]  # a saved key's parameter has state
    if not wanted:
        return set()
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


def _check_storable(optimizers: Sequence[Optimizer], fqn_of: Mapping[Any, str]) -> None:
    """Names optimizer state DCP's flattening would refuse with a bare error."""
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            for name, value in named_leaves(state):
                if not isinstance(value, torch.Tensor | int | float):
                    fqn = fqn_of.get(param, "<not in the stage's module>")
                    raise CheckpointError(
                        f"optimizer state {name!r} of parameter {fqn!r} is a "
                        f"{type(value).__name__}; DCP stores only tensors, ints, "
                        "floats and dicts of them in optimizer state; keep it as a "
                        "number or a tensor (an enum as its int), or as a "
                        "param-group option, which may hold any picklable value"
                    )


@contextmanager
def _without_empty_groups(optimizer: Optimizer) -> Iterator[None]:
    """Hides param groups without parameters from DCP's ``set_state_dict``."""
    # Such a group has no keyed entries (a stage with no biases of a no-decay
    # group), and torch 2.13's _unflatten_optim_state_dict reads its first one.
    groups = optimizer.param_groups
    kept = [i for i, group in enumerate(groups) if group["params"]]
    optimizer.param_groups = [groups[i] for i in kept]
    try:
        yield
    finally:  # loading replaced the kept groups' dicts: put those back in place
        merged = list(groups)
        for i, group in zip(kept, optimizer.param_groups, strict=True):
            merged[i] = group
        optimizer.param_groups = merged


def take_or_failure(take: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], Any]:
    """``(take(), None)``; if it fails, ``({}, error)`` for DCP's planning to raise."""
    try:
        return take(), None
    except Exception as e:
        if not dist.is_initialized():  # no rank waits for this one
            raise
        return {}, e


def statefuls_taken(state: Mapping[str, Any]) -> dict[str, Any]:
    """A plain state_dict with its top-level Statefuls' state, as DCP takes it."""
    return {
        k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()
    }
