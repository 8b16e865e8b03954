"""Which torch and pippy wrote a step, and reading what another torch wrote.

Every manifest records the torch and pippy versions that wrote the step
(:func:`written_by`). Users of one cluster read a checkpoint with a torch older
or newer than the one that wrote it (inference boxes, evaluation jobs, a
rollback), and DCP's ``.metadata`` is a pickle of torch's own classes, whose
fields change between releases:

* torch 2.15 adds ``strides`` to ``TensorProperties``: its ``__getstate__``
  gives 6 fields, and torch 2.10 to 2.14's ``__setstate__`` unpacks exactly 5
  (``ValueError: too many values to unpack``). :class:`CompatTensorProperties`
  takes the fields the running torch knows and drops the rest: the tensor's
  bytes are a ``torch.save`` record of its own, strides included, and the
  tensor they are loaded into is the caller's.

A ``.metadata`` that still cannot be read is refused by
:func:`newer_torch_refusal` with the versions named, where the manifest says
a newer torch wrote it, instead of being called damaged.

Private torch names pippy relies on, each with a test in
test/test_torch_internals.py, and checked on torch 2.10, 2.11, 2.12, 2.13,
2.14 and 2.15 (test/golden/version_matrix.py runs that file under each):

* ``torch.distributed.checkpoint.state_dict._get_fqns`` (optimizer keys by
  FQN, :mod:`~pippy.checkpoint.optim_layout`);
* ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
  (a shard's place, for the replica check in
  :mod:`~pippy.checkpoint.collisions`);
* ``torch.distributed.checkpoint._fsspec_filesystem.FileSystem`` (URL reads
  and writes, :mod:`~pippy.checkpoint.storage.url`);
* in ``.metadata``, the globals the safe reader allows
  (:mod:`~pippy.checkpoint.safe_load`): ``filesystem._StorageInfo``,
  ``metadata._MEM_FORMAT_ENCODING``, ``torch.serialization._get_layout``,
  and no others than those listed there; ``_StorageInfo``'s
  ``relative_path``, ``offset`` and ``length``, which the manifest reads;
* ``FileSystemWriter`` and ``FileSystemReader``'s ``fs`` and ``path`` fields,
  which pippy's writer and reader replace, and the writer's ``sync_files``;
* the text of ``torch.load(weights_only=True)``'s refusal, ``GLOBAL
  module.name``, which the load planner parses to name the global;
* ``torch.serialization.set_crc32_options`` being per thread from torch
  2.12 on (``storage.CRC32_PER_THREAD``; on 2.10 and 2.11 it is one setting
  per process, so ``no_crc32`` leaves it on there);
* ``torch.distributed.distributed_c10d._get_default_store`` (the default
  group's key-value store, which :mod:`~pippy.checkpoint.stall` waits on:
  there is no public getter);
* ``DefaultLoadPlanner.original_state_dict`` (undocumented), the dict
  ``dcp.load`` fills, filled when the reader's ``read_data`` returns, where
  :func:`~pippy.checkpoint.safe_load.after_reads` applies it;
* an LR scheduler's ``_last_lr`` list in its state (compared per group);
* ``nn.Module``'s ``_parameters``, ``_buffers``, ``_modules``,
  ``_non_persistent_buffers_set``, ``_state_dict_hooks`` and
  ``_state_dict_pre_hooks`` (stage merging, meta builds, buffer checks).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.torch_version import TorchVersion

from pippy.checkpoint.errors import CheckpointError

__all__ = ["CompatTensorProperties", "newer_torch_refusal", "written_by"]

# How many fields this torch's TensorProperties pickles.
_FIELDS = len(TensorProperties().__getstate__())


class CompatTensorProperties(TensorProperties):
    """DCP's ``TensorProperties``, also read from a newer torch's longer state."""

    def __setstate__(self, state: Any) -> None:
        """Takes the fields this torch knows; drops those a newer torch added."""
        if isinstance(state, tuple) and len(state) > _FIELDS:
            state = state[:_FIELDS]
        super().__setstate__(state)


def written_by() -> dict[str, str]:
    """The versions that write a step now: ``{"torch": ..., "pippy": ...}``."""
    try:
        pippy = importlib.metadata.version("pippy")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        pippy = "unknown"
    return {"torch": str(torch.__version__), "pippy": pippy}


def newer_torch_refusal(
    metadata_file: str, writer: object, error: Exception
) -> CheckpointError | None:
    """The error for a ``.metadata`` a newer torch wrote and this one cannot read.

    Args:
        metadata_file: The file, for the message.
        writer: The torch version the step's manifest records (None if none).
        error: What unpickling raised.

    Returns:
        The error naming both versions and the fix, or None when the manifest
        does not say a newer torch wrote it (then the file is damaged).
    """
    if not isinstance(writer, str):
        return None
    try:
        newer = TorchVersion(writer) > TorchVersion(str(torch.__version__))
    except Exception:  # not a version: the manifest is no help here
        return None
    if not newer:
        return None
    return CheckpointError(
        f"{metadata_file} was written by torch {writer}, this is torch "
        f"{torch.__version__}, which cannot read it ({type(error).__name__}: "
        f"{error}). Read it with torch {writer} or newer"
    )
