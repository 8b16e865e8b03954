"""PiPPy: pipeline parallelism for PyTorch.

PiPPy's front end now lives in ``torch.distributed.pipelining``; this package
re-exports it unchanged and adds :mod:`pippy.checkpoint`, stage-aware
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

__all__ = [
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
    "build_stage",
    "checkpoint",
    "pipe_split",
    "pipeline",
]
