"""Room state machine, release semantics, and the page-address arithmetic of transfers."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pdcache.transfer.config import TransferConfig
from pdcache.transfer.layout import KVLayout, WriteBatch, page_copy_batch
from pdcache.transfer.rooms import (
    DuplicateRoom,
    IllegalTransition,
    Outcome,
    RoomState,
    RoomTable,
    UnknownRoom,
)

S = RoomState


def _table(released: list[Outcome]) -> RoomTable:
    return RoomTable("test", keep_finished=4, on_release=released.append)


def test_happy_path_releases_once_with_success() -> None:
    released: list[Outcome] = []
    table = _table(released)
    table.create(1, S.BOOTSTRAPPING, 10.0, data="payload")
    table.advance(1, S.WAITING_FOR_INPUT)
    table.advance(1, S.TRANSFERRING, busy=True)
    assert table.finish(1, S.SUCCESS, busy=False)
    assert [(o.room_id, o.state, o.data) for o in released] == [(1, S.SUCCESS, "payload")]
    assert table.state(1) is S.SUCCESS and table.active_count() == 0
    assert not table.finish(1, S.FAILED, "late")  # terminal stays terminal
    assert len(released) == 1


@pytest.mark.parametrize("path", [
    [S.TRANSFERRING],
    [S.SUCCESS],
    [S.WAITING_FOR_INPUT, S.BOOTSTRAPPING],
    [S.WAITING_FOR_INPUT, S.SUCCESS],
    [S.WAITING_FOR_INPUT, S.WAITING_FOR_INPUT],
])
def test_illegal_transitions_are_rejected_and_counted(path: list[RoomState]) -> None:
    table = _table([])
    table.create(5, S.BOOTSTRAPPING, 10.0)
    with pytest.raises(IllegalTransition):
        for state in path:
            if state.terminal:
                table.finish(5, state)
            else:
                table.advance(5, state)
    assert table.counters["illegal_transitions"] == 1


def test_a_message_crossing_a_local_abort_is_not_an_illegal_transition() -> None:
    """Prefill's Started can reach decode after decode aborted the room (still busy until
    prefill acks): `advance_unless_ended` leaves it failed and counts nothing, where `advance`
    (the receiver's path before) counted an illegal transition; a live room's bad move is
    still refused and counted."""
    table = _table([])
    for room in (1, 2):
        table.create(room, S.WAITING_FOR_INPUT, 10.0)
        table.finish(room, S.FAILED, "client disconnected", busy=True)
    assert table.advance_unless_ended(1, S.TRANSFERRING) is False
    assert table.advance_unless_ended(99, S.TRANSFERRING) is False  # already released
    assert table.state(1) is S.FAILED and table.counters["illegal_transitions"] == 0
    with pytest.raises(IllegalTransition):
        table.advance(2, S.TRANSFERRING)
    assert table.counters["illegal_transitions"] == 1
    table.create(3, S.WAITING_FOR_INPUT, 10.0)
    assert table.advance_unless_ended(3, S.TRANSFERRING) is True
    with pytest.raises(IllegalTransition):
        table.advance_unless_ended(3, S.WAITING_FOR_INPUT)
    assert table.counters["illegal_transitions"] == 2


def test_failed_room_with_engine_in_flight_waits_for_idle() -> None:
    released: list[Outcome] = []
    table = _table(released)
    table.create(2, S.WAITING_FOR_INPUT, 10.0)
    table.advance(2, S.TRANSFERRING, busy=True)
    assert table.finish(2, S.FAILED, "peer lost", code="peer_lost")
    assert released == [] and table.active_count() == 1  # pages still being written
    table.set_idle(2)
    assert [(o.state, o.reason, o.code) for o in released] == [(S.FAILED, "peer lost",
                                                                 "peer_lost")]
    assert table.snapshot()["active"] == 0 and table.counters["failed"] == 1


def test_duplicates_unknowns_tombstones_and_bounded_memory() -> None:
    table = _table([])
    table.create(1, S.BOOTSTRAPPING, 10.0)
    with pytest.raises(DuplicateRoom):
        table.create(1, S.BOOTSTRAPPING, 10.0)
    with pytest.raises(UnknownRoom):
        table.state(99)
    table.tombstone(99, "aborted before it began")
    assert table.state(99) is S.FAILED
    with pytest.raises(DuplicateRoom):
        table.create(99, S.BOOTSTRAPPING, 10.0)
    for room in range(100, 110):
        table.tombstone(room, "x")
    with pytest.raises(UnknownRoom):  # only keep_finished outcomes are remembered
        table.state(99)


def test_callback_errors_are_counted_not_raised() -> None:
    def boom(outcome: Outcome) -> None:
        raise RuntimeError("node bug")

    table = RoomTable("test", 4, boom)
    table.create(1, S.BOOTSTRAPPING, 1.0)
    table.finish(1, S.FAILED, "x")
    assert table.counters["callback_errors"] == 1 and table.active_count() == 0


def test_page_copy_batch_moves_exactly_the_requested_pages() -> None:
    torch.manual_seed(0)
    src = torch.randn(3, 2, 20, 4, 2, 8)
    dst = torch.zeros(3, 2, 30, 4, 2, 8)
    src_pages = np.array([4, 5, 6, 7, 19, 0, 11])
    dst_pages = np.array([10, 11, 12, 13, 2, 29, 3])
    batch = page_copy_batch(KVLayout.from_tensor(src), KVLayout.from_tensor(dst), src_pages,
                            dst_pages)
    assert len(batch) == 3 * 2 * 4  # the run 4..7 → 10..13 coalesces in every layer and K/V
    for part in batch.split(max_entries=5, max_bytes=3000):
        assert len(part) <= 5
        for s, d, n in zip(part.srcs.tolist(), part.dsts.tolist(), part.lengths.tolist()):
            ctypes.memmove(d, s, n)
    assert torch.equal(dst[:, :, dst_pages], src[:, :, src_pages])
    untouched = np.setdiff1d(np.arange(30), dst_pages)
    assert not dst[:, :, untouched].any()


def test_split_covers_every_byte_once() -> None:
    lengths = np.array([10, 500, 3, 3, 3, 4000, 1], dtype=np.int64)
    batch = WriteBatch(np.arange(7) * 10_000, np.arange(7) * 20_000, lengths)
    parts = batch.split(max_entries=3, max_bytes=512)
    # the 4000-byte entry is cut into 512-byte pieces (7 × 512 + 416), the rest stay whole
    assert np.concatenate([p.lengths for p in parts]).tolist() == (
        [10, 500, 3, 3, 3] + [512] * 7 + [416, 1])
    assert all(len(p) <= 3 and p.nbytes <= 512 for p in parts)
    srcs = np.concatenate([p.srcs for p in parts])
    dsts = np.concatenate([p.dsts for p in parts])
    pieces = np.concatenate([p.lengths for p in parts])
    assert (srcs[5:13] == 50_000 + np.arange(8) * 512).all()  # in order, each once
    assert (dsts - srcs == np.repeat(np.arange(7) * 10_000, [1, 1, 1, 1, 1, 8, 1])).all()
    assert int(pieces.sum()) == batch.nbytes


def test_layout_mismatch_and_out_of_range_pages_are_refused() -> None:
    a = KVLayout(1 << 20, 2, 8, 256)
    with pytest.raises(ValueError, match="layouts differ"):
        page_copy_batch(a, KVLayout(1 << 30, 3, 8, 256), np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="destination page"):
        page_copy_batch(a, a, np.array([0]), np.array([8]))
    with pytest.raises(ValueError, match="source pages for"):
        page_copy_batch(a, a, np.array([0, 1]), np.array([0]))


def test_config_validates_names_and_limits() -> None:
    with pytest.raises(ValueError, match="transfer.engine"):
        TransferConfig(engine="carrier-pigeon")
    with pytest.raises(ValueError, match="room_timeout_s"):
        TransferConfig(room_timeout_s=0)
    assert TransferConfig(heartbeat_interval_s=0.5, heartbeat_misses=4).peer_dead_after_s == 2.0


def test_bootstrap_addresses_are_normalised() -> None:
    from pdcache.transfer.receiver import normalize_bootstrap

    assert normalize_bootstrap("127.0.0.1:5000") == "tcp://127.0.0.1:5000"
    assert normalize_bootstrap("tcp://node-3:5000") == "tcp://node-3:5000"
    for bad in ("127.0.0.1", "tcp://h:0", "h:99999", "ipc:///tmp/x:1", ":5"):
        with pytest.raises(ValueError):
            normalize_bootstrap(bad)
