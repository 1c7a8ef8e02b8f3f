"""Communicators: one protocol, two worlds (threads in this process, torch.distributed)."""

from .base import REDUCE_OPS, CommDebugMode, Communicator, Group

__all__ = ["CommDebugMode", "Communicator", "Group", "REDUCE_OPS"]
