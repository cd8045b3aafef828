"""Prefill → decode KV transfer: ZeroMQ control plane, room state machines, data engines.

Prefill nodes use `KVSender`, decode nodes `KVReceiver`; both take one frozen
`TransferConfig`. See docs/design.md §4.5 and the module docstrings for the protocol.
"""

from __future__ import annotations

from pdcache.transfer.config import TransferConfig
from pdcache.transfer.delivery import MarksDelivery
from pdcache.transfer.errors import TransferError, TransferTimeout
from pdcache.transfer.messages import PrefillReport
from pdcache.transfer.receiver import KVReceiver, TransferResult
from pdcache.transfer.rooms import FAILURE_CODES, Outcome, RoomState
from pdcache.transfer.sender import KVSender

__all__ = ["FAILURE_CODES", "KVReceiver", "KVSender", "MarksDelivery", "Outcome",
           "PrefillReport", "RoomState", "TransferConfig", "TransferError",
           "TransferResult", "TransferTimeout"]
