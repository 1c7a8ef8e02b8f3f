"""Pipeline parallelism with torch.distributed.pipelining's names: a model split by depth into
`PipelineStage`s, run over micro-batches by a schedule, in both worlds (docs/pipelining.md)."""

from .explain import PipelineExplanation, Transfer
from .schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from .stage import PipelineStage

__all__ = [
    "PipelineExplanation",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "Transfer",
    "get_schedule_class",
]
