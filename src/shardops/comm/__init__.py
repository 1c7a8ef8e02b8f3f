"""Communicators: one protocol, two worlds (threads in this process, torch.distributed)."""
from .base import CommDebugMode, Communicator, Group, REDUCE_OPS

__all__ = ["CommDebugMode", "Communicator", "Group", "REDUCE_OPS"]
