"""Recurrent-state checkpoints as stored objects (docs/design.md §4.2-4.4, §8; issue #36):
state keys chained to the page keys, the state object format, and every backend's state calls.

Backends: hf3fs (in-process index), hf3fs with `pdcache metadata-server`, file, the file
backend behind the fault-injection wrapper, and Mooncake Store against a real master. Each
protection is also shown off: a forged object is served by a store without the MAC, a lying
header is served once its geometry/length field says what the reader wants, another tenant's
salt hits once it is the same salt.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from pdcache.engine.page_keys import (  # noqa: E402
    PageKeyScheme,
    chain_page_keys,
    make_salt,
    state_key,
    state_keys,
)
from pdcache.engine.state_geometry import (  # noqa: E402
    LinearAttentionConfig,
    RecurrentStateGeometry,
)
from pdcache.offload_manager.storage import create_backend  # noqa: E402
from pdcache.offload_manager.storage.base import StorageBackend  # noqa: E402
from pdcache.offload_manager.storage.config import StorageConfig  # noqa: E402
from pdcache.offload_manager.storage.fault_injection import DelayInjectingBackend  # noqa: E402
from pdcache.offload_manager.storage.metadata_service import LocalMetadataService  # noqa: E402
from pdcache.offload_manager.storage.mooncake_store import MooncakeStoreBackend  # noqa: E402
from pdcache.offload_manager.storage.state_format import (  # noqa: E402
    STATE_HEADER_BYTES,
    StateSpec,
    StateVerdict,
    decode_state_object,
    encode_state_object,
)
from pdcache.utils.secret import derive_key  # noqa: E402

LINEAR = LinearAttentionConfig(conv_kernel=4, key_head_dim=8, value_head_dim=8,
                               num_key_heads=2, num_value_heads=4)
GEOMETRY = RecurrentStateGeometry((0, 2), LINEAR, "bfloat16")
# same bytes, other layers: only the header's geometry tells them apart
OTHER_GEOMETRY = RecurrentStateGeometry((1, 3), LINEAR, "bfloat16")
STATE_BYTES = GEOMETRY.state_bytes()
PAGE_BYTES = 4096
PAGE_SIZE = 4
FINGERPRINT = "model=test-hybrid;dtype=bfloat16;page=4"
MAC_KEY = derive_key(b"cluster-secret-one-" * 2, "page-mac")
OTHER_MAC_KEY = derive_key(b"cluster-secret-two-" * 2, "page-mac")
KINDS = ["hf3fs", "hf3fs_service", "file", "file_delayed", "mooncake"]

assert OTHER_GEOMETRY.state_bytes() == STATE_BYTES and OTHER_GEOMETRY.key() != GEOMETRY.key()


# ------------------------------------------------------------------------------- keys


def _page_keys(tenant: str, n: int = 4, tokens_from: int = 100) -> list[bytes]:
    tokens = list(range(tokens_from, tokens_from + PAGE_SIZE * n))
    return chain_page_keys(tokens, PAGE_SIZE, make_salt(FINGERPRINT, tenant))


def test_state_keys_are_chained_to_page_keys_and_never_page_keys() -> None:
    pages = _page_keys("tenant/a")
    states = state_keys(pages, GEOMETRY.key())
    assert states == [state_key(k, GEOMETRY.key()) for k in pages]  # a pure function
    assert len(set(states)) == len(states) and not set(states) & set(pages)
    # bound to the geometry, and through the page key to the tenant salt and the fingerprint
    assert not set(states) & set(state_keys(pages, OTHER_GEOMETRY.key()))
    assert not set(states) & set(state_keys(_page_keys("tenant/b"), GEOMETRY.key()))
    other_fp = chain_page_keys(list(range(100, 116)), PAGE_SIZE, make_salt("other", "tenant/a"))
    assert not set(states) & set(state_keys(other_fp, GEOMETRY.key()))
    # a state key is never the next page's key: continuing the chain from a page key with any
    # tokens gives page keys, and the state keys are none of them
    continued = chain_page_keys(list(range(8)), PAGE_SIZE, pages[-1])
    assert not set(states) & set(continued)
    # either key scheme: the state key follows the storage page key
    sglang = PageKeyScheme(FINGERPRINT, PAGE_SIZE, scheme="sglang")
    sg_keys, _ = sglang.keys(list(range(100, 116)), tenant="tenant/a")
    assert not set(state_keys(sg_keys, GEOMETRY.key())) & set(sg_keys + states)
    with pytest.raises(ValueError, match="32 bytes"):
        state_key(b"short", GEOMETRY.key())


# ------------------------------------------------------------------------------- format

SPEC = StateSpec(FINGERPRINT, GEOMETRY.key(), STATE_BYTES)
SEALED = StateSpec(FINGERPRINT, GEOMETRY.key(), STATE_BYTES, mac_key=MAC_KEY)
KEY = state_key(_page_keys("")[0], GEOMETRY.key())


def _state(seed: int = 0, nbytes: int = STATE_BYTES) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("spec", [SPEC, SEALED], ids=["checksum", "mac"])
def test_format_round_trip_and_each_refusal(spec: StateSpec) -> None:
    blob = encode_state_object(spec, KEY, 8, "decode", _state())
    assert len(blob) == STATE_HEADER_BYTES + STATE_BYTES
    assert decode_state_object(spec, KEY, blob) == (StateVerdict.OK, "decode")
    assert decode_state_object(spec, KEY, blob, tokens=8) == (StateVerdict.OK, "decode")
    assert decode_state_object(spec, KEY, blob, tokens=12)[0] is StateVerdict.POSITION
    assert decode_state_object(spec, bytes(32), blob)[0] is StateVerdict.WRONG_KEY
    assert decode_state_object(spec, KEY, blob[:-1])[0] is StateVerdict.TRUNCATED
    assert decode_state_object(spec, KEY, bytes(len(blob)))[0] is StateVerdict.EMPTY
    other = StateSpec(FINGERPRINT, OTHER_GEOMETRY.key(), STATE_BYTES, mac_key=spec.mac_key)
    assert decode_state_object(other, KEY, blob)[0] is StateVerdict.GEOMETRY
    shorter = StateSpec(FINGERPRINT, GEOMETRY.key(), STATE_BYTES - 64, mac_key=spec.mac_key)
    assert decode_state_object(shorter, KEY, blob)[0] is StateVerdict.LENGTH
    foreign = StateSpec("another-model", GEOMETRY.key(), STATE_BYTES, mac_key=spec.mac_key)
    assert decode_state_object(foreign, KEY, blob)[0] is StateVerdict.FOREIGN
    header = bytearray(blob)
    header[40] ^= 1  # a header bit: the header CRC refuses it
    assert decode_state_object(spec, KEY, bytes(header))[0] is StateVerdict.CORRUPT
    payload = bytearray(blob)
    payload[-5] ^= 1  # a payload bit: corruption, whether the MAC or the checksum finds it
    assert decode_state_object(spec, KEY, bytes(payload))[0] is StateVerdict.BAD_CHECKSUM


def test_a_page_object_is_never_a_state_object() -> None:
    from pdcache.offload_manager.storage.page_format import PageSpec, encode_object

    page_spec = PageSpec(FINGERPRINT, STATE_BYTES + STATE_HEADER_BYTES - 128, mac_key=MAC_KEY)
    blob = encode_object(page_spec, KEY, "prefill",
                         memoryview(_state(nbytes=page_spec.payload_bytes).numpy()))
    assert len(blob) == SEALED.object_bytes  # the same size, on purpose
    assert decode_state_object(SEALED, KEY, blob)[0] is StateVerdict.CORRUPT  # magic PDKV


def test_mac_off_serves_a_forged_state_mac_on_refuses_it() -> None:
    forged = encode_state_object(SPEC, KEY, 8, "prefill", _state(seed=9))  # no MAC
    other_secret = encode_state_object(
        StateSpec(FINGERPRINT, GEOMETRY.key(), STATE_BYTES, mac_key=OTHER_MAC_KEY),
        KEY, 8, "prefill", _state(seed=9))
    assert decode_state_object(SPEC, KEY, forged)[0] is StateVerdict.OK  # protection off
    assert decode_state_object(SEALED, KEY, forged)[0] is StateVerdict.BAD_MAC
    assert decode_state_object(SEALED, KEY, other_secret)[0] is StateVerdict.BAD_MAC
    # a sealed object without a checksum, read without the key: nothing to check it with
    assert decode_state_object(SPEC, KEY, other_secret)[0] is StateVerdict.NEEDS_KEY


# ------------------------------------------------------------------------------- backends


@pytest.fixture(scope="module")
def metadata_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    service = LocalMetadataService(tmp_path_factory.mktemp("metadata-state")).start()
    try:
        yield service.address
    finally:
        service.stop()


@pytest.fixture(scope="module")
def mooncake_client(tmp_path_factory: pytest.TempPathFactory,
                    request: pytest.FixtureRequest) -> Iterator[object]:
    config = _config("mooncake", tmp_path_factory.mktemp("mc"), request)
    client = MooncakeStoreBackend.connect(config)
    try:
        yield client
    finally:
        client.close()  # type: ignore[attr-defined]


def _config(kind: str, path: Path, request: pytest.FixtureRequest,
            **over: object) -> StorageConfig:
    base: dict[str, object] = dict(
        path=str(path), page_bytes=PAGE_BYTES, capacity_pages=8, fingerprint=FINGERPRINT,
        namespace=f"s{uuid.uuid4().hex[:12]}", num_layers=2, page_size=PAGE_SIZE,
        num_data_files=2, timeout_s=2.0, state_geometry=GEOMETRY.key(),
        state_bytes=STATE_BYTES, state_capacity=4,
    )
    if kind == "hf3fs_service":
        base.update(backend="hf3fs", metadata=request.getfixturevalue("metadata_service"))
    elif kind == "mooncake":
        base.update(backend="mooncake", mooncake_master=request.getfixturevalue("mooncake_master"),
                    mooncake_segment_bytes=16 << 20, mooncake_local_buffer_bytes=16 << 20)
    else:
        base.update(backend="file" if kind.startswith("file") else kind)
    base.update(over)
    return StorageConfig(**base)  # type: ignore[arg-type]


Factory = Callable[..., StorageBackend]


@pytest.fixture(params=KINDS)
def make_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """Opens backends of the kind (one namespace and path unless overridden); closes them."""
    kind = request.param
    opened: list[StorageBackend] = []
    defaults = _config(kind, tmp_path / "store", request)

    def make(**over: object) -> StorageBackend:
        config = defaults.replace(**over)
        if kind == "mooncake":
            client = request.getfixturevalue("mooncake_client")
            backend: StorageBackend = MooncakeStoreBackend(config, client=client)
        else:
            backend = create_backend(config)
        if kind == "file_delayed":
            backend = DelayInjectingBackend(backend, write_delay_s=0.001)
        opened.append(backend)
        return backend

    try:
        yield make
    finally:
        for backend in opened:
            backend.close()


def _keys(tenant: str = "tenant/a", n: int = 4) -> list[bytes]:
    return state_keys(_page_keys(tenant, n), GEOMETRY.key())


def _rejected(backend: StorageBackend) -> dict[str, int | float]:
    stats = backend.stats()
    return {k: v for k, v in stats.items() if k.startswith("rejected_") and k.endswith("_states")
            and v}


def test_round_trip_byte_exact_and_state_vs_kv_bytes(make_backend: Factory) -> None:
    backend = make_backend()
    assert backend.supports_states
    key = _keys()[0]
    state = _state()
    assert not backend.exists_state(key)
    assert backend.put_state(key, state, tokens=PAGE_SIZE, origin="decode")
    assert backend.exists_state(key)
    assert backend.put_state(key, _state(seed=1), tokens=PAGE_SIZE)  # present: skipped
    out = torch.zeros(STATE_BYTES, dtype=torch.uint8)
    assert backend.get_state_into(key, out, tokens=PAGE_SIZE) == "decode"
    assert torch.equal(out, state)  # byte-exact, the first write wins
    assert backend.get_state(key) == state.numpy().tobytes()
    assert backend.get_state(_keys()[1]) is None  # never stored: a plain miss
    page = torch.full((PAGE_BYTES,), 7, dtype=torch.uint8)
    page_key = _page_keys("tenant/a", 1)[0]
    assert backend.put_from([page_key], [page]) == [True]
    stats = backend.stats()
    assert (stats["states_written"], stats["states_skipped"], stats["states_read"]) == (1, 1, 2)
    assert stats["state_bytes_written"] == STATE_BYTES
    assert stats["state_bytes_read"] == 2 * STATE_BYTES
    assert stats["kv_bytes_written"] == stats["bytes_written"] == PAGE_BYTES  # apart
    assert stats["kv_bytes_read"] == 0
    assert stats["state_misses"] == 1 and stats["misses"] == 0
    assert stats["used_states"] == 1
    backend.delete_states([key])
    assert not backend.exists_state(key) and backend.get_state(key) is None
    assert backend.stats()["deleted_states"] == 1


def test_a_state_of_the_wrong_size_is_refused_before_any_io(make_backend: Factory) -> None:
    backend = make_backend()
    with pytest.raises(ValueError, match="bytes"):
        backend.put_state(_keys()[0], _state(nbytes=STATE_BYTES - 2), tokens=4)
    with pytest.raises(ValueError, match="bytes"):
        backend.get_state_into(_keys()[0], torch.zeros(8, dtype=torch.uint8))
    assert backend.stats()["states_written"] == 0


@pytest.mark.parametrize("mac", [True, False], ids=["mac_on", "mac_off"])
def test_forged_and_tampered_states_are_counted_misses_with_the_mac(
        make_backend: Factory, mac: bool) -> None:
    """A forger with storage access writes well-formed state objects without a valid MAC (no
    MAC, another secret): with the MAC key they are counted misses, never served; with the
    protection off the unsealed forgery is served. A flipped payload bit is a miss either way."""
    backend = make_backend(page_mac_key=MAC_KEY if mac else None)
    keys = _keys()
    for i, key in enumerate(keys[:3]):
        assert backend.put_state(key, _state(seed=i), tokens=4 * (i + 1))
    evil = _state(seed=66)
    forged = encode_state_object(SPEC, keys[0], 4, "prefill", evil)  # no MAC
    assert backend.write_state_object(keys[0], forged)  # type: ignore[attr-defined]
    other = StateSpec(FINGERPRINT, GEOMETRY.key(), STATE_BYTES, checksum="xxh3",
                      mac_key=OTHER_MAC_KEY)
    sealed_elsewhere = encode_state_object(other, keys[1], 8, "prefill", evil)
    assert backend.write_state_object(keys[1], sealed_elsewhere)  # type: ignore[attr-defined]
    tampered = bytearray(backend.read_state_object(keys[2]))  # type: ignore[attr-defined]
    tampered[STATE_HEADER_BYTES + 17] ^= 0x5A
    assert backend.write_state_object(keys[2], bytes(tampered))  # type: ignore[attr-defined]
    out = torch.zeros(STATE_BYTES, dtype=torch.uint8)
    if mac:
        assert [backend.get_state_into(k, out) for k in keys[:3]] == [None, None, None]
        assert _rejected(backend) == {"rejected_mac_states": 2, "rejected_checksum_states": 1}
        # the genuine writer replaces what its reads refused
        assert backend.put_state(keys[0], _state(seed=0), tokens=4)
        assert backend.get_state_into(keys[0], out) == "prefill"
        assert torch.equal(out, _state(seed=0))
        assert backend.stats()["replaced_rejected_states"] == 1
    else:
        assert backend.get_state_into(keys[0], out) == "prefill"  # the forgery, served
        assert torch.equal(out, evil)
        assert backend.get_state_into(keys[1], out) == "prefill"  # its checksum is valid
        assert backend.get_state_into(keys[2], out) is None
        assert _rejected(backend) == {"rejected_checksum_states": 1}
    assert backend.stats()["state_misses"] == (3 if mac else 1)


@pytest.mark.parametrize("lie", [False, True], ids=["true_header", "protection_off"])
def test_another_geometry_or_length_is_a_counted_miss(make_backend: Factory, lie: bool) -> None:
    """Objects of another geometry (same bytes) and of another length under this store's keys
    are counted misses. With the check off (the header claims this store's geometry and
    length, as a store that did not record them would see it) the other geometry's bytes are
    served: the header field is what keeps them out."""
    backend = make_backend()
    keys = _keys()
    for key in keys[:3]:
        assert backend.put_state(key, _state(), tokens=4)
    theirs = _state(seed=5)
    claimed = SPEC if lie else StateSpec(FINGERPRINT, OTHER_GEOMETRY.key(), STATE_BYTES)
    write = backend.write_state_object  # type: ignore[attr-defined]
    assert write(keys[0], encode_state_object(claimed, keys[0], 4, "prefill", theirs))
    shorter = StateSpec(FINGERPRINT, GEOMETRY.key(), STATE_BYTES - 512)
    assert write(keys[1], encode_state_object(shorter, keys[1], 4, "prefill", _state(nbytes=STATE_BYTES - 512)))
    foreign = StateSpec("another-model", GEOMETRY.key(), STATE_BYTES)
    assert write(keys[2], encode_state_object(foreign, keys[2], 4, "prefill", theirs))
    out = torch.zeros(STATE_BYTES, dtype=torch.uint8)
    assert backend.get_state_into(keys[1], out) is None
    assert backend.get_state_into(keys[2], out) is None
    if lie:
        assert backend.get_state_into(keys[0], out) == "prefill"
        assert torch.equal(out, theirs)
        assert _rejected(backend) == {"rejected_length_states": 1, "rejected_foreign_states": 1}
    else:
        assert backend.get_state_into(keys[0], out) is None
        assert _rejected(backend) == {"rejected_geometry_states": 1,
                                      "rejected_length_states": 1,
                                      "rejected_foreign_states": 1}


def test_a_state_at_another_position_is_a_counted_miss(make_backend: Factory) -> None:
    backend = make_backend()
    key = _keys()[1]
    assert backend.put_state(key, _state(), tokens=8)
    out = torch.zeros(STATE_BYTES, dtype=torch.uint8)
    assert backend.get_state_into(key, out, tokens=12) is None
    assert _rejected(backend) == {"rejected_position_states": 1}
    assert backend.get_state_into(key, out, tokens=8) == "prefill"


@pytest.mark.parametrize("same_salt", [False, True], ids=["other_salt", "protection_off"])
def test_another_tenant_salt_never_reads_a_state(make_backend: Factory, same_salt: bool) -> None:
    """Tenant A's state is keyed by A's page chain: B, for the same tokens, computes other
    keys and misses (a plain miss: nothing of A's is even looked at). With the same salt
    (no tenant isolation) the same tokens find it."""
    backend = make_backend()
    a_key = _keys("tenant/a")[2]
    assert backend.put_state(a_key, _state(), tokens=12, namespace="tenant/a")
    b_key = _keys("tenant/a" if same_salt else "tenant/b")[2]
    assert backend.exists_state(b_key) is same_salt
    assert (backend.get_state(b_key) is not None) is same_salt
    assert not _rejected(backend)


def test_state_capacity_evicts_least_recently_used_states_only(make_backend: Factory) -> None:
    backend = make_backend(state_capacity=2)
    keys = _keys(n=3)
    page_key = _page_keys("tenant/a", 1)[0]
    assert backend.put_from([page_key], [torch.zeros(PAGE_BYTES, dtype=torch.uint8)]) == [True]
    assert backend.put_state(keys[0], _state(0), tokens=4)
    assert backend.put_state(keys[1], _state(1), tokens=8)
    assert backend.get_state(keys[0]) is not None  # keys[0] is the most recent now
    assert backend.put_state(keys[2], _state(2), tokens=12)
    assert [backend.exists_state(k) for k in keys] == [True, False, True]
    assert backend.exists_states(keys) == [True, False, True]  # one batched lookup
    assert backend.exists_prefix([page_key]) == 1  # pages are not states' victims
    stats = backend.stats()
    assert stats["state_evictions"] == 1 and stats["used_states"] == 2


def test_hf3fs_states_survive_a_restart_of_an_in_process_index(tmp_path: Path,
                                                               request: pytest.FixtureRequest) -> None:
    config = _config("hf3fs", tmp_path, request)
    backend = create_backend(config)
    key = _keys()[0]
    assert backend.put_state(key, _state(3), tokens=4)
    backend.close()
    reopened = create_backend(config)
    try:
        assert reopened.get_state(key) == _state(3).numpy().tobytes()
        other = create_backend(config.replace(state_geometry=OTHER_GEOMETRY.key()))
        try:  # the same pool (same slot size), but its header scan indexes no other geometry
            assert other.get_state(key) is None
        finally:
            other.close()
    finally:
        reopened.close()


def test_a_backend_without_a_state_geometry_refuses_state_calls(tmp_path: Path) -> None:
    backend = create_backend(StorageConfig(backend="file", path=str(tmp_path),
                                           page_bytes=PAGE_BYTES, fingerprint=FINGERPRINT))
    try:
        assert not backend.supports_states
        with pytest.raises(ValueError, match="no state objects configured"):
            backend.put_state(KEY, _state(), tokens=4)
    finally:
        backend.close()
    with pytest.raises(ValueError, match="state_capacity"):
        StorageConfig(backend="hf3fs", path=str(tmp_path), page_bytes=PAGE_BYTES,
                      capacity_pages=4, state_geometry=GEOMETRY.key(), state_bytes=STATE_BYTES)
    with pytest.raises(ValueError, match="both"):
        StorageConfig(backend="file", path=str(tmp_path), page_bytes=PAGE_BYTES,
                      state_geometry=GEOMETRY.key())


# ------------------------------------------------------------------------------- quotas


@pytest.mark.parametrize("quota", [True, False], ids=["quota", "protection_off"])
def test_tenant_quota_counts_state_bytes(tmp_path: Path, quota: bool) -> None:
    """A tenant's quota covers its state objects' bytes (headers included) with its pages:
    at its quota a state write evicts the tenant's own least recently used objects only."""
    state_cost = STATE_HEADER_BYTES + STATE_BYTES
    page_cost = 128 + PAGE_BYTES
    quotas = {"tenant/a": 2 * state_cost + page_cost} if quota else {}
    backend = create_backend(StorageConfig(
        backend="file", path=str(tmp_path), page_bytes=PAGE_BYTES, fingerprint=FINGERPRINT,
        state_geometry=GEOMETRY.key(), state_bytes=STATE_BYTES, namespace_quotas=quotas))
    try:
        a_pages, a_states = _page_keys("tenant/a", 1), _keys("tenant/a", 3)
        b_states = _keys("tenant/b", 2)
        for key in b_states:
            assert backend.put_state(key, _state(), tokens=4, namespace="tenant/b")
        page = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        assert backend.put_from(a_pages, [page], namespace="tenant/a") == [True]
        for key in a_states[:2]:
            assert backend.put_state(key, _state(), tokens=4, namespace="tenant/a")
        assert backend.put_state(a_states[2], _state(), tokens=4, namespace="tenant/a")
        assert all(backend.exists_state(k) for k in b_states)  # never another tenant's
        if quota:  # the page was A's least recently used object: it went first
            assert backend.exists_prefix(a_pages) == 0
            assert all(backend.exists_state(k) for k in a_states)
            assert backend.stats()["quota_evictions"] == 1
        else:
            assert backend.exists_prefix(a_pages) == 1
            assert backend.stats()["quota_evictions"] == 0
    finally:
        backend.close()


def test_the_fault_injection_wrapper_delays_and_forwards_state_calls(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.write_text("0")
    inner = create_backend(StorageConfig(
        backend="file", path=str(tmp_path / "store"), page_bytes=PAGE_BYTES,
        fingerprint=FINGERPRINT, state_geometry=GEOMETRY.key(), state_bytes=STATE_BYTES))
    now = [0.0]  # the wrapper's clock: advanced past its re-read interval below
    backend = DelayInjectingBackend(inner, control, write_delay_s=0.001, clock=lambda: now[0])
    try:
        assert backend.supports_states and backend.state_spec == inner.state_spec
        assert backend.put_state(KEY, _state(), tokens=4)  # delayed: write_delay_s
        assert backend.stats()["injected_delays"] == 1
        control.write_text("0.001")
        now[0] += 3600.0  # the cached delay is stale now: the control file is re-read
        assert backend.get_state(KEY) == _state().numpy().tobytes()
        assert backend.exists_state(KEY)
        backend.delete_states([KEY])
        stats = backend.stats()
        assert stats["injected_delays"] == 4 and stats["deleted_states"] == 1
    finally:
        backend.close()
