"""Page format (header + checksum), the slot index, the config, and backend selection."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcache.offload_manager.storage import BACKENDS, create_backend
from pdcache.offload_manager.storage.config import StorageConfig
from pdcache.offload_manager.storage.metadata import BUSY, FULL, NEW, PRESENT, SlotIndex
from pdcache.offload_manager.storage.page_format import (
    HEADER_BYTES,
    PageSpec,
    Verdict,
    encode_header,
    encode_object,
    parse_header,
    verify_page,
)
from pdcache.utils.registry import MissingDependencyError

SPEC = PageSpec(
    fingerprint="fp-a", payload_bytes=1024, num_layers=4, page_size=16, dtype="bfloat16"
)
KEY = bytes(range(32))


def _payload(seed: int = 0) -> memoryview:
    gen = torch.Generator().manual_seed(seed)
    page = torch.randint(0, 256, (SPEC.payload_bytes,), dtype=torch.uint8, generator=gen)
    return memoryview(page.numpy())


def _verify(blob: bytes, spec: PageSpec = SPEC, key: bytes = KEY) -> tuple[Verdict, str | None]:
    payload = bytearray(spec.payload_bytes)
    body = blob[HEADER_BYTES:]
    payload[: len(body)] = body
    return verify_page(spec, key, blob[:HEADER_BYTES], memoryview(payload), len(blob))


CHECKSUMS = ["crc32", "xxh3"]


def _spec(checksum: str) -> PageSpec:
    if checksum == "xxh3":
        pytest.importorskip("xxhash")
    return dataclasses.replace(SPEC, checksum=checksum)


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_round_trip_reports_origin(checksum: str) -> None:
    for origin in ("prefill", "decode"):
        blob = encode_object(_spec(checksum), KEY, origin, _payload())
        assert len(blob) == SPEC.object_bytes
        assert _verify(blob) == (Verdict.OK, origin)  # SPEC reads what either algorithm wrote


def test_auto_checksum_prefers_xxh3_when_installed() -> None:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        assert SPEC.checksum == "crc32"
    else:
        assert SPEC.checksum == "xxh3"


@settings(max_examples=60, deadline=None)
@given(
    position=st.integers(0, HEADER_BYTES + 1023),
    bit=st.integers(0, 7),
    checksum=st.sampled_from(CHECKSUMS),
)
def test_any_flipped_bit_is_never_ok(position: int, bit: int, checksum: str) -> None:
    blob = bytearray(encode_object(_spec(checksum), KEY, "prefill", _payload()))
    blob[position] ^= 1 << bit
    verdict, origin = _verify(bytes(blob))
    assert verdict is not Verdict.OK and origin is None


@pytest.mark.parametrize(
    "other",
    [
        PageSpec("fp-b", 1024, 4, 16, "bfloat16"),
        PageSpec("fp-a", 1024, 2, 16, "bfloat16"),
        PageSpec("fp-a", 1024, 4, 32, "bfloat16"),
        PageSpec("fp-a", 1024, 4, 16, "float16"),
        PageSpec("fp-a", 2048, 4, 16, "bfloat16"),
    ],
)
def test_foreign_fingerprint_or_shape(other: PageSpec) -> None:
    header = encode_header(other, KEY, "prefill", memoryview(bytes(other.payload_bytes)))
    assert parse_header(SPEC, header)[0] is Verdict.FOREIGN


def test_truncated_empty_and_wrong_key() -> None:
    blob = encode_object(SPEC, KEY, "decode", _payload())
    assert _verify(blob[: HEADER_BYTES + 100])[0] is Verdict.TRUNCATED
    assert _verify(blob[:50])[0] is Verdict.TRUNCATED
    assert _verify(bytes(SPEC.object_bytes))[0] is Verdict.EMPTY
    assert _verify(b"")[0] is Verdict.EMPTY
    assert _verify(blob, key=bytes(32))[0] is Verdict.WRONG_KEY


def test_encode_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        encode_header(SPEC, b"short", "prefill", _payload())
    with pytest.raises(ValueError, match="origin"):
        encode_header(SPEC, KEY, "router", _payload())
    with pytest.raises(ValueError, match="expects 1024"):
        encode_header(SPEC, KEY, "prefill", memoryview(bytes(10)))


def _index(slots: int = 3, ttl: float = 10.0) -> tuple[SlotIndex, list[float]]:
    now = [0.0]
    return SlotIndex(slots, ttl, clock=lambda: now[0]), now


def _accounted(index: SlotIndex) -> bool:
    s = index.stats()
    return s["free_pages"] + s["used_pages"] + s["reserved_pages"] == s["capacity_pages"]


def test_index_two_phase_write_and_lru_eviction() -> None:
    index, _ = _index()
    keys = [bytes([i]) * 32 for i in range(5)]
    res = index.reserve(keys[:3])
    assert [s for s, _ in res] == [NEW] * 3 and sorted(slot for _, slot in res) == [0, 1, 2]
    assert index.lookup(keys[:3]) == [None] * 3  # not visible before commit
    assert index.commit(keys[:3], [slot for _, slot in res]) == [True] * 3
    assert index.exists_prefix(keys) == 3
    index.lookup(keys[:1])  # keys[0] becomes most recent
    ((status, slot),) = index.reserve(keys[3:4])
    assert status == NEW and slot == res[1][1]  # keys[1] was the LRU page
    assert index.lookup(keys[:3]) == [res[0][1], None, res[2][1]]
    assert index.stats()["evictions"] == 1 and _accounted(index)


def test_index_busy_present_full_abort_and_expiry() -> None:
    index, _ = _index(slots=2, ttl=5.0)
    a, b, c = (bytes([i]) * 32 for i in range(3))
    ((_, slot_a),) = index.reserve([a])
    assert index.reserve([a]) == [(BUSY, -1)]
    ((_, slot_b),) = index.reserve([b])
    assert index.reserve([c]) == [(FULL, -1)]  # reserved slots are never evicted
    index.abort([b], [slot_b])
    assert index.reserve([c])[0] == (NEW, slot_b)
    assert index.commit([a], [slot_a]) == [True] and _accounted(index)
    # A reservation past its TTL is reclaimed when a slot is needed: a crashed writer leaks
    # nothing, and its late commit fails.
    index2, now2 = _index(slots=1, ttl=5.0)
    ((_, s),) = index2.reserve([a])
    now2[0] = 6.0
    assert index2.reserve([b]) == [(NEW, s)]
    assert index2.commit([a], [s]) == [False]
    assert index2.stats()["expired_reservations"] == 1 and _accounted(index2)
    assert index2.commit([b], [s]) == [True]
    assert index2.reserve([b]) == [(PRESENT, -1)]


def test_index_delete_frees_slots() -> None:
    index, _ = _index(slots=4)
    keys = [bytes([i]) * 32 for i in range(4)]
    index.commit(keys, [slot for _, slot in index.reserve(keys)])
    assert sorted(index.delete(keys[1:3] + [b"\xff" * 32])) == [1, 2]
    assert index.exists_prefix(keys) == 1 and _accounted(index)
    index.clear()
    assert index.stats()["used_pages"] == 0 and _accounted(index)


def test_config_validation_names_the_key() -> None:
    with pytest.raises(ValueError, match="storage.backend"):
        StorageConfig(backend="s3", page_bytes=1)
    with pytest.raises(ValueError, match="storage.capacity_pages"):
        StorageConfig(backend="hf3fs", page_bytes=4096)
    with pytest.raises(ValueError, match="storage.metadata"):
        StorageConfig(page_bytes=4096, capacity_pages=1, metadata="http://x")
    with pytest.raises(ValueError, match="unknown storage keys"):
        StorageConfig.from_mapping({"page_bytes": 1, "capacity_pages": 1, "colour": "red"})
    cfg = StorageConfig(page_bytes=4096, capacity_bytes=10 * 8192)
    assert (cfg.slot_bytes, cfg.num_pages) == (8192, 10)


def test_config_from_toml(tmp_path) -> None:
    path = tmp_path / "topo.toml"
    path.write_text(
        '[model]\nname = "x"\n[storage]\nbackend = "file"\npage_bytes = 64\npath = "/tmp/s"\n'
    )
    cfg = StorageConfig.from_toml(path)
    assert (cfg.backend, cfg.page_bytes, cfg.path) == ("file", 64, "/tmp/s")


def test_registry_and_missing_usrbio_client(tmp_path) -> None:
    assert BACKENDS.names() == ["file", "hf3fs", "mooncake"]
    cfg = StorageConfig(
        path=str(tmp_path),
        page_bytes=4096,
        capacity_pages=2,
        io_engine="usrbio",
        usrbio_mount="/3fs",
    )
    with pytest.raises(MissingDependencyError, match="hf3fs-py-usrbio"):
        create_backend(cfg)


# ---------------------------------------------------------------- authenticated pages (v3)

MAC_KEY = bytes(range(100, 132))
MAC_SPEC = dataclasses.replace(SPEC, mac_key=MAC_KEY)


def _recrc(blob: bytearray) -> bytes:
    """Recompute the header CRC after an edit, as a forger with the format (not the key) can."""
    import zlib

    blob[HEADER_BYTES - 4 : HEADER_BYTES] = zlib.crc32(blob[: HEADER_BYTES - 4]).to_bytes(
        4, "little"
    )
    return bytes(blob)


def test_mac_pages_are_version_3_and_read_by_either_reader() -> None:
    blob = encode_object(MAC_SPEC, KEY, "decode", _payload())
    assert blob[4] == 3 and any(blob[88:124])  # version 3: writer id, nonce, tag at 88
    assert _verify(blob, MAC_SPEC) == (Verdict.OK, "decode")
    assert _verify(blob, SPEC) == (Verdict.OK, "decode")  # a keyless reader: checksum only
    v1 = encode_object(SPEC, KEY, "prefill", _payload())
    assert v1[4] == 1 and _verify(v1, SPEC) == (Verdict.OK, "prefill")
    assert _verify(v1, MAC_SPEC)[0] is Verdict.BAD_MAC  # unauthenticated under a key
    assert repr(MAC_KEY) not in repr(MAC_SPEC)  # the key never shows in logs


@pytest.mark.parametrize("where", ["payload", "origin", "mac"])
def test_a_forgery_with_valid_checksum_and_crc_fails_only_the_mac(where: str) -> None:
    import xxhash

    blob = bytearray(encode_object(MAC_SPEC, KEY, "prefill", _payload()))
    if where == "payload":  # new payload, checksum field updated to match
        blob[HEADER_BYTES + 5] ^= 0xFF
        new_sum = xxhash.xxh3_64_intdigest(bytes(blob[HEADER_BYTES:]))
        blob[76:84] = new_sum.to_bytes(8, "little")
    elif where == "origin":
        blob[4 + 2 + 2 + 32 + 16 + 4 + 4 + 1] = 1  # prefill -> decode
    else:
        blob[110] ^= 0x01  # inside the tag
    forged = _recrc(blob)
    assert _verify(forged, SPEC)[0] is Verdict.OK  # no key: the forgery passes
    assert _verify(forged, MAC_SPEC) == (Verdict.BAD_MAC, None)


def test_another_secrets_mac_and_bad_key_length_are_refused() -> None:
    other = dataclasses.replace(SPEC, mac_key=bytes(32))
    assert _verify(encode_object(other, KEY, "prefill", _payload()), MAC_SPEC)[0] is Verdict.BAD_MAC
    with pytest.raises(ValueError, match="32 bytes"):
        dataclasses.replace(SPEC, mac_key=b"short")


def test_mac_over_runs_equals_mac_over_the_concatenated_page() -> None:
    """A page sealed from its runs verifies as the whole page and vice versa (the streamed
    GMAC equals the one-shot one); an edit in any one run fails it."""
    payload = bytes(_payload())
    runs = [memoryview(payload[:100]), memoryview(payload[100:700]), memoryview(payload[700:])]
    from_runs = encode_header(MAC_SPEC, KEY, "prefill", runs) + payload
    whole = encode_header(MAC_SPEC, KEY, "prefill", memoryview(payload)) + payload
    for blob in (from_runs, whole):
        assert _verify(blob, MAC_SPEC) == (Verdict.OK, "prefill")
        head = blob[:HEADER_BYTES]
        assert verify_page(MAC_SPEC, KEY, head, runs, len(blob)) == (Verdict.OK, "prefill")
    edited = [runs[0], memoryview(bytes([payload[100] ^ 1]) + payload[101:700]), runs[2]]
    verdict = verify_page(MAC_SPEC, KEY, from_runs[:HEADER_BYTES], edited, len(from_runs))
    assert verdict == (Verdict.BAD_CHECKSUM, None)  # corruption, told apart from forgery


def test_no_nonce_repeats_and_every_writer_verifies_every_other() -> None:
    """Two writers of one key (two processes) seal under their own ids with counter nonces:
    no (writer, nonce) pair repeats, and each reads the other's pages; a page whose writer id
    is rewritten (to borrow another writer's subkey) fails."""
    writer_a, writer_b = (dataclasses.replace(SPEC, mac_key=MAC_KEY) for _ in range(2))
    blobs = [encode_object(w, KEY, "prefill", _payload(i)) for i in range(20) for w in (writer_a, writer_b)]
    seals = {bytes(blob[88:108]) for blob in blobs}  # writer id + nonce
    assert len(seals) == len(blobs) and len({bytes(b[88:96]) for b in blobs}) == 2
    assert all(_verify(blob, writer_a)[0] is Verdict.OK for blob in blobs)
    assert all(_verify(blob, writer_b)[0] is Verdict.OK for blob in blobs)
    swapped = bytearray(blobs[0])
    swapped[88:96] = blobs[1][88:96]
    assert _verify(_recrc(swapped), writer_a) == (Verdict.BAD_MAC, None)


def test_an_earlier_releases_blake3_mac_page_is_a_counted_mac_miss() -> None:
    """Version-2 pages (keyed BLAKE3, the previous format) are readable without a key, by
    checksum, and never trusted with one: they are recomputed and replaced."""
    blob = bytearray(encode_object(MAC_SPEC, KEY, "prefill", _payload()))
    blob[4] = 2
    old = _recrc(blob)
    assert _verify(old, SPEC) == (Verdict.OK, "prefill")
    assert _verify(old, MAC_SPEC) == (Verdict.BAD_MAC, None)


SEALED = PageSpec(fingerprint="fp-a", payload_bytes=1024, num_layers=4, page_size=16,
                  dtype="bfloat16", mac_key=MAC_KEY)  # checksum "auto": none when sealed
ALGO_AT, CHECK_AT = 66, 76  # header offsets: checksum algorithm (u16), checksum field (u64)


def test_sealed_pages_skip_the_checksum_and_store_the_writers_key_check() -> None:
    """By default a sealed page has no payload checksum (algorithm 2, "none"): its checksum
    field is the writer's key check. The key's readers verify it by MAC alone; a keyless
    reader cannot check it and refuses it; `checksum = "xxh3"` keeps it readable there."""
    assert SEALED.checksum == "none"
    blob = encode_object(SEALED, KEY, "decode", _payload())
    assert blob[4] == 3 and blob[ALGO_AT] == 2
    check = int.from_bytes(blob[CHECK_AT : CHECK_AT + 8], "little")
    assert check == SEALED.sealer.key_check() and check != 0
    assert _verify(blob, SEALED) == (Verdict.OK, "decode")
    assert _verify(blob, dataclasses.replace(SEALED)) == (Verdict.OK, "decode")  # another writer
    assert _verify(blob, SPEC) == (Verdict.NEEDS_KEY, None)  # no key: nothing to check it with
    keeps = PageSpec(fingerprint="fp-a", payload_bytes=1024, num_layers=4, page_size=16,
                     dtype="bfloat16", checksum="xxh3", mac_key=MAC_KEY)
    assert _verify(encode_object(keeps, KEY, "decode", _payload()), SPEC) == (Verdict.OK, "decode")
    with pytest.raises(ValueError, match="needs a page MAC key"):
        dataclasses.replace(SPEC, checksum="none")
    v1_none = bytearray(encode_object(SPEC, KEY, "prefill", _payload()))
    v1_none[ALGO_AT] = 2  # an unsealed page may not go without a checksum
    assert _verify(_recrc(v1_none), SEALED) == (Verdict.CORRUPT, None)


@pytest.mark.parametrize("checksum", ["none", "xxh3"])
def test_a_failed_mac_is_labelled_corruption_or_forgery_with_or_without_a_checksum(
    checksum: str,
) -> None:
    """Sealed with the checksum or without it (key check), a failed MAC is still told apart:
    a page sealed under this key and altered since is `BAD_CHECKSUM`; one sealed under another
    secret, or carrying no MAC, is `BAD_MAC`. Neither is ever served."""
    spec = dataclasses.replace(SEALED, checksum=checksum)
    blob = bytearray(encode_object(spec, KEY, "prefill", _payload()))
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 300] ^= 0x04  # corruption in the payload
    assert _verify(bytes(flipped), SEALED) == (Verdict.BAD_CHECKSUM, None)
    other = dataclasses.replace(spec, mac_key=bytes(32))  # another cluster's secret
    assert _verify(encode_object(other, KEY, "prefill", _payload()), SEALED) == (
        Verdict.BAD_MAC, None)
    unsealed = encode_object(SPEC, KEY, "prefill", _payload())
    assert _verify(unsealed, SEALED) == (Verdict.BAD_MAC, None)
    tag = bytearray(blob)
    tag[110] ^= 0x01  # the tag itself damaged: still sealed under this key
    assert _verify(_recrc(tag), SEALED) == (Verdict.BAD_CHECKSUM if checksum == "none"
                                            else Verdict.BAD_MAC, None)


