"""Control messages: round trips and strict rejection of anything malformed."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pdcache.engine.api import CachedTokens, TokenLogprob
from pdcache.transfer.messages import (
    MAX_ROOM_ID,
    PROTOCOL_VERSION,
    Abort,
    Done,
    MessageError,
    Ping,
    PrefillReport,
    Register,
    RegisterAck,
    RoomRequest,
    decode,
    encode,
    pack_logprobs,
    pack_pages,
)

LIMIT = 1 << 16
CACHED = {"device": 8, "host": 0, "storage": 0, "storage_from_decode": 0}
REPORT = {"first_token": 2, "prompt_tokens": 9, "computed_tokens": 1, "cached": CACHED,
          "prefill_node": "p0"}


def _raw(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _reject_kind(raw: bytes) -> str:
    with pytest.raises(MessageError) as info:
        decode(raw, LIMIT)
    return info.value.kind


@pytest.mark.parametrize("msg", [
    Register("d1", "zmq", b"tcp://127.0.0.1:5", 1 << 40, 4, 128, 4096),
    RoomRequest(MAX_ROOM_ID, pack_pages([3, 1, 2]), 40),
    Done(7, 1 << 20, PrefillReport(42, 40, 24, CachedTokens(device=8, host=8), "p0")),
    Done(8, 1, PrefillReport(-1)),
    Abort(9, "client gone", "aborted"),
    Ping(1),
])
def test_round_trip_keeps_every_field(msg) -> None:
    assert decode(encode(msg), LIMIT) == msg


def test_room_request_first_page_is_version_6_only_when_set() -> None:
    plain = RoomRequest(1, pack_pages([4, 5]), 40)
    reused = RoomRequest(1, pack_pages([4, 5]), 40, first_page=1)
    plain_body = msgpack.unpackb(encode(plain))
    assert plain_body["v"] == 4 and "first_page" not in plain_body  # a version-5 peer reads it
    assert msgpack.unpackb(encode(reused))["v"] == 6
    assert decode(encode(reused), LIMIT) == reused
    # an index, and a version-5 frame (which lacks it) means "send every page"
    body = {"t": "room_request", "room": 1, "dst_pages": pack_pages([4]), "num_tokens": 9}
    assert _reject_kind(_raw({"v": 6, **body, "first_page": -1})) == "bad_field"
    assert decode(_raw({"v": 5, **body}), LIMIT).first_page == 0


def test_room_request_pages_round_trip() -> None:
    pages = np.array([5, 0, 1 << 20, 77])
    msg = decode(encode(RoomRequest(1, pack_pages(pages), 9)), LIMIT)
    assert msg.page_ids().tolist() == pages.tolist()


@pytest.mark.parametrize("raw, kind", [
    (b"\xc1garbage", "malformed"),
    (b"", "malformed"),
    (_raw([1, "ping", 3]), "malformed"),
    (_raw({"v": PROTOCOL_VERSION + 1, "t": "ping", "seq": 1}), "version"),
    (_raw({"t": "ping", "seq": 1}), "version"),
    (_raw({"v": PROTOCOL_VERSION, "t": "launch_missiles"}), "unknown_type"),
    (_raw({"v": PROTOCOL_VERSION, "t": 3, "seq": 1}), "unknown_type"),
    (_raw({"v": PROTOCOL_VERSION, "t": "ping"}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "ping", "seq": 1, "extra": 2}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "ping", "seq": "1"}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "ping", "seq": True}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "ping", "seq": -1}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "started", "room": 1 << 63}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "room_request", "room": 1, "dst_pages": b"abc",
           "num_tokens": 3}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "room_request", "room": 1, "dst_pages": b"",
           "num_tokens": 3}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "room_request", "room": 1,
           "dst_pages": np.array([-1], "<i4").tobytes(), "num_tokens": 3}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "done", "room": 1, "first_token": 2, "nbytes": 3,
           "stats": {"cached_tokens": 1}}), "bad_field"),  # version 1's shape
    (_raw({"v": PROTOCOL_VERSION, "t": "done", "room": 1, "nbytes": 3,
           "report": {**REPORT, "extra": 1}}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "done", "room": 1, "nbytes": 3,
           "report": {**REPORT, "cached": {"device": 1}}}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "done", "room": 1, "nbytes": 3,
           "report": {**REPORT, "cached": {**CACHED, "disk": 1}}}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "done", "room": 1, "nbytes": 3,
           "report": {**REPORT, "cached": {**CACHED, "host": "8"}}}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "done", "room": 1, "nbytes": 3,
           "report": {**REPORT, "cached": {**CACHED, "host": -8}}}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "done", "room": 1, "nbytes": 3,
           "report": {**REPORT, "first_token": -2}}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "done", "room": 1, "nbytes": 3,
           "report": {**REPORT, "prefill_node": b"p0"}}), "bad_field"),
    (_raw({"v": PROTOCOL_VERSION, "t": "done", "room": 1, "nbytes": 3,
           "report": [2, 0, 0, CACHED, "p0"]}), "bad_field"),
])
def test_malformed_messages_are_rejected_with_their_kind(raw: bytes, kind: str) -> None:
    assert _reject_kind(raw) == kind


def test_oversized_message_is_rejected_before_parsing() -> None:
    big = encode(Abort(1, "x" * LIMIT, "aborted"))
    assert _reject_kind(big) == "oversized"


def test_room_id_must_fit_in_63_bits() -> None:
    assert _reject_kind(_raw({"v": PROTOCOL_VERSION, "t": "started",
                              "room": MAX_ROOM_ID + 1})) == "bad_field"
    assert _reject_kind(_raw({"v": PROTOCOL_VERSION, "t": "started", "room": -5})) \
        == "bad_field"


def test_pack_pages_refuses_ids_outside_int32() -> None:
    with pytest.raises(ValueError):
        pack_pages([1 << 31])
    with pytest.raises(ValueError):
        pack_pages([-1])


# ---- version 3: logprobs in the report ----------------------------------------------------
ENTRIES = [
    TokenLogprob(5, None),
    TokenLogprob(7, -1.5, top=((9, -0.5), (7, -1.5), (3, -2.25)), selected=((2, -4.0),)),
    TokenLogprob(9, float(np.float32(-0.1)), top=((9, float(np.float32(-0.1))),), selected=()),
]


def test_report_logprobs_round_trip_exactly() -> None:
    report = PrefillReport(7, 3, 3, first_logprob=pack_logprobs(ENTRIES[1:2]),
                           input_logprobs=pack_logprobs(ENTRIES))
    got = decode(encode(Done(1, 2, report)), LIMIT).report
    assert got.first_token_logprob() == ENTRIES[1]
    assert got.prompt_logprobs() == ENTRIES
    assert PrefillReport(7).prompt_logprobs() is None
    assert PrefillReport(7, input_logprobs=pack_logprobs([])).prompt_logprobs() == []


def test_a_version_2_done_is_still_accepted_without_logprobs() -> None:
    raw = _raw({"v": 2, "t": "done", "room": 1, "nbytes": 3, "report": REPORT})
    msg = decode(raw, LIMIT)
    assert msg.report == PrefillReport(2, 9, 1, CachedTokens(device=8), "p0")
    assert msg.report.first_token_logprob() is None
    # version 3 must send the new fields; version 1 stays refused
    v3 = {"v": PROTOCOL_VERSION, "t": "done", "room": 1, "nbytes": 3, "report": REPORT}
    assert _reject_kind(_raw(v3)) == "bad_field"
    assert _reject_kind(_raw({**v3, "v": 1})) == "version"


@pytest.mark.parametrize("blob", [b"\x01\x00", pack_logprobs(ENTRIES)[:-4],
                                  pack_logprobs(ENTRIES) + b"\x00" * 4])
def test_corrupt_report_logprobs_are_rejected(blob: bytes) -> None:
    report = {**REPORT, "first_logprob": b"", "input_logprobs": blob}
    raw = _raw({"v": PROTOCOL_VERSION, "t": "done", "room": 1, "nbytes": 3, "report": report})
    assert _reject_kind(raw) == "bad_field"


def test_the_version_table_is_read_only() -> None:
    from pdcache.transfer import messages

    with pytest.raises(TypeError):
        messages._ADDED_IN[4][Abort] = frozenset()  # type: ignore[index]
    with pytest.raises(TypeError):
        messages._ADDED_IN[5] = {}  # type: ignore[index]


# ---- version 4: the prefill's boot id in RegisterAck --------------------------------------
def test_register_ack_carries_the_boot_id_and_older_acks_default_it() -> None:
    ack = RegisterAck("p0", "", b"sixteen byte id!")
    assert decode(encode(ack), LIMIT) == ack
    for version in (2, 3):  # before version 4: no boot id, accepted with the default
        raw = _raw({"v": version, "t": "register_ack", "prefill_id": "p0", "error": ""})
        assert decode(raw, LIMIT) == RegisterAck("p0", "", b"")
    v4 = {"v": PROTOCOL_VERSION, "t": "register_ack", "prefill_id": "p0", "error": ""}
    assert _reject_kind(_raw(v4)) == "bad_field"  # version 4 must send it
