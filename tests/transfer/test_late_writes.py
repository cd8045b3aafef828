"""No byte lands in decode's pages after decode was told it may free them.

The zmq engine cannot recall a batch it queued: libzmq delivers the frames and the target
copies them in. So when decode aborts a room mid-transfer, prefill answers (AbortAck) only
once the batches already on the wire have been acked — decode frees the pages on that answer
(docs/design.md §4.5)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from pdcache.transfer.messages import PrefillReport
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.rooms import Outcome, RoomState
from pdcache.transfer.sender import KVSender
from tests.polling import poll
from tests.transfer_support import fast_config, wait_until

PAGES = 32  # [4, 2, 32, 64, 8, 128] float32: 256 KiB slab pages, 64 MiB per pool
ROOM = 77
TARGET_DELAY_S = 0.2  # per batch, past the sender's 50 ms wait slice: it gives up mid-batch


def _slow_target(receiver: KVReceiver) -> None:
    """Delay every batch the zmq target copies in, so batches queue at the target: the ones
    on the wire when prefill stops are the late writes this test is about."""
    copy_in = receiver.engine._copy_in

    def slow_copy_in(dsts, payload) -> None:
        time.sleep(TARGET_DELAY_S)
        copy_in(dsts, payload)

    receiver.engine._copy_in = slow_copy_in


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_an_aborted_room_s_pages_stay_unchanged_after_decode_released_them(first: str) -> None:
    """`first`: who gives up mid-transfer. "prefill": prefill aborts (its worker then drains
    the batches on the wire) and decode's own Abort arrives meanwhile, which prefill answers
    only at the release, never while the room's writes may still land."""
    shape = (4, 2, PAGES, 64, 8, 128)
    src, dst = torch.ones(shape), torch.zeros(shape)
    # 8 MiB batches of single pages (the reversed destination does not coalesce): 8 batches
    config = fast_config("zmq", room_timeout_s=30.0, max_batch_bytes=8 << 20)
    released: list[Outcome] = []
    sum_at_release: list[float] = []
    done = threading.Event()

    def on_release(outcome: Outcome) -> None:  # decode's control thread: the node frees here
        sum_at_release.append(float(dst.sum()))
        released.append(outcome)
        done.set()

    sender = KVSender(config, src).start()
    receiver = KVReceiver(config, dst, on_release=on_release).start()
    _slow_target(receiver)
    try:
        receiver.connect(sender.bootstrap_addr)
        receiver.request(ROOM, sender.bootstrap_addr, np.arange(PAGES)[::-1],
                         num_tokens=PAGES * 64)
        wait_until(lambda: sender.rooms.get(ROOM) is not None, 5.0, "decode's request")
        assert sender.send(ROOM, np.arange(PAGES), PrefillReport(5))
        wait_until(lambda: receiver.poll(ROOM) is RoomState.TRANSFERRING, 5.0,
                   "the transfer to start", interval_s=0.0005)
        if first == "prefill":
            sender.abort(ROOM, "prefill gave up")
            wait_until(lambda: sender.rooms.get(ROOM) is None
                       or sender.rooms.get(ROOM).state is RoomState.FAILED, 5.0,
                       "prefill's abort", interval_s=0.0005)
        receiver.abort(ROOM, "client gone")
        wait_until(done.is_set, 10.0, "decode's release of the aborted room")

        assert [(o.room_id, o.state, o.code) for o in released] == [
            (ROOM, RoomState.FAILED, "aborted")]
        assert receiver.stats()["abort_ack_timeouts"] == 0  # released on prefill's answer
        assert sum_at_release[0] < float(src.sum()), "the abort came after the whole transfer"
        # nothing lands after the release (a late batch took ~TARGET_DELAY_S)
        assert not poll(lambda: float(dst.sum()) != sum_at_release[0], 1.0), (
            f"{float(dst.sum()) - sum_at_release[0]:.0f} more bytes of ones landed after the "
            "release")
        assert sender.stats()["unsettled_rooms"] == 0  # every write ended before the answer
    finally:
        receiver.close()
        sender.close()
