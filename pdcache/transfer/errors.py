"""Errors the transfer layer raises to the nodes."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A room's KV transfer failed; `reason` says why (abort, peer lost, engine, ...)."""

    def __init__(self, room: int, reason: str, code: str = "") -> None:
        super().__init__(f"room {room}: {reason}")
        self.room = room
        self.reason = reason
        self.code = code  # one of rooms.FAILURE_CODES when known


class TransferTimeout(TransferError):
    """A room did not complete before its deadline."""
