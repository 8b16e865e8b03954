"""PiPPy: pipeline parallelism for PyTorch.

PiPPy's front end now lives in ``torch.distributed.pipelining``; this package
re-exports it unchanged and adds :mod:`pippy.stages`, building one stage of
any model while keeping its FQNs, and :mod:`pippy.checkpoint`, stage-aware
distributed checkpointing through ``torch.distributed.checkpoint``.
"""

from torch.distributed.pipelining import (
    Pipe,
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    SplitPoint,
    build_stage,
    pipe_split,
    pipeline,
)

from pippy import checkpoint
from pippy.stages import (
    PassThrough,
    StageBuildError,
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
