"""PiPPy: pipeline parallelism for PyTorch.

PiPPy's front end now lives in ``torch.distributed.pipelining``; this package
re-exports it unchanged and adds :mod:`pippy.stages`, building one stage of
any model while keeping its FQNs, and :mod:`pippy.checkpoint`, stage-aware
distributed checkpointing through ``torch.distributed.checkpoint``.
"""

import importlib
from typing import Any

from pippy import checkpoint
from pippy.stages import (
    PassThrough,
    StageBuildError,
    TiedParametersError,
    build_stage_module,
    causal_lm_forward,
    check_untied,
    layer_range,
    materialize,
    meta_init,
    restore_non_persistent_buffers,
    split_model,
)

__all__ = [
    "PassThrough",
    "Pipe",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "SplitPoint",
    "StageBuildError",
    "TiedParametersError",
    "build_stage",
    "build_stage_module",
    "causal_lm_forward",
    "check_untied",
    "checkpoint",
    "layer_range",
    "materialize",
    "meta_init",
    "pipe_split",
    "pipeline",
    "restore_non_persistent_buffers",
    "split_model",
]

#: What pippy re-exports from torch.distributed.pipelining (the names of __all__
#: not bound above), imported on first use: it brings in torch's compiler stack
#: (about a second per process), which a process that only checkpoints (the CLI,
#: a rank that saves) never needs.
_PIPELINING = {name for name in __all__ if name not in globals()}


def __getattr__(name: str) -> Any:
    """torch.distributed.pipelining's names, imported when first asked for."""
    if name in _PIPELINING:
        value = getattr(importlib.import_module("torch.distributed.pipelining"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pippy' has no attribute {name!r}")
