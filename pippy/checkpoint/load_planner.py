"""``SafeLoadPlanner``: what DCP's load plan reads, checked before anything is read.

DCP's ``DefaultLoadPlanner`` unpickles non-tensor items with
``torch.load(weights_only=False)``, stops at the first missing key, converts
dtypes without a word and ignores checkpoint keys that no rank asks for. This
planner refuses each of those, naming the keys and the fix.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from pippy.checkpoint.checks import named_leaves
from pippy.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from pippy.checkpoint.safe_load import refusal, resolve_trusted
from pippy.checkpoint.state import (
    TORCHTITAN,
    OptimKeys,
    detect_layout,
    pippy_name,
    stateless_keys,
)

__all__ = ["SafeLoadPlanner"]


def _drop_leaves(state_dict: dict[str, Any], keys: set[str], prefix: str = "") -> None:
    """Deletes, in place, the leaves of a nested dict whose dotted key is in keys."""
    for key in list(state_dict):
        value = state_dict[key]
        if isinstance(value, dict):
            _drop_leaves(value, keys, f"{prefix}{key}.")
        elif f"{prefix}{key}" in keys:
            del state_dict[key]


def _section(key: str) -> str:
    """The ``must_read`` prefix of a pippy key's section: ``data.``, ``step``."""
    head, dot, _ = key.partition(".")
    return head + dot


def _quoted(names: list[str]) -> str:
    """``a 'x' section``, ``'x' and 'y' sections``: the sections named so."""
    names = [repr(n.rstrip(".")) for n in names]
    if len(names) == 1:
        return f"a {names[0]} section"
    return f"{', '.join(names[:-1])} and {names[-1]} sections"


def _must_read(sections: set[str]) -> tuple[str, ...]:
    """The sections as a ``must_read``: pippy's own first, then the extras."""
    own = ("model.", "optim.", "lr_scheduler.", "step")
    return tuple(s for s in own if s in sections) + tuple(sorted(sections - {*own}))


def _allow_hint(refused: str) -> str:
    """How to allow one class of a param group's options, named by its global."""
    module, _, name = refused.rpartition(".")
    return (
        f"If {name} is a class of yours that a param group holds (a dataclass "
        "option, say) and you trust it, allow that class alone, before loading: "
        f"torch.serialization.add_safe_globals([{name}]) ({name} of {module})."
    )


class SafeLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that runs no pickled code and drops no key.

    Non-tensor items are read with ``torch.load(weights_only=True)``. Each
    requested key is checked (present, shape, dtype) before planning, and on
    the coordinator every checkpoint key under ``must_read`` must be read by
    some rank (DCP ignores keys no rank asks for: a checkpoint with more
    layers than the model would load "successfully"). The state of a
    parameter saved without any (:func:`~pippy.checkpoint.state.stateless_keys`)
    is dropped from the state_dict being loaded.

    Args:
        trusted: True reads any pickle, as ``DefaultLoadPlanner`` does; None
            decides by :func:`resolve_trusted`.
        must_read: Prefixes of the checkpoint keys that some rank must read;
            ``("",)`` (the default) is every key, ``()`` none. Loading only
            the weights (a fine-tuning start) passes ``("model.",)``.
        **kwargs: Passed to ``DefaultLoadPlanner``.

    Raises:
        UnsafeCheckpointError: From :meth:`load_bytes`, naming the key, its
            file and the refused global; for an ``optim.scalars`` item, also
            ``torch.serialization.add_safe_globals``, which ``weights_only``
            honours.
        CheckpointError: From :meth:`create_local_plan`, naming keys missing
            or of another shape or dtype; from :meth:`create_global_plan`,
            naming the keys that no rank reads.
    """

    def __init__(
        self,
        *,
        trusted: bool | None = None,
        must_read: tuple[str, ...] = ("",),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.trusted = resolve_trusted(trusted)
        self.must_read = must_read
        self.optim_keys = OptimKeys(())  # set up with the keys by set_up_planner
        # A key's name in pippy's layout, for messages; set up likewise.
        self.layout_name: Callable[[str], str] = str

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Removes the state of parameters saved without any, then sets up DCP's."""
        wanted = [key for key, _ in named_leaves(state_dict)]
        saved = metadata.state_dict_metadata if metadata is not None else {}
        self.optim_keys = OptimKeys.of_keys([*wanted, *saved])
        self.layout_name = pippy_name if detect_layout(saved) == TORCHTITAN else str
        if metadata is not None:
            _drop_leaves(state_dict, stateless_keys(wanted, saved))
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def _optim_section(self, key: str) -> str | None:
        """The optimizer section of a dotted key (``state``, ...), or None."""
        parsed = self.optim_keys.split(key)
        return None if parsed is None else parsed[1]

    def create_local_plan(self) -> LoadPlan:
        """Checks every requested key (present, shape, dtype), then plans."""
        saved = self.metadata.state_dict_metadata if self.metadata else {}
        problems: dict[str, str] = {}  # key: what is wrong with it
        for key, value in self.state_dict.items():
            item = saved.get(key)
            if item is None:
                if not self.allow_partial_load:
                    problems[key] = f"{key!r} is not in the checkpoint"
            elif isinstance(value, torch.Tensor):
                if not isinstance(item, TensorStorageMetadata):
                    problems[key] = f"{key!r} is not a tensor in the checkpoint"
                elif tuple(item.size) != tuple(value.shape):
                    problems[key] = (
                        f"{key!r} has shape {list(item.size)} in the checkpoint, "
                        f"{list(value.shape)} here"
                    )
                elif item.properties.dtype != value.dtype:
                    problems[key] = (
                        f"{key!r} is {item.properties.dtype} in the checkpoint, "
                        f"{value.dtype} here"
                    )
        if problems:
            shown = "; ".join(list(problems.values())[:6])
            what = "this model" if self._in_model(problems) else "this run's state"
            raise CheckpointError(
                f"the checkpoint does not match {what} ({len(problems)} "
                f"problem(s)): {shown}{' ...' if len(problems) > 6 else ''}. "
                f"{self._fix_for(problems, saved)}"
            )
        return super().create_local_plan()

    def _in_model(self, keys: Any) -> bool:
        """Whether some of the keys are the model's or the optimizer's."""
        return any(_section(self.layout_name(k)) in ("model.", "optim.") for k in keys)

    def _fix_for(self, problems: dict[str, str], saved: Any) -> str:
        """What to do about the problems :meth:`create_local_plan` found."""
        wants_packed = any(k.startswith("optim.scalars.") for k in self.state_dict)
        if wants_packed and any(k.startswith("optim.param_groups.") for k in saved):
            return (
                "It was written by pippy before optimizer options were packed "
                "into optim.scalars.<fqn> (it has optim.param_groups.* keys): "
                "load its weights alone (load_model, or a StageState, without "
                "an optimizer)."
            )
        if all(self._optim_section(k) == "state" for k in problems):
            return (
                "Only the optimizer's state differs: build the optimizer as the "
                "run that saved it did (its class, and options that add state, "
                "such as amsgrad or momentum)."
            )
        if all(re.search(r"(^|\.)lr_scheduler\.", k) for k in problems):
            return "Build the LR scheduler (or none) as the run that saved it did."
        if not self._in_model(problems):
            return self._fix_for_sections(problems, saved)
        return "Build the model with the configuration it was saved with."

    def _fix_for_sections(self, problems: dict[str, str], saved: Any) -> str:
        """What to do about problems of this state's other sections (``extra``)."""
        name = self.layout_name
        sections = sorted({_section(name(k)) for k in problems})
        if any(k in saved for k in problems):
            return (
                f"This run's state has {_quoted(sections)} unlike the "
                "checkpoint's: build it as the run that saved the checkpoint did."
            )
        elsewhere = [
            repr(key)
            for key in saved
            if any(name(key).endswith(f".{name(k)}") for k in problems)
        ]
        instead = f" (it holds {', '.join(elsewhere[:3])} instead)" if elsewhere else ""
        return (
            f"This run's state has {_quoted(sections)} that the checkpoint "
            f"lacks{instead}: load a step saved with the same state, or build "
            "this run's state without it."
        )

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """DCP's global plan, after checking that no required key is left unread."""
        global_plan = super().create_global_plan(global_plan)
        read = {item.storage_index.fqn for plan in global_plan for item in plan.items}
        unread = sorted(
            key
            for key in (self.metadata.state_dict_metadata if self.metadata else {})
            if key.startswith(self.must_read) and key not in read
        )
        if not unread:
            return global_plan
        shown = ", ".join(repr(k) for k in unread[:8])
        raise CheckpointError(
            f"{len(unread)} key(s) of the checkpoint are read by no rank and "
            f"would be dropped: {shown}{' ...' if len(unread) > 8 else ''}. "
            f"{self._why_unread(unread, read)}"
        )

    def _why_unread(self, unread: list[str], read: set[str]) -> str:
        """Why the checkpoint's keys that no rank reads are unread, and the fix."""
        name, why = self.layout_name, []
        sections = {_section(name(k)) for k in unread} - {"model.", "optim."}
        ours = _must_read({_section(name(k)) for k in self.state_dict})
        if extra := sorted(sections - {"lr_scheduler.", "step"}):
            it, each = ("it", "that") if len(extra) == 1 else ("them", "each")
            why.append(
                f"This run's state lacks {_quoted(extra)}: to restore {it}, add "
                f"a Stateful of {each} name to the StageState's extra; to leave "
                f"{it} unread, load with must_read={ours!r}."
            )
        if own := sorted(sections & {"lr_scheduler.", "step"}):
            why.append(
                f"This run's state lacks {_quoted(own)}: build it with the LR "
                "scheduler and step of the run that saved it, or load with "
                f"must_read={ours!r}."
            )
        others = [k for k in unread if self._optim_section(k) != "state"]
        if len(others) < len(unread):
            why.append(
                f"{'Some are' if others else 'They are'} optimizer state that "
                "the optimizer loaded into has no place for: it is another class "
                "(SGD without momentum has no state), it has stepped only some "
                "parameters (a fresh one gets state for every parameter that "
                "requires grad), or they do not require grad here. Build the "
                "optimizer as the run that saved it did, freshly, and unfreeze "
                "them."
            )
        if self._in_model(others):
            why.append(self._why_unread_model(others, read))
        return " ".join(why)

    def _why_unread_model(self, unread: list[str], read: set[str]) -> str:
        """Why model keys are unread: a module this model lacks, or another split."""
        name = self.layout_name

        def module(key: str) -> str:  # the top-level module a model key names
            return name(key).removeprefix("model.").split(".")[0]

        ours = {module(k) for k in read if name(k).startswith("model.")}
        theirs = sorted(
            {module(k) for k in unread if name(k).startswith("model.")} - ours
        )
        if theirs and ours:
            missing, present = " or ".join(map(repr, theirs)), ", ".join(sorted(ours))
            return (
                f"This model has no module {missing} (its modules: {present}): "
                "those keys are another model's, or other state saved under "
                "'model.'. Load into the model that saved them, or remap those "
                "keys before loading."
            )
        return (
            "The model or its split does not match the checkpoint (fewer "
            "layers? per-stage state keyed by a stage index that no longer "
            "exists?). Fix the model, or remap those keys before loading."
        )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Checks one non-tensor item under ``weights_only`` rules, then loads it."""
        if not self.trusted:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                storage = self.metadata.storage_data if self.metadata else {}
                info = storage.get(read_item.storage_index)
                where = getattr(info, "relative_path", "its data file")
                what = f"item {read_item.dest_index.fqn!r} of {where}"
                match = re.search(r"GLOBAL ([\w.]+)", str(e))
                if match is None:  # not a refused global: the bytes are damaged
                    raise CheckpointError(f"{what} is damaged: {e}") from None
                error = refusal(what, match.group(1))
                if self._optim_section(read_item.dest_index.fqn) == "scalars":
                    error = UnsafeCheckpointError(f"{error} {_allow_hint(match[1])}")
                raise error from None
            value.seek(0)
        super().load_bytes(read_item, value)
