"""``StageState``: what a rank's pipeline stage(s) checkpoint, as one state_dict."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

from pippy.checkpoint.checks import fingerprint, renaming_hooks
from pippy.checkpoint.errors import CheckpointError
from pippy.checkpoint.optim_layout import (
    OPTIONS,
    OptimKeys,
    check_storable,
    pack_scalars,
    param_fqns,
    saved_groups,
    unpack_scalars,
    without_empty_groups,
)
from pippy.checkpoint.parts import merge_parts

__all__ = ["StageState"]

# How a step is computed, not what it computes: param groups need not agree.
_IMPLEMENTATION_OPTIONS = {"params", "foreach", "fused", "capturable", "differentiable"}

_Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
_Schedulers = (
    torch.optim.lr_scheduler.LRScheduler
    | Sequence[torch.optim.lr_scheduler.LRScheduler]
    | None
)


def _as_list(value: Any) -> list[Any]:
    """None as [], one object as [it], a sequence as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, Sequence) else [value]


def _listed(keys: list[str]) -> str:
    """The first five keys, quoted, and how many more."""
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return ", ".join(repr(k) for k in keys[:5]) + more


@contextmanager
def _named_renames(module: nn.Module) -> Iterator[None]:
    """Turns DCP's AttributeError on a key renamed by a hook into a CheckpointError."""
    try:
        yield
    except AttributeError as e:
        found = renaming_hooks(module)
        if not found:
            raise
        raise CheckpointError(
            f"{'; '.join(found)}: DCP's state_dict helpers map each key back to "
            "the parameter of that name and fail on it. Checkpoint the "
            "parameters under their own names (remove the hook from the stage "
            "and convert keys when exporting)"
        ) from e


