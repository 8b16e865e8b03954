"""Stage-aware distributed checkpointing for pipeline parallelism.

Every rank saves its stage(s) with ``dcp.save`` on the same ``checkpoint_id``
at once; this works only if each stage's keys are the un-split model's FQNs of
exactly the parameters it owns, so that no key is offered by two ranks.
:func:`save_stage` and :func:`load_stage` are a whole save and load of a
:class:`StageState` (:func:`find_latest_step` picks the step); a script that
spells ``dcp.save`` and ``dcp.load`` out uses their pieces::

    state_dict, step, planner = take_state(state)  # checked in DCP's planning
    with publish_step(checkpoint_dir, step) as writer:  # published once complete
        dcp.save(state_dict, storage_writer=writer, planner=planner)

    # the step checked on rank 0 before any read; if one rank fails, all raise
    with load_into(state, path) as (state_dict, reader, planner):
        dcp.load(state_dict, storage_reader=reader, planner=planner)

They are DCP's plug-ins, public by name for a script that builds them itself::

    dcp.save(state_dict, storage_writer=StepWriter(checkpoint_dir, step),
             planner=CheckedSavePlanner(mesh=mesh, step=step))
    dcp.load(state_dict, storage_reader=SafeFileSystemReader(path),
             planner=SafeLoadPlanner())

(without the pieces' watch for stalled ranks, ``timeout``, and one error
for a failure on any rank). Also exported: :class:`AsyncSaver`,
:func:`fail_together` and the errors; the offline tools ``python -m pippy``
runs on are :mod:`pippy.checkpoint.offline`'s public names (``inspect_step``,
``inspect_steps``, ``export_weights``, ``export_hf``, ``convert_layout``, ...).
The modules, one idea each:

* ``async_saver``: background saves.
* ``checks``: ``check_keys`` across ranks before a save (DCP would keep one copy
  of a colliding key, mixing diverged replicas); tied weights, traced buffers.
* ``collectives``: pippy's own gloo group; one outcome for every rank; a rank
  slow or stuck in a save or load, logged, and with a ``timeout``
  ``CheckpointTimeout`` on every rank.
* ``errors``: the error classes; one error per failure on any rank.
* ``hf``: start from a Hugging Face folder, each rank reading its own tensors.
* ``job``: the job guards: one writer per folder (``FolderOwner``); no save
  once the launcher is gone; a last save on preemption within the launcher's
  deadline (``StopSignal``, ``stop_with_launcher``).
* ``keys``: optimizer state keyed by parameter FQN; torchtitan's names for
  pippy's keys, and back.
* ``load``: the step to resume from (``find_latest_step``, rank 0 answering
  for all); the load sequence (``load_stage``) and its pieces.
* ``manifest``: checksums: each item's CRC-32C taken as it is written, kept in
  ``manifest.json``, checked as it is read.
* ``offline``: tools in one process: inspect, read, export (to one file or
  Hugging Face), convert to or from torchtitan's layout, verify a step.
* ``owner``: ``FolderOwner``, its record on a folder, a lease on an object store.
* ``reader``: a step's ``.metadata`` and items read with no code a pickle
  could carry run, each item checked against its checksum; rank 0 opens it.
* ``safe_load``: ``SafeLoadPlanner``: every key read, nothing converted
  silently; what a load may unpickle.
* ``save``: the save sequence (``save_stage``) and its pieces, DCP's plug-ins.
* ``state``: a rank's stage(s) as one state_dict.
* ``steps``: step folders (``step-<N>``), complete or not; the newest complete
  step; retention; ``.metadata`` checked against its folder.
* ``storage``: POSIX folders (fsync around each publishing rename) and fsspec
  URLs (a step committed by its manifest) behind one seam.
"""

from pippy.checkpoint.async_saver import AsyncSaver
from pippy.checkpoint.collectives import fail_together
from pippy.checkpoint.errors import (
    CheckpointDirError,
    CheckpointDirInUseError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeout,
    DivergedReplicasError,
    KeyCollisionError,
    NestedStateError,
    UnsafeCheckpointError,
)
from pippy.checkpoint.hf import StageReader, load_hf_stage
from pippy.checkpoint.load import find_latest_step, load_into, load_stage, open_step
from pippy.checkpoint.reader import SafeFileSystemReader
from pippy.checkpoint.safe_load import SafeLoadPlanner
from pippy.checkpoint.save import (
    CheckedSavePlanner,
    StepWriter,
    publish_step,
    save_stage,
    take_state,
)
from pippy.checkpoint.state import StageState

__all__ = [
    "AsyncSaver",
    "CheckedSavePlanner",
    "CheckpointDirError",
    "CheckpointDirInUseError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointTimeout",
    "DivergedReplicasError",
    "KeyCollisionError",
    "NestedStateError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "StageReader",
    "StageState",
    "StepWriter",
    "UnsafeCheckpointError",
    "fail_together",
    "find_latest_step",
    "load_hf_stage",
    "load_into",
    "load_stage",
    "open_step",
    "publish_step",
    "save_stage",
    "take_state",
]
