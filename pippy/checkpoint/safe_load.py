"""What a load may unpickle and must read: ``SafeLoadPlanner``, and the trust switch.

DCP's ``DefaultLoadPlanner`` reads non-tensor items with
``torch.load(weights_only=False)``, stops at the first missing key,
converts dtypes silently and ignores keys that no rank asks for.
:class:`SafeLoadPlanner` refuses all of this, naming the keys and the fix.
:func:`restricted_load` is the one way a load unpickles a non-tensor item,
and :func:`resolve_trusted` the one place that reads
``PIPPY_TRUST_CHECKPOINT``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
)

from pippy.checkpoint.checks import leaf_places
from pippy.checkpoint.errors import (
    AS_SAVED,
    CheckpointError,
    UnsafeCheckpointError,
    listed,
)
from pippy.checkpoint.keys import TORCHTITAN, OptimKeys, detect_layout, pippy_name
from pippy.checkpoint.state import stateless_keys

#: Environment variable that, set to 1, lets the safe reader and planner load
#: any pickle, as plain DCP does. Only for checkpoints from a trusted source.
TRUST_ENV = "PIPPY_TRUST_CHECKPOINT"


def resolve_trusted(trusted: bool | None) -> bool:
    """``trusted`` if given; for None, whether ``PIPPY_TRUST_CHECKPOINT`` is 1."""
    return os.environ.get(TRUST_ENV) == "1" if trusted is None else trusted


def refusal(what: str, refused: str, allow: str = "") -> UnsafeCheckpointError:
    """The error for ``what``, whose pickle imports ``refused``; ``allow``: or how."""
    return UnsafeCheckpointError(
        f"refused to load {what}: it would import {refused}, which no checkpoint "
        "written by DCP or pippy holds and whose unpickling could run code; if you "
        f"trust where the checkpoint comes from, set {TRUST_ENV}=1 (or pass "
        "trusted=True, or --trust-checkpoint to python -m pippy) to load it "
        f"with plain pickle{allow}"
    )


class _NoGlobals(pickle.Unpickler):
    """pickle's C unpickler, refusing every global: it builds plain values only."""

    def find_class(self, module: str, name: str) -> Any:
        """Refuses: a global makes the item one for the weights_only unpickler."""
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


#: ``torch.load``'s ``pickle_module`` for :func:`restricted_load`.
_NO_GLOBALS = SimpleNamespace(
    __name__="pippy_no_globals",
    Unpickler=_NoGlobals,
    load=lambda file, **kwargs: _NoGlobals(file, **kwargs).load(),
)


def restricted_load(value: io.BytesIO, trusted: bool = False) -> Any:
    """A ``torch.save``d non-tensor item, unpickled with no global it may not name."""
    # Numbers, strings, lists, dicts and tuples need no global: pickle's C unpickler
    # builds them with every global refused, calling nothing, at plain dcp.load's
    # speed. Anything else (a tensor, bytes, a set, a class) goes to weights_only.
    if not trusted:
        try:
            return torch.load(value, weights_only=False, pickle_module=_NO_GLOBALS)
        except Exception:
            value.seek(0)
    return torch.load(value, weights_only=not trusted)


def _section(key: str) -> str:
    """The ``must_read`` prefix of a pippy key's section: ``data.``, ``step``."""
    head, dot, _ = key.partition(".")
    return head + dot


def _quoted(names: list[str]) -> str:
    """``a 'x' section``, ``'x' and 'y' sections``: the sections named so."""
    *head, last = [repr(n.rstrip(".")) for n in names] or [""]
    return f"{', '.join(head)} and {last} sections" if head else f"a {last} section"


def _keys_read(plan: LoadPlan) -> list[str]:
    """The keys a rank's local plan reads: as its planner listed them, or its items'."""
    if isinstance(plan.planner_data, list):
        return plan.planner_data
    return [item.storage_index.fqn for item in plan.items]


def _empty(item: Any) -> bool:
    """Whether a checkpoint item is a tensor of no element (nothing to read)."""
    return isinstance(item, TensorStorageMetadata) and 0 in item.size