class StageState(Stateful):
    """The checkpointable state of the pipeline stage(s) a rank holds.

    ``state_dict()`` returns a nested dict whose leaves DCP writes as
    ``model.<fqn>``, ``optim.state.<fqn>.<name>`` (the optimizer's tensors
    with elements, e.g. AdamW's ``exp_avg``), ``optim.scalars.<fqn>`` (all
    else of that parameter's optimizer entry in one item: its param group's
    options and 0-dim state such as AdamW's ``step``; see
    :mod:`pippy.checkpoint.optim_layout`), ``lr_scheduler.<name>``, ``step``
    and ``<extra name>.<name>``. Model and optimizer keys are the un-split
    model's FQNs of the parameters this rank's stages own, so the ranks' keys
    are disjoint (or, across data-parallel replicas, equal) and together
    form the whole model, whatever the layout; the scheduler, step and extra
    state are the same on every rank and DCP stores them once.

    Args:
        module: The stage's module, keeping the un-split model's FQNs (for
            example ``layers.5.mlp.w1.weight``, never renumbered); or a list
            of the stage modules this rank holds (interleaved schedules),
            merged with :func:`~pippy.checkpoint.parts.merge_parts`. A DDP or
            FSDP2 module is fine: keys have no wrapper prefix.
        optimizer: The optimizer over the modules' parameters, or a list with
            one optimizer per module (each over its module's parameters);
            None for the weights alone (no ``optim`` section).
        lr_scheduler: Optional LR scheduler of the optimizer, or a list with
            one per optimizer. A list must hold equal state (the same
            schedule); one copy is saved and loaded into each.
        step: Number of optimizer steps taken so far.
        extra: Further ``Stateful`` objects saved under their names (for
            example a data sampler). Their state must be the same on every
            rank: DCP keeps one copy of equal keys.

    Attributes:
        module: The one module (the parts merged) whose state is saved.
        modules: The stage modules as given, as a list.
        optimizer, lr_scheduler: As given; they may be replaced later.
        optimizers, lr_schedulers: The same, as lists (maybe empty).

    Raises:
        ValueError: An ``extra`` name is reserved or holds a module or an
            optimizer, a scheduler is given without an optimizer, or the
            lists' lengths do not match.
        KeyCollisionError: Two modules hold different parameters under one
            FQN.

    Note:
        DCP loads in place. Build the stage and its optimizer first, take
        ``sd = state.state_dict()`` (this creates the empty optimizer state to
        load into), ``dcp.load(sd, ...)``, then ``state.load_state_dict(sd)``;
        :func:`pippy.checkpoint.load_stage` does all three.
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        optimizer: _Optimizers = None,
        lr_scheduler: _Schedulers = None,
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
                "this layout. Pass all stage modules (and optimizers) as the "
                "first arguments"
            )
        if self.lr_schedulers and not self.optimizers:
            raise ValueError("an LR scheduler needs the optimizer it schedules")
        if len(self.optimizers) > 1 and len(self.optimizers) != len(self.modules):
            raise ValueError("give one optimizer, or one per module")
        if len(self.lr_schedulers) > 1 and len(self.lr_schedulers) != len(
            self.optimizers
        ):
            raise ValueError("give one LR scheduler, or one per optimizer")

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizer(s), as a list (empty without one)."""
        return _as_list(self.optimizer)

    @property
    def lr_schedulers(self) -> list[torch.optim.lr_scheduler.LRScheduler]:
        """The LR scheduler(s), as a list (empty without one)."""
        return _as_list(self.lr_scheduler)

    def state_dict(self) -> dict[str, Any]:
        """Returns the stage's state as a nested dict for ``dcp.save``/``load``.

        Returns:
            ``{"model": ..., "optim": ..., "step": int}``, plus
            ``"lr_scheduler"`` when there is one and one entry per ``extra``;
            no ``"optim"`` without an optimizer. Tensors are the live ones
            (no copies).

        Raises:
            CheckpointError: A submodule's state_dict hook renames its keys
                (a fused QKV weight saved as ``wq``, ``wk``, ``wv``), naming
                the module and the hook; or the LR schedulers of a list hold
                different state; or an optimizer's state holds an entry DCP
                cannot store (a ``str``), naming the parameter, the entry and
                its type.
        """
        with _named_renames(self.module):
            if not self.optimizers:
                sd: dict[str, Any] = {"model": get_model_state_dict(self.module)}
            else:
                check_storable(self.optimizers, param_fqns(self.module))
                model_sd, optim_sd = get_state_dict(
                    self.module, self.optimizers, options=OPTIONS
                )
                keys = OptimKeys.of_module(self.module)
                sd = {
                    "model": model_sd,
                    "optim": pack_scalars(optim_sd, self._groups(), keys),
                }
        sd["step"] = self.step
        if self.lr_schedulers:
            sd["lr_scheduler"] = self._scheduler_state()
        for name, obj in self.extra.items():
            sd[name] = obj.state_dict()
        return sd

    def _groups(self) -> dict[str, int]:
        """Each parameter's param group index within its own optimizer, by FQN."""
        fqn_of = param_fqns(self.module)
        return {
            fqn_of[p]: i
            for optimizer in self.optimizers
            for i, group in enumerate(optimizer.param_groups)
            for p in group["params"]
            if p in fqn_of
        }

    def _scheduler_state(self) -> dict[str, Any]:
        """The LR schedulers' one state; refuses schedulers that differ."""
        states = [s.state_dict() for s in self.lr_schedulers]
        if any(fingerprint(s) != fingerprint(states[0]) for s in states[1:]):
            raise CheckpointError(
                "the LR schedulers of this rank's parts hold different state; "
                "one copy is saved for all of them. Give every part the same "
                "schedule, stepped together"
            )
        return states[0]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Applies a state_dict from :meth:`state_dict` (after ``dcp.load``).

        Its checks all run before anything is applied (``dcp.load`` has
        filled the tensors in place already). A parameter none of whose
        ``optim.state.`` entries are in ``state_dict`` (it had no optimizer
        state when saved, so ``SafeLoadPlanner`` read none) ends with no
        optimizer state, as saved, so that its next step starts its state
        afresh, as the saved run would.

        Args:
            state_dict: The dict that ``dcp.load`` filled in place.

        Raises:
            CheckpointError: As :meth:`state_dict`.
            RuntimeError: A model key is missing or unexpected
                (``set_state_dict`` is strict).
            KeyError: A section (``model``, ``optim``, ...) is missing.
            CheckpointError: An ``optim.scalars.<fqn>`` item lacks an entry
                this optimizer has, or has one it lacks (saved by another
                optimizer class, or without the LR scheduler that adds
                ``initial_lr``; an ``initial_lr`` this optimizer lacks is
                allowed). DCP cannot see inside the item, and
                ``set_state_dict`` would load an empty dict for a missing
                state entry such as ``step`` and ignore extra ones. Also:
                some of a parameter's state is missing while the rest is
                there (a damaged or edited checkpoint).
            CheckpointError: A param group here joins parameters saved with
                different options (``set_state_dict`` would give them all the
                first one's), or the LR scheduler was saved for another number
                of param groups.
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
        optim_sd = unpack_scalars(state_dict["optim"])
        wanted = get_optimizer_state_dict(self.module, self.optimizers, options=OPTIONS)
        keys = OptimKeys.of_module(self.module)
        stateless = keys.state_fqns(wanted) - keys.state_fqns(optim_sd)
        self._check_entries(wanted, optim_sd, stateless, keys)
        fqn_of = param_fqns(self.module)
        self._check_groups(optim_sd, fqn_of)
        if self.lr_schedulers:
            self._check_scheduler(state_dict["lr_scheduler"])
            self._check_group_order(saved_groups(state_dict["optim"]), fqn_of)
        for param, fqn in fqn_of.items():
            if fqn in stateless:  # none was saved: none to fill
                for optimizer in self.optimizers:
                    optimizer.state.pop(param, None)
        with ExitStack() as stack:
            for optimizer in self.optimizers:
                stack.enter_context(without_empty_groups(optimizer))
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
        wanted: Mapping[str, Any],
        loaded: Mapping[str, Any],
        stateless: set[str],
        optim_keys: OptimKeys,
    ) -> None:
        """Refuses loaded optimizer entries other than the wanted ones."""
        missing = sorted(
            k
            for k in wanted.keys() - loaded.keys()
            if not optim_keys.state_fqns([k]) & stateless
        )
        # An LR scheduler's initial_lr may stay behind when loading into an
        # optimizer without one; any other entry is another optimizer's.
        extra = sorted(
            k
            for k in loaded.keys() - wanted.keys()
            if (p := optim_keys.parse(k)) is None
            or (p[0], p[2]) != ("param_groups", "initial_lr")
        )
        lost = [k for k in missing if k.startswith("state.")]
        if lost:  # a parameter with none of its state is taken as stateless
            raise CheckpointError(
                f"the checkpoint's optimizer state has no {_listed(lost)}, though it "
                "has other state of the same parameters: the checkpoint is "
                "damaged or was edited; load an earlier step"
            )
        for what, keys in (("has no", missing), ("has entries this one lacks:", extra)):
            if keys:
                raise CheckpointError(
                    f"the checkpoint's optimizer state {what} {_listed(keys)}: it was "
                    "saved by another optimizer class or with other param-group "
                    "options (an LR scheduler adds 'initial_lr'); build the "
                    "optimizer (and scheduler) as the run that saved it did"
                )

    def _all_groups(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Each param group with its index within its own optimizer."""
        for optimizer in self.optimizers:
            yield from enumerate(optimizer.param_groups)

    def _check_groups(
        self, optim_sd: Mapping[str, Any], fqn_of: Mapping[nn.Parameter, str]
    ) -> None:
        """Refuses a param group here whose parameters were saved with other options."""
        # set_state_dict gives a param group the saved options of its first
        # parameter, so a group joining parameters saved with different options
        # would silently give them all the first one's learning rate.

        def comparable(value: Any) -> str:  # (0.9, 0.999) and [0.9, 0.999] agree
            return fingerprint(list(value) if isinstance(value, tuple) else value)

        for index, group in self._all_groups():
            fqns = [fqn_of[p] for p in group["params"] if p in fqn_of]
            differ: dict[str, tuple[str, Any, Any]] = {}
            options = sorted(group.keys() - _IMPLEMENTATION_OPTIONS, key="lr".__ne__)
            for option in options:
                values = [optim_sd.get(f"param_groups.{f}.{option}") for f in fqns]
                for fqn, value in zip(fqns[1:], values[1:], strict=True):
                    if comparable(value) != comparable(values[0]):
                        differ[option] = (fqn, values[0], value)
                        break
            if differ:
                option, (fqn, first, other) = next(iter(differ.items()))
                raise CheckpointError(
                    f"param group {index} here holds parameters saved with different "
                    f"{', '.join(map(repr, differ))}: {option} {first!r} for "
                    f"{fqns[0]!r}, {other!r} for {fqn!r}; one group would silently "
                    "get the first one's. Build the param groups as the run that "
                    "saved it did"
                )

    def _check_group_order(
        self, saved: Mapping[str, int], fqn_of: Mapping[nn.Parameter, str]
    ) -> None:
        """Refuses param groups built in another order than saved (with a scheduler)."""
        for index, group in self._all_groups():
            for param in group["params"]:
                was = saved.get(fqn_of.get(param, ""), index)
                if was != index:
                    raise CheckpointError(
                        f"param group {index} here holds {fqn_of[param]!r}, which "
                        f"was in group {was} when saved: the LR scheduler's "
                        "per-group lists (base_lrs, ...) are by position, so two "
                        "groups would swap schedules. Build the param groups in "
                        "the order of the run that saved it"
                    )

    def _check_scheduler(self, saved: Mapping[str, Any]) -> None:
        """Refuses an LR scheduler saved for another number of param groups."""
        # A scheduler keeps per-group lists (base_lrs, _last_lr, min_lrs); loaded
        # for another number of groups, LambdaLR, CosineAnnealingLR and
        # SequentialLR fail at their first step, others run on misaligned. They
        # are compared with this scheduler's own lists: a group added to the
        # optimizer after the scheduler was built is in neither.
        for key in ("base_lrs", "min_lrs", "_last_lr"):
            for scheduler in self.lr_schedulers:
                ours, theirs = scheduler.state_dict().get(key), saved.get(key)
                if not (isinstance(ours, list) and isinstance(theirs, list)):
                    continue
                if len(ours) != len(theirs):
                    raise CheckpointError(
                        f"the LR scheduler was saved for {len(theirs)} param "
                        f"group(s) (its {key!r}), this one has {len(ours)}: its "
                        "per-group schedule would not line up. Build the param "
                        "groups as the run that saved it did"
                    )
