"""One stalled decode (SIGSTOP mid-transfer) holds up only its own rooms: another decode's
room on the same prefill completes as fast as before. Mooncake's completion call blocks until
its batch ends or MC_TRANSFER_TIMEOUT; a process-wide lock around it made every transfer of
the prefill node wait behind the stalled one."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from pdcache.transfer.messages import PrefillReport
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.rooms import RoomState
from pdcache.transfer.sender import KVSender
from tests.transfer_support import (
    engine_params,
    fast_config,
    scaled_limit,
    spawn_child,
    wait_until,
)

pytestmark = pytest.mark.slow

STALL_TIMEOUT_S = 30  # MC_TRANSFER_TIMEOUT: how long the stalled room's status call blocks
PAGES = 32  # [4, 2, 32, 64, 8, 128] float32: 64 MiB, more than the sockets buffer
STALLED_ROOM, HEALTHY_ROOMS = 1, (2, 3)


def _config(engine: str):
    return fast_config(engine, room_timeout_s=float(STALL_TIMEOUT_S))


def _pool(seed: int | None, pages: int = PAGES) -> torch.Tensor:
    shape = (4, 2, pages, 64, 8, 128)
    return torch.zeros(shape) if seed is None else torch.full(shape, float(seed))


def _stalling_decode(engine: str, addr: str, conn) -> None:
    """Child: a decode that asks for the big room, then is stopped by the parent."""
    receiver = KVReceiver(_config(engine), _pool(None)).start()
    try:
        receiver.request(STALLED_ROOM, addr, np.arange(PAGES), num_tokens=PAGES * 64)
        conn.send("requested")
        time.sleep(120)  # stopped, then killed by the parent
    finally:
        receiver.close()




def _healthy_room(sender: KVSender, receiver: KVReceiver, room: int) -> float:
    """One small room to the healthy decode; its seconds from request to KV."""
    start = time.monotonic()
    receiver.request(room, sender.bootstrap_addr, [0, 1], num_tokens=100)
    wait_until(lambda: sender.rooms.get(room) is not None, 10.0, "the healthy request")
    assert sender.send(room, [0, 1], PrefillReport(room))
    assert receiver.wait(room, float(STALL_TIMEOUT_S)).first_token == room
    return time.monotonic() - start


@pytest.mark.parametrize("engine", engine_params(("mooncake", "zmq")))
def test_a_stalled_decode_does_not_hold_up_another_decode_s_room(engine, monkeypatch) -> None:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", str(STALL_TIMEOUT_S))  # read per engine
    sender = KVSender(_config(engine), _pool(1)).start()
    healthy = KVReceiver(_config(engine), _pool(None, 8)).start()
    proc, conn = spawn_child(_stalling_decode, engine, sender.bootstrap_addr)
    try:
        healthy.connect(sender.bootstrap_addr)
        baseline_s = _healthy_room(sender, healthy, HEALTHY_ROOMS[0])
        assert conn.poll(60.0) and conn.recv() == "requested"
        wait_until(lambda: sender.rooms.get(STALLED_ROOM) is not None, 10.0, "the big request")
        os.kill(proc.pid, signal.SIGSTOP)
        assert sender.send(STALLED_ROOM, np.arange(PAGES), PrefillReport(1))
        wait_until(lambda: sender.poll(STALLED_ROOM) is RoomState.TRANSFERRING, 5.0,
                   "the stalled transfer to start")
        time.sleep(0.3)  # its worker is inside the engine's wait now (bounded: nothing to poll)

        took_s = _healthy_room(sender, healthy, HEALTHY_ROOMS[1])
        bound_s = min(scaled_limit(max(1.0, 20 * baseline_s)), STALL_TIMEOUT_S / 3)
        assert took_s < bound_s, (f"the healthy room took {took_s:.2f}s (alone: "
                                  f"{baseline_s:.3f}s) behind the stalled decode")
        assert sender.poll(STALLED_ROOM) is RoomState.TRANSFERRING  # still stalled
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        healthy.close()
        sender.close()