#: Why the keys :meth:`SafeLoadPlanner.create_local_plan` refuses do not match,
#: and the fix, by cause (the first that applies).
_MISMATCH = {
    "dtype": "this run's tensors are of another dtype than the checkpoint's: build "
    "them in the checkpoint's dtype ({dtypes}, for example with module.to(dtype)) "
    "before loading, as a load would cast every tensor",
    "unpacked": "the checkpoint was written by pippy before optimizer options were "
    "packed into optim.scalars.<fqn> (it has optim.param_groups.* keys): load its "
    "weights alone (load_model, or a StageState without an optimizer)",
    "optim state": "only the optimizer's state differs from the checkpoint's: build "
    f"the optimizer {AS_SAVED} (its class, and options that add state, such as "
    "amsgrad or momentum)",
    "optim": "only the optimizer differs from the checkpoint's: it holds other "
    "parameters than the saved one did (one frozen in a run and trained in the "
    f"other) or is of another class; build it over the same parameters {AS_SAVED}",
    "lr_scheduler": "the LR scheduler differs from the checkpoint's: build it (or "
    f"none) {AS_SAVED}",
    "model": "the model does not match the checkpoint: build it with the "
    "configuration it was saved with",
    "sections": "this run's state has {sections} unlike the checkpoint's: build it "
    + AS_SAVED,
    "lacking": "this run's state has {sections} that the checkpoint lacks{instead}: "
    "load a step saved with the same state, or build this run's state without it",
}

#: Why the checkpoint keys that :meth:`SafeLoadPlanner.create_global_plan`
#: finds unread are unread, and the fix, by cause (each that applies).
_UNREAD = {
    "extra": "this run's state lacks {extra}: to restore {it}, add a Stateful of "
    "{each} name to the StageState's extra; to leave {it} unread, load with "
    "must_read={ours!r}",
    "own": "this run's state lacks {own}: build it with the LR scheduler and step "
    "of the run that saved it, or load with must_read={ours!r}",
    "optim state": "{which} optimizer state that the optimizer loaded into has no "
    "place for (it is another class, as SGD without momentum has no state; it has "
    "stepped only some parameters, where a fresh one gets state for every "
    "parameter that requires grad; or they do not require grad here): build the "
    f"optimizer {AS_SAVED}, freshly, and unfreeze them",
    "module": "this model has no module {missing} (its modules: {present}), so "
    "those keys are another model's or other state saved under 'model.': load "
    "into the model that saved them, or remap those keys before loading",
    "split": "the model or its split does not match the checkpoint (fewer layers? "
    "per-stage state keyed by a stage index that no longer exists?): fix the "
    "model, or remap those keys before loading",
}


class SafeLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that runs no pickled code and drops no key.

    Non-tensor items of plain values are unpickled with every global refused,
    any other with ``torch.load(weights_only=True)``. Each requested key is
    checked (present, shape, dtype) before planning; on the coordinator, every
    checkpoint key under ``must_read`` must be read by some rank (a checkpoint
    with more layers than the model would otherwise load "successfully"). The
    state of a parameter saved without any is dropped from the state_dict
    being loaded.

    Args:
        trusted: True reads any pickle, as ``DefaultLoadPlanner`` does; None
            decides by :func:`resolve_trusted`.
        must_read: Prefixes of the checkpoint keys that some rank must read;
            ``("",)`` (the default) is every key, ``()`` none. Loading only
            the weights (a fine-tuning start) passes ``("model.",)``.
        reads_from: The metadata of the reader it must be used with (as
            :func:`~pippy.checkpoint.load_into` and ``open_step`` give it):
            planning a load whose reader gave other metadata is refused,
            before any read.
        **kwargs: Passed to ``DefaultLoadPlanner``.

    Raises:
        UnsafeCheckpointError: An item's pickle names a refused global (named
            with the key and file; for ``optim.scalars``, the message names
            ``torch.serialization.add_safe_globals``).
        CheckpointError: Requested keys missing or of another shape or dtype;
            checkpoint keys under ``must_read`` that no rank reads.
    """

    def __init__(
        self,
        *,
        trusted: bool | None = None,
        must_read: tuple[str, ...] = ("",),
        reads_from: Metadata | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.trusted = resolve_trusted(trusted)
        self.must_read = must_read
        self.reads_from = reads_from
        self._parser: OptimKeys | None = None  # built when a message needs it
        self.layout_name: Callable[[str], str] = str  # a key's pippy name

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """DCP's, less the state of parameters saved without any."""
        if self.reads_from is not None and metadata is not self.reads_from:
            raise ValueError(
                "dcp.load reads with another storage reader than the one this "
                "planner came with (from load_into or open_step), unchecked: pass "
                "it storage_reader=reader"
            )
        super().set_up_planner(state_dict, metadata, is_coordinator)
        wanted = list(self.state_dict)  # as DCP flattened them
        saved = metadata.state_dict_metadata if metadata is not None else {}
        self._parser = None
        self.layout_name = pippy_name if detect_layout(saved) == TORCHTITAN else str
        stateless = stateless_keys(wanted, saved) if metadata is not None else ()
        if stateless:  # not loaded: dropped from DCP's view and the caller's dict
            for name, parent, key in list(leaf_places(state_dict)):
                if name in stateless:
                    del parent[key]
            for key in stateless:
                del self.state_dict[key]

    def _optim_section(self, key: str) -> str | None:
        """The optimizer section of a dotted key (``state``, ...), or None."""
        if self._parser is None:
            saved = self.metadata.state_dict_metadata if self.metadata else {}
            self._parser = OptimKeys.of_keys([*self.state_dict, *saved])
        parsed = self._parser.split(key)
        return None if parsed is None else parsed[1]

    def create_local_plan(self) -> LoadPlan:
        """Checks every requested key (present, shape, dtype), then plans."""
        saved = self.metadata.state_dict_metadata if self.metadata else {}
        problems: dict[str, str] = {}  # key: what is wrong with it
        retyped: dict[str, torch.dtype] = {}  # key: its dtype in the checkpoint
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
                    retyped[key] = item.properties.dtype
        if problems:
            shown = listed(list(problems.values()), 6, "; ", str)
            raise CheckpointError(
                f"{self._mismatch(problems, saved, retyped)} ({len(problems)} "
                f"problem(s): {shown})"
            )
        plan = super().create_local_plan()
        # The keys this rank reads, for the coordinator's check that every key
        # is read: the same str objects as the items' (pickle sends each once).
        return dataclasses.replace(
            plan, planner_data=[item.storage_index.fqn for item in plan.items]
        )

    def _in_model(self, keys: Any) -> bool:
        """Whether some of the keys are the model's or the optimizer's."""
        return any(_section(self.layout_name(k)) in ("model.", "optim.") for k in keys)

    def _mismatch(
        self, problems: dict[str, str], saved: Any, retyped: dict[str, torch.dtype]
    ) -> str:
        """Why :meth:`create_local_plan` refuses (a :data:`_MISMATCH`), and the fix."""
        name = self.layout_name
        sections = sorted({_section(name(k)) for k in problems})
        packed = any(k.startswith("optim.scalars.") for k in self.state_dict)
        unpacked = packed and any(k.startswith("optim.param_groups.") for k in saved)
        causes = {
            "dtype": len(retyped) == len(problems),
            "unpacked": unpacked,
            "optim state": all(self._optim_section(k) == "state" for k in problems),
            "optim": sections == ["optim."],
            "lr_scheduler": all(
                re.search(r"(^|\.)lr_scheduler\.", k) for k in problems
            ),
            "model": self._in_model(problems),
            "sections": any(k in saved for k in problems),
            "lacking": True,
        }
        cause = next(cause for cause, applies in causes.items() if applies)
        elsewhere = [  # where the missing keys are, if under another section
            repr(key)
            for key in (saved if cause == "lacking" else ())
            if any(name(key).endswith(f".{name(k)}") for k in problems)
        ]
        instead = f" (it holds {', '.join(elsewhere[:3])} instead)" * bool(elsewhere)
        dtypes = ", ".join(sorted({str(d) for d in retyped.values()}))
        return _MISMATCH[cause].format(
            dtypes=dtypes, sections=_quoted(sections), instead=instead
        )

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """DCP's global plan, after checking that no required key is left unread."""
        global_plan = super().create_global_plan(global_plan)
        saved = self.metadata.state_dict_metadata if self.metadata else {}
        unread = (  # every key, the default: set-level work, not a loop in Python
            set(saved)
            if self.must_read == ("",)
            else {key for key in saved if key.startswith(self.must_read)}
        )
        for plan in global_plan:  # until all are read: one plan per stage, often
            if not unread:
                return global_plan
            unread.difference_update(_keys_read(plan))
        unread = {key for key in unread if not _empty(saved[key])}
        if not unread:
            return global_plan
        read = {key for plan in global_plan for key in _keys_read(plan)}
        keys = sorted(unread)
        raise CheckpointError(
            f"{len(keys)} key(s) of the checkpoint are read by no rank and would be "
            f"dropped ({listed(keys, 8)}): "
            f"{self._why_unread(keys, read)}"
        )

    def _why_unread(self, unread: list[str], read: set[str]) -> str:
        """Why the checkpoint's keys that no rank reads are unread: :data:`_UNREAD`."""
        name = self.layout_name
        sections = {_section(name(k)) for k in unread} - {"model.", "optim."}
        extra = sorted(sections - {"lr_scheduler.", "step"})
        own = sorted(sections & {"lr_scheduler.", "step"})
        # This state's sections as a must_read: pippy's own first, then the extras.
        pippys = ("model.", "optim.", "lr_scheduler.", "step")
        have = {_section(name(k)) for k in self.state_dict}
        ours = tuple(s for s in pippys if s in have) + tuple(sorted(have - {*pippys}))
        others = [k for k in unread if self._optim_section(k) != "state"]

        def modules(keys: Any) -> set[str]:  # the top-level modules model keys name
            model = (name(k) for k in keys if name(k).startswith("model."))
            return {k.removeprefix("model.").split(".")[0] for k in model}

        mine = modules(read)
        theirs = sorted(modules(others) - mine) if mine else []  # modules it lacks
        causes = {  # the model's first: its keys' optimizer state is unread too
            "module": self._in_model(others) and theirs,
            "split": self._in_model(others) and not theirs,
            "extra": extra,
            "own": own,
            "optim state": len(others) < len(unread),
        }
        it, each = ("it", "that") if len(extra) == 1 else ("them", "each")
        fields = dict(
            extra=_quoted(extra),
            own=_quoted(own),
            it=it,
            each=each,
            ours=ours,
            which="some are" if others else "they are",
            missing=" or ".join(map(repr, theirs)),
            present=", ".join(sorted(mine)),
        )
        why = (_UNREAD[cause] for cause, applies in causes.items() if applies)
        return "; ".join(text.format(**fields) for text in why)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickles a non-tensor item once (weights_only unless trusted), in place."""
        fqn = read_item.dest_index.fqn
        try:
            item = restricted_load(value, self.trusted)
        except pickle.UnpicklingError as e:
            if self.trusted:
                raise
            storage = self.metadata.storage_data if self.metadata else {}
            info = storage.get(read_item.storage_index)
            where = getattr(info, "relative_path", "its data file")
            what = f"item {fqn!r} of {where}"
            match = re.search(r"GLOBAL ([\w.]+)", str(e))
            if match is None:  # not a refused global: the bytes are damaged
                raise CheckpointError(f"{what} is damaged: {e}") from None
            allow = ""
            if self._optim_section(fqn) == "scalars":  # a param group's option
                module, _, name = match[1].rpartition(".")
                allow = (
                    f", or, if {name} is a class of yours that a param group holds "
                    "(a dataclass option, say) and you trust it, allow that class "
                    "alone, before loading: torch.serialization.add_safe_globals("
                    f"[{name}]) ({name} of {module})"
                )
            raise refusal(what, match[1], allow) from None
        if not self.flatten_state_dict:  # where DefaultLoadPlanner.load_bytes puts it
            self.state_dict[fqn] = item
            return
        *path, last = self.mappings[fqn]
        parent: Any = self.original_state_dict  # dicts and lists along the path
        for key in path:
            parent = parent[key]
        parent[last] = item
