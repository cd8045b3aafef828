"""What a released room leaves behind: its remembered outcome (for `poll`, a late message or a
`wait` after the release) keeps no pages, no prefill-side report or state, and decode's
reports (their prompt logprobs, up to ~1 MiB a room) only within `finished_report_bytes`."""

from __future__ import annotations

import pytest

from pdcache.engine.api import TokenLogprob
from pdcache.transfer.errors import TransferError
from pdcache.transfer.messages import PrefillReport, pack_logprobs
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.rooms import Outcome, RoomState
from pdcache.transfer.sender import KVSender
from tests.transfer_support import fast_config, make_pool, wait_until

ROOMS = 12
KEPT = 3  # rooms whose report fits the byte bound


def _prompt_logprobs() -> bytes:
    """A 1024-token prompt's logprobs with the top 5 at each position (~50 KiB packed)."""
    return pack_logprobs([TokenLogprob(i, -1.0, tuple((j, -2.0) for j in range(5)), ())
                          for i in range(1024)])


class _Run:
    """ROOMS successful rooms, each with the same prompt logprobs, between a started sender
    and receiver; `delivered`: the logprob bytes decode's on_release read for each room."""

    def __init__(self, **overrides) -> None:
        self.logprobs = _prompt_logprobs()
        config = fast_config("zmq", max_message_bytes=1 << 20, **overrides)
        self.delivered: dict[int, int] = {}
        self.sender = KVSender(config, make_pool(16, seed=1)).start()
        self.receiver = KVReceiver(config, make_pool(16, seed=None),
                                   on_release=self._on_release).start()

    def _on_release(self, outcome: Outcome) -> None:  # the decode node reads it here only
        result = self.receiver.wait(outcome.room_id, 0.0)
        self.delivered[outcome.room_id] = len(result.report.input_logprobs)

    def play(self) -> None:
        self.receiver.connect(self.sender.bootstrap_addr)
        for room in range(1, ROOMS + 1):
            self.receiver.request(room, self.sender.bootstrap_addr, [1, 2], num_tokens=5)
            report = PrefillReport(7, input_logprobs=self.logprobs)
            assert self.sender.send(room, [3, 4], report)
            assert self.receiver.wait(room, 10.0).report.input_logprobs == self.logprobs
        wait_until(lambda: self.sender.rooms.active_count() == 0
                   and self.receiver.rooms.active_count() == 0, 5.0,
                   "every room released on both sides")
        assert self.delivered == {room: len(self.logprobs) for room in range(1, ROOMS + 1)}

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


def test_released_rooms_keep_neither_pages_nor_prefill_s_report() -> None:
    run = _Run()
    try:
        run.play()
        for room in range(1, ROOMS + 1):  # prefill: state and reason only
            outcome = run.sender.rooms.outcome(room)
            assert outcome is not None and outcome.state is RoomState.SUCCESS
            assert outcome.data is None
        for room in range(1, ROOMS + 1):  # decode: never the pages
            outcome = run.receiver.rooms.outcome(room)
            assert outcome is not None and outcome.state is RoomState.SUCCESS
            assert getattr(outcome.data, "dst_pages", None) is None
            # within the default bound (64 MiB): a later wait still reads the report
            assert run.receiver.wait(room, 0.0).report.input_logprobs == run.logprobs
        assert run.receiver.rooms.kept_payload_bytes() == ROOMS * len(run.logprobs)
        assert run.sender.rooms.kept_payload_bytes() == 0
    finally:
        run.close()


def test_decode_keeps_reports_only_within_the_byte_bound() -> None:
    run = _Run(finished_report_bytes=KEPT * len(_prompt_logprobs()))
    try:
        run.play()
        assert run.receiver.rooms.kept_payload_bytes() == KEPT * len(run.logprobs)
        for room in range(ROOMS - KEPT + 1, ROOMS + 1):  # the newest reports are still read
            assert run.receiver.wait(room, 0.0).report.input_logprobs == run.logprobs
        for room in range(1, ROOMS - KEPT + 1):  # the older ones: their state only
            with pytest.raises(TransferError) as info:
                run.receiver.wait(room, 0.0)
            assert info.value.code == "expired"
            assert run.receiver.poll(room) is RoomState.SUCCESS
    finally:
        run.close()


def test_a_failed_room_s_later_wait_still_says_how_it_failed() -> None:
    config = fast_config("zmq")
    sender = KVSender(config, make_pool(16, seed=1)).start()
    receiver = KVReceiver(config, make_pool(16, seed=None)).start()
    try:
        receiver.connect(sender.bootstrap_addr)
        receiver.request(5, sender.bootstrap_addr, [1, 2], num_tokens=5)
        wait_until(lambda: sender.rooms.get(5) is not None, 5.0, "decode's request")
        sender.abort(5, "prefill gave up")
        wait_until(lambda: receiver.rooms.outcome(5) is not None, 5.0, "decode's release")
        with pytest.raises(TransferError) as info:
            receiver.wait(5, 0.0)
        assert (info.value.code, info.value.reason) == ("aborted",
                                                        "aborted by prefill: prefill gave up")
        assert getattr(receiver.rooms.outcome(5).data, "dst_pages", None) is None
    finally:
        receiver.close()
        sender.close()
