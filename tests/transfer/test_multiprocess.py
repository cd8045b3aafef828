"""Prefill and decode in different processes (memory truly remote): byte-exact KV, and
kill -9 of either side in the middle of a transfer."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import numpy as np
import pytest
import torch

from pdcache.transfer.errors import TransferError
from pdcache.transfer.messages import PrefillReport
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.rooms import Outcome, RoomState
from pdcache.transfer.sender import KVSender
from tests.transfer_support import engine_params, fast_config, spawn_child, wait_until

pytestmark = pytest.mark.slow

PAGES = 512  # [4, 2, 512, 16, 8, 64] float32: 32 KiB pages, 128 MiB per pool
SMALL_ROOM, BIG_ROOM = 11, 12
BIG_PAGES = 480  # 120 MiB in 0.5 MiB engine batches, throttled by _slow_link


def _pool(seed: int | None) -> torch.Tensor:
    shape = (4, 2, PAGES, 16, 8, 64)
    if seed is None:
        return torch.zeros(shape)
    return torch.empty(shape).uniform_(generator=torch.Generator().manual_seed(seed))


def _digest(pool: torch.Tensor, pages) -> str:
    return hashlib.sha256(pool[:, :, list(pages)].contiguous().numpy().tobytes()).hexdigest()


def _slow_link(sender: KVSender, per_batch_s: float = 0.02) -> KVSender:
    """Delay each engine batch: the big room's write then lasts ~5 s on any machine, so
    the kill lands mid-transfer (unthrottled, 120 MiB over loopback ends in ~80 ms, less
    than a loaded CI machine can stall the test between its poll and its kill)."""
    submit = sender.engine.submit

    def slow_submit(peer, batch):
        time.sleep(per_batch_s)
        return submit(peer, batch)

    sender.engine.submit = slow_submit
    return sender


def _config(engine: str):
    return fast_config(engine, max_batch_bytes=512 << 10, room_timeout_s=20.0,
                       lost_peer_hold_s=3.0)


def _decode_main(engine: str, addr: str, conn) -> None:
    """Child: a decode node. Small room → report the digest; then ask for the big room."""
    pool = _pool(None)
    receiver = KVReceiver(_config(engine), pool).start()
    try:
        rng = np.random.default_rng(5)
        small = rng.choice(PAGES, 17, replace=False)
        receiver.request(SMALL_ROOM, addr, small, num_tokens=17 * 16)
        result = receiver.wait(SMALL_ROOM, 20.0)
        conn.send((small.tolist(), _digest(pool, small), result.first_token))
        receiver.request(BIG_ROOM, addr, rng.permutation(PAGES)[:BIG_PAGES], BIG_PAGES * 16)
        conn.send("requested")
        time.sleep(60)  # killed by the parent
    finally:
        receiver.close()


def _prefill_main(engine: str, conn) -> None:
    """Child: a prefill node that sends whatever room the parent names."""
    sender = _slow_link(KVSender(_config(engine), _pool(9)).start())
    try:
        conn.send(sender.bootstrap_addr)
        while True:
            room, pages = conn.recv()
            sender.send(room, pages, PrefillReport(99))
    finally:
        sender.close()




def _recv(conn, timeout_s: float = 60.0):
    assert conn.poll(timeout_s), "child process did not answer"
    return conn.recv()


def _kill(proc) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


@pytest.mark.parametrize("engine", engine_params(("zmq", "mooncake")))
def test_remote_decode_gets_exact_kv_and_its_death_mid_transfer_fails_the_room(engine) -> None:
    released: list[Outcome] = []
    src = _pool(1)
    sender = _slow_link(KVSender(_config(engine), src, on_release=released.append).start())
    proc, conn = spawn_child(_decode_main, engine, sender.bootstrap_addr)
    try:
        wait_until(lambda: sender.rooms.get(SMALL_ROOM) is not None, 60.0, "decode's request")
        src_small = np.random.default_rng(6).choice(PAGES, 17, replace=False)
        assert sender.send(SMALL_ROOM, src_small, PrefillReport(31))
        _, digest, first_token = _recv(conn)
        assert digest == _digest(src, src_small) and first_token == 31

        assert _recv(conn) == "requested"
        wait_until(lambda: sender.rooms.get(BIG_ROOM) is not None, 10.0, "big request")
        assert sender.send(BIG_ROOM, np.arange(BIG_PAGES), PrefillReport(32))
        wait_until(lambda: sender.poll(BIG_ROOM) is not RoomState.WAITING_FOR_INPUT, 10.0,
                   "transfer start")
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert sender.poll(BIG_ROOM) is RoomState.TRANSFERRING, "transfer ended before kill"

        wait_until(lambda: len(released) == 2, sender.config.peer_dead_after_s + 5.0,
                   "the dead decode's room to be released")
        assert time.monotonic() - killed_at < sender.config.peer_dead_after_s + 5.0
        assert [(o.room_id, o.state) for o in released] == [
            (SMALL_ROOM, RoomState.SUCCESS), (BIG_ROOM, RoomState.FAILED)]
        assert released[1].code in ("engine", "peer_lost")  # whichever noticed first
        stats = sender.stats()
        assert stats["rooms"]["active"] == 0 and stats["rooms"]["busy"] == 0
        wait_until(lambda: sender.stats()["peers"] == 0, 5.0, "the dead peer to be dropped")
    finally:
        _kill(proc)
        sender.close()


@pytest.mark.parametrize("engine", engine_params(("zmq", "mooncake")))
def test_prefill_killed_mid_transfer_makes_wait_raise_within_the_deadline(engine) -> None:
    released: list[Outcome] = []
    dst = _pool(None)
    receiver = KVReceiver(_config(engine), dst, on_release=released.append).start()
    proc, conn = spawn_child(_prefill_main, engine)
    try:
        addr = _recv(conn)
        receiver.connect(addr, timeout_s=30.0)
        receiver.request(BIG_ROOM, addr, np.arange(BIG_PAGES), BIG_PAGES * 16)
        conn.send((BIG_ROOM, list(range(BIG_PAGES))))
        wait_until(lambda: receiver.poll(BIG_ROOM) is RoomState.TRANSFERRING, 20.0,
                   "prefill to start writing")
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TransferError, match="lost") as info:
            receiver.wait(BIG_ROOM, 30.0)
        assert info.value.code == "peer_lost"
        assert time.monotonic() - start < receiver.config.peer_dead_after_s + 2.0
        # the pages stay fenced (a stalled prefill could still write them) until the prefill
        # answers, re-registers with a new boot, closes the connection (a killed process's
        # kernel does) or lost_peer_hold_s
        wait_until(lambda: len(released) == 1, receiver.config.lost_peer_hold_s + 5.0,
                   "decode to release the room")
        assert released[0].state is RoomState.FAILED
        assert receiver.stats()["lost_peer_closed"] == 1
        assert receiver.stats()["rooms"]["active"] == 0
    finally:
        _kill(proc)
        receiver.close()