def test_the_writers_own_key_check_survives_a_flood_of_other_writers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Verifying pages of more writers than the cipher cache holds (a forger cycling writer
    ids) evicts them from the cache, never the writer's own key check: sealing still needs
    no derivation (no keyed BLAKE3 per write) and its pages carry the same check."""
    writer = dataclasses.replace(SEALED)
    own = writer.sealer.key_check()
    for i in range(writer.sealer.CACHED_WRITERS + 8):
        forged = bytearray(encode_object(SEALED, KEY, "prefill", _payload()))
        forged[88:96] = i.to_bytes(8, "little")  # another writer id each time
        assert _verify(_recrc(forged), writer)[0] is Verdict.BAD_MAC

    def no_derivation(writer_id: bytes) -> None:
        raise AssertionError("the sealing path derived a cipher")

    monkeypatch.setattr(writer.sealer, "_cipher", no_derivation)
    blob = encode_object(writer, KEY, "prefill", _payload())
    monkeypatch.undo()
    assert int.from_bytes(blob[CHECK_AT : CHECK_AT + 8], "little") == own
    assert _verify(blob, writer) == (Verdict.OK, "prefill")


# A sealed page with its xxh3 checksum, as the encoder of the release before algorithm "none"
# (commit b97f7aa) stored it: bytes written once by that encoder and checked in, not what
# today's encoder makes. Its MAC key, page key, spec and payload are these.
OLD_PAGE = Path(__file__).parent / "data" / "b97f7aa_sealed_xxh3.page"
OLD_MAC_KEY, OLD_KEY = bytes(range(32)), bytes(range(100, 132))
OLD_PAYLOAD = bytes((7 * i + 3) % 256 for i in range(256))


def _old_spec(mac_key: bytes | None) -> PageSpec:
    return PageSpec(fingerprint="b97f7aa-fixture", payload_bytes=256, num_layers=2, page_size=4,
                    dtype="bfloat16", mac_key=mac_key)


def test_pages_of_the_release_before_still_read() -> None:
    """The stored b97f7aa page (version 3, GMAC, xxh3 kept) reads OK with the key (MAC) and
    without it (checksum); a flipped payload byte is BAD_CHECKSUM either way (with the key:
    the MAC fails, the kept checksum labels it corruption)."""
    blob = OLD_PAGE.read_bytes()
    assert len(blob) == HEADER_BYTES + 256 and blob[4] == 3 and blob[ALGO_AT] == 1
    assert blob[HEADER_BYTES:] == OLD_PAYLOAD
    keyed, keyless = _old_spec(OLD_MAC_KEY), _old_spec(None)
    for spec in (keyed, keyless):
        assert _verify(blob, spec, OLD_KEY) == (Verdict.OK, "prefill")
        flipped = bytearray(blob)
        flipped[HEADER_BYTES + 100] ^= 0x01
        assert _verify(bytes(flipped), spec, OLD_KEY) == (Verdict.BAD_CHECKSUM, None)
    other_secret = _old_spec(bytes(32))
    assert _verify(blob, other_secret, OLD_KEY) == (Verdict.BAD_MAC, None)


def test_a_keyless_reader_counts_a_sealed_page_without_checksum_as_needs_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not `foreign` (another model's page): `needs_key`, its own reason, logged once per
    store however many such pages it reads."""
    from pdcache.offload_manager.storage.stats import StorageCounters

    blob = encode_object(SEALED, KEY, "decode", _payload())
    verdict = _verify(blob, SPEC)[0]
    assert verdict is Verdict.NEEDS_KEY
    counters = StorageCounters()
    with caplog.at_level("WARNING", logger="pdcache.offload_manager.storage.stats"):
        for _ in range(3):
            counters.record_failed_read(verdict)
    stats = counters.snapshot()
    assert (stats["rejected_needs_key_pages"], stats["rejected_foreign_pages"]) == (3, 0)
    assert stats["foreign_pages"] == 0 and stats["corrupt_pages"] == 3
    assert sum("no page MAC key" in r.getMessage() for r in caplog.records) == 1
