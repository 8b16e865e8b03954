"""Stage-aware distributed checkpointing for pipeline parallelism.

Every rank of a pipeline holds one stage, or several (interleaved schedules),
maybe replicated or sharded over data-parallel ranks. To checkpoint, every rank calls
``torch.distributed.checkpoint.save`` on the same ``checkpoint_id`` at the same
time: each writes its own data file and the coordinator writes ``.metadata``.
That works only if each stage's ``state_dict`` keys are the un-split model's
FQNs for exactly the parameters the stage owns, so that the union over ranks is
the whole model and no key is offered by two ranks. One idea per module:

* :mod:`~pippy.checkpoint.api`: :func:`save_stage` and :func:`load_stage`, the
  one save path and the one load path; :func:`read_checkpoint` and
  :func:`load_model`, a checkpoint in one process, as a flat dict or into the
  un-split model (plain or FSDP2-sharded).
* :mod:`~pippy.checkpoint.stage_state`: :class:`StageState`, the model,
  optimizer (keyed by FQN), LR scheduler, step and any extra ``Stateful`` of
  a rank's stage(s) as one ``state_dict``; :mod:`~pippy.checkpoint.parts`:
  :func:`merge_parts`, several stage modules seen as one.
* :mod:`~pippy.checkpoint.optim_layout`: how optimizer state is keyed, packed
  into few items and parsed.
* :mod:`~pippy.checkpoint.collisions`: :func:`check_keys` across ranks before
  a save (DCP would silently keep one copy of a colliding key, and mix
  diverged data-parallel replicas); :mod:`~pippy.checkpoint.checks`: tied
  weights,
  traced buffers, bitwise state_dict comparison and sizes.
* :mod:`~pippy.checkpoint.steps`: one folder per step
  (``<checkpoint_dir>/step-<N>``), published only once complete; the newest
  complete step; retention.
* :mod:`~pippy.checkpoint.job`: :class:`FolderOwner`, one writer per
  checkpoint folder; :func:`stop_with_launcher`; :class:`StopSignal`, a last
  save on preemption.
* :mod:`~pippy.checkpoint.async_saver`: :class:`AsyncSaver`, saves in the
  background, one at a time.
* :mod:`~pippy.checkpoint.manifest`: :class:`ManifestWriter`, DCP's writer that
  also records a CRC-32C of every item in ``manifest.json``.
* :mod:`~pippy.checkpoint.safe_load` and :mod:`~pippy.checkpoint.load_planner`:
  :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`, loading without
  running code a checkpoint's pickles could carry, verifying content, and
  refusing damaged folders and keys DCP would drop or convert.
* :mod:`~pippy.checkpoint.layouts` and :mod:`~pippy.checkpoint.export`:
  torchtitan's layout, read everywhere and written by :func:`convert_layout`;
  :func:`export_hf`, a folder Hugging Face's ``from_pretrained`` opens.
* :mod:`~pippy.checkpoint.errors`: the error classes; :func:`explain_failures`
  and :func:`fail_together`, one error per failure on any rank.
"""

from pippy.checkpoint.api import load_model, load_stage, read_checkpoint, save_stage
from pippy.checkpoint.async_saver import AsyncSaver
from pippy.checkpoint.checks import (
    check_untied,
    diff_state_dicts,
    named_leaves,
    restore_non_persistent_buffers,
    state_dict_size,
)
from pippy.checkpoint.collisions import check_keys
from pippy.checkpoint.errors import (
    CheckpointDirError,
    CheckpointDirInUseError,
    CheckpointError,
    CheckpointNotFoundError,
    DivergedReplicasError,
    KeyCollisionError,
    NestedStateError,
    TiedParametersError,
    UnsafeCheckpointError,
    explain_failures,
    fail_together,
)
from pippy.checkpoint.export import convert_layout, export_hf
from pippy.checkpoint.job import OWNER_FILE, FolderOwner, StopSignal, stop_with_launcher
from pippy.checkpoint.load_planner import SafeLoadPlanner
from pippy.checkpoint.manifest import MANIFEST_FILE, ManifestWriter, read_manifest
from pippy.checkpoint.parts import merge_parts
from pippy.checkpoint.safe_load import (
    TRUST_ENV,
    SafeFileSystemReader,
    find_damage,
    read_metadata,
    verify_step,
)
from pippy.checkpoint.stage_state import StageState
from pippy.checkpoint.steps import (
    METADATA_FILE,
    check_writable,
    find_latest_step,
    is_complete,
    list_steps,
    parse_step,
    publish_step,
    remove_old_steps,
    step_dir,
)

__all__ = [
    "MANIFEST_FILE",
    "METADATA_FILE",
    "OWNER_FILE",
    "TRUST_ENV",
    "AsyncSaver",
    "CheckpointDirError",
    "CheckpointDirInUseError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "FolderOwner",
    "KeyCollisionError",
    "NestedStateError",
    "ManifestWriter",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "StageState",
    "StopSignal",
    "TiedParametersError",
    "DivergedReplicasError",
    "UnsafeCheckpointError",
    "check_keys",
    "check_untied",
    "check_writable",
    "convert_layout",
    "diff_state_dicts",
    "explain_failures",
    "export_hf",
    "fail_together",
    "find_damage",
    "find_latest_step",
    "is_complete",
    "list_steps",
    "load_model",
    "load_stage",
    "merge_parts",
    "named_leaves",
    "parse_step",
    "publish_step",
    "read_checkpoint",
    "read_manifest",
    "read_metadata",
    "remove_old_steps",
    "restore_non_persistent_buffers",
    "save_stage",
    "state_dict_size",
    "step_dir",
    "stop_with_launcher",
    "verify_step",
]
