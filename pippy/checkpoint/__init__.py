"""Stage-aware distributed checkpointing for pipeline parallelism.

Every rank of a pipeline holds one stage, or several (interleaved schedules),
maybe replicated or sharded over data-parallel ranks. To checkpoint, every rank
calls ``torch.distributed.checkpoint.save`` on the same ``checkpoint_id`` at
the same time: each writes its own data file and the coordinator writes
``.metadata``. That works only if each stage's ``state_dict`` keys are the
un-split model's FQNs for exactly the parameters the stage owns, so that the
union over ranks is the whole model and no key is offered by two ranks.

This package exports what a training job needs: :class:`StageState`;
:func:`save_stage`, :func:`load_stage` and :func:`find_latest_step`; the
pieces those two are made of, for a script that spells ``dcp.save`` and
``dcp.load`` out::

    state_dict, step, planner = take_state(state)  # checked in DCP's planning
    with publish_step(checkpoint_dir, step) as writer:  # published once complete
        dcp.save(state_dict, storage_writer=writer, planner=planner)

    with load_into(state, path) as state_dict:  # applied on every rank or none
        reader, planner = open_step(path)  # checked on rank 0 before any read
        dcp.load(state_dict, storage_reader=reader, planner=planner)

:class:`AsyncSaver`; :class:`FolderOwner`, :class:`StopSignal`,
:func:`stop_with_launcher` and :func:`fail_together` (a step each rank runs
alone fails on every rank or on none); :func:`verify_step`; and the errors.
The offline tools (one process) are in :mod:`pippy.checkpoint.offline`.
The gears stay importable from their modules, one idea per module:

* :mod:`~pippy.checkpoint.api`: the one save sequence and the one load
  sequence (:func:`save_stage`, :func:`load_stage`), and their pieces: the
  load's (:func:`open_step`, :func:`load_into`) and the save's
  (:func:`take_state`, its state taken on each rank and checked across ranks
  in DCP's planning; :func:`publish_step`, its step staged and published by
  :class:`~pippy.checkpoint.api.StepWriter` inside ``dcp.save``).
* :mod:`~pippy.checkpoint.storage`: the storage seam; every path and file
  operation, on POSIX folders (durable: fsync before and after each
  publishing rename) and fsspec URLs (object stores: a step committed by its
  manifest).
* :mod:`~pippy.checkpoint.safe_load`: the load side. Which rank answers
  which question about the checkpoint folder (rank 0, for all: which step,
  is it complete, who owns the folder, what to delete); the step to resume
  from (the newest complete one, or on request the newest that verifies,
  damaged ones moved aside) and its reader, made so; the reader and load
  planner that load without running code a checkpoint's pickles could carry.
* :mod:`~pippy.checkpoint.steps`:
  step folders (``<checkpoint_dir>/step-<N>``), staged and published once
  complete (renamed whole, or committed by their manifest on an object
  store); the newest complete step; retention; a step's ``manifest.json``
  (a checksum of every item written), its ``.metadata`` checked, and which
  torch and pippy wrote it.
* :mod:`~pippy.checkpoint.state`: a rank's stage(s) as one state_dict;
  the one owner of the optimizer-state key grammar.
* :mod:`~pippy.checkpoint.checks`:
  ``check_keys`` across ranks before a save (DCP would silently keep one copy
  of a colliding key, and mix diverged data-parallel replicas); tied
  weights, traced buffers, sizes.
* :mod:`~pippy.checkpoint.offline`: a checkpoint in one process; torchtitan's
  layout; a Hugging Face folder.
* :mod:`~pippy.checkpoint.job` and
  :mod:`~pippy.checkpoint.async_saver`: one writer per folder (on an object
  store, a lease), a last save on preemption within the launcher's deadline;
  background saves.
* :mod:`~pippy.checkpoint.stall`: a rank slow or stuck in a save or load;
  once a wait lasts, the others log how far it is, and with a
  ``timeout`` all raise :class:`~pippy.checkpoint.errors.CheckpointTimeout`
  (a ``CheckpointError`` and a ``TimeoutError``) naming it.
* :mod:`~pippy.checkpoint.errors`: the error classes; ``explain_failures`` and
  ``fail_together``, one error per failure on any rank.
"""

from pippy.checkpoint.api import (
    load_into,
    load_stage,
    open_step,
    publish_step,
    save_stage,
    take_state,
)
from pippy.checkpoint.async_saver import AsyncSaver
from pippy.checkpoint.errors import (
    CheckpointDirError,
    CheckpointDirInUseError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeout,
    DivergedReplicasError,
    KeyCollisionError,
    NestedStateError,
    TiedParametersError,
    UnsafeCheckpointError,
    fail_together,
)
from pippy.checkpoint.job import FolderOwner, StopSignal, stop_with_launcher
from pippy.checkpoint.safe_load import find_latest_step, verify_step
from pippy.checkpoint.state import StageState

__all__ = [
    "AsyncSaver",
    "CheckpointDirError",
    "CheckpointDirInUseError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointTimeout",
    "DivergedReplicasError",
    "FolderOwner",
    "KeyCollisionError",
    "NestedStateError",
    "StageState",
    "StopSignal",
    "TiedParametersError",
    "UnsafeCheckpointError",
    "fail_together",
    "find_latest_step",
    "load_into",
    "load_stage",
    "open_step",
    "publish_step",
    "save_stage",
    "stop_with_launcher",
    "take_state",
    "verify_step",
]
