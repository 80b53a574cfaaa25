"""Iteration-level schedulers (docs/architecture.md §3): policy objects returning plain batch dataclasses."""

from chariot.worker.scheduler.base import Scheduler, SchedulerConfig
from chariot.worker.scheduler.output import ScheduledChunk, SchedulerOutput
from chariot.worker.scheduler.policies import POLICY_CLASSES, make_scheduler

__all__ = ["POLICY_CLASSES", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "make_scheduler"]
