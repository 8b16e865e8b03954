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

Private torch names pippy relies on, each checked on torch 2.10, 2.13 and
2.15 by the suite (test/test_golden.py reads steps those versions wrote):
``torch.distributed.checkpoint.state_dict._get_fqns`` (optimizer keys by
FQN), ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
(a shard's place, for the replica check),
``torch.distributed.checkpoint._fsspec_filesystem.FileSystem`` (URL reads),
``torch.distributed.distributed_c10d._get_default_store`` (the store that
:mod:`~pippy.checkpoint.stall` waits on; checked on torch 2.13 only, by
test/test_stall.py, which fails if it is gone or not shared by the ranks),
and ``torch.serialization.set_crc32_options`` being per thread (a
ContextVar in torch 2.13; the manifest tests check a ``torch.save`` elsewhere
keeps its CRC-32).
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
