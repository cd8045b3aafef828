"""One behaviour suite for every storage backend (docs/design.md §4.3-4.4).

Backends: hf3fs (posix IO, in-process metadata), hf3fs with `pdcache metadata-server`, file,
and mooncake against a real `mooncake_master` on loopback. Each test uses its own namespace, so
tests sharing the session's master or metadata service never see each other's pages.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from pdcache.engine.page_keys import chain_page_keys, make_salt  # noqa: E402
from pdcache.offload_manager.storage import create_backend  # noqa: E402
from pdcache.offload_manager.storage.base import StorageBackend  # noqa: E402
from pdcache.offload_manager.storage.config import StorageConfig  # noqa: E402
from pdcache.offload_manager.storage.metadata_service import LocalMetadataService  # noqa: E402
from pdcache.offload_manager.storage.mooncake_store import MooncakeStoreBackend  # noqa: E402
from pdcache.offload_manager.storage.page_format import (  # noqa: E402
    HEADER_BYTES,
    PageSpec,
    byte_view,
    encode_object,
)
from pdcache.utils.secret import derive_key  # noqa: E402

PAGE_BYTES = 4096 + 512  # not a multiple of the 4 KiB slot alignment, on purpose
FINGERPRINT = "model=test;dtype=uint8;page=4"
KINDS = ["hf3fs", "hf3fs_service", "file", "mooncake"]


@pytest.fixture(scope="session")
def metadata_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    service = LocalMetadataService(tmp_path_factory.mktemp("metadata-state")).start()
    try:
        yield service.address
    finally:
        service.stop()


def _config(kind: str, path: str, request: pytest.FixtureRequest, **over: object) -> StorageConfig:
    base: dict[str, object] = dict(
        path=path,
        page_bytes=PAGE_BYTES,
        capacity_pages=16,
        fingerprint=FINGERPRINT,
        namespace=f"t{uuid.uuid4().hex[:12]}",
        num_layers=2,
        page_size=4,
        num_data_files=2,
        timeout_s=2.0,
    )
    if kind == "hf3fs_service":
        base.update(backend="hf3fs", metadata=request.getfixturevalue("metadata_service"))
    elif kind == "mooncake":
        base.update(
            backend="mooncake",
            mooncake_master=request.getfixturevalue("mooncake_master"),
            mooncake_segment_bytes=16 << 20,
            mooncake_local_buffer_bytes=16 << 20,
        )
    else:
        base.update(backend=kind)
    base.update(over)
    return StorageConfig(**base)  # type: ignore[arg-type]


Factory = Callable[..., StorageBackend]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


class MooncakeClients:
    """Set-up Mooncake Store clients that this module's mooncake backends borrow
    (`MooncakeStoreBackend(client=...)`): a test's k-th backend gets the k-th client, so
    backends of one test are distinct clients, and the module pays Mooncake's client teardown
    (1-2 s each, holding the GIL) once per client instead of once per backend."""

    def __init__(self, config: StorageConfig) -> None:
        self._config = config
        self._clients: list[object] = []

    def get(self, index: int) -> object:
        while len(self._clients) <= index:
            self._clients.append(MooncakeStoreBackend.connect(self._config))
        return self._clients[index]

    def close(self) -> None:
        for client in self._clients:
            client.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def mooncake_clients(tmp_path_factory: pytest.TempPathFactory,
                     request: pytest.FixtureRequest) -> Iterator[MooncakeClients]:
    clients = MooncakeClients(_config("mooncake", str(tmp_path_factory.mktemp("mc")), request))
    try:
        yield clients
    finally:
        clients.close()


@pytest.fixture
def make_backend(kind: str, tmp_path, request: pytest.FixtureRequest) -> Iterator[Factory]:
    """Opens backends of `kind` (same namespace and path unless overridden); closes them all.
    Mooncake backends borrow the module's clients (`MooncakeClients`), each its own namespace."""
    opened: list[StorageBackend] = []
    defaults = _config(kind, str(tmp_path / "store"), request)
    clients = request.getfixturevalue("mooncake_clients") if kind == "mooncake" else None

    def make(**over: object) -> StorageBackend:
        config = defaults.replace(**over)
        if clients is not None:
            backend: StorageBackend = MooncakeStoreBackend(config, client=clients.get(len(opened)))
        else:
            backend = create_backend(config)
        opened.append(backend)
        return backend

    try:
        yield make
    finally:
        for backend in opened:
            backend.close()


def _keys(n: int, namespace: str = "tenant-a") -> list[bytes]:
    tokens = list(range(1000, 1000 + 4 * n))
    return chain_page_keys(tokens, 4, make_salt(FINGERPRINT, namespace))


def _pages(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PAGE_BYTES), dtype=torch.uint8, generator=gen)


def _flip_byte(backend: StorageBackend, key: bytes, offset: int) -> None:
    blob = bytearray(backend.read_object(key))  # type: ignore[attr-defined]
    blob[offset] ^= 0x5A
    assert backend.write_object(key, bytes(blob))  # type: ignore[attr-defined]


def _truncate(backend: StorageBackend, key: bytes, keep: int) -> None:
    if hasattr(backend, "locate"):  # hf3fs: the data file ends inside the slot
        path, offset = backend.locate(key)
        os.truncate(path, offset + keep)
    else:
        blob = backend.read_object(key)  # type: ignore[attr-defined]
        assert backend.write_object(key, blob[:keep])  # type: ignore[attr-defined]


def test_put_get_byte_exact_and_exists_prefix(make_backend: Factory) -> None:
    backend = make_backend()
    keys, pages = _keys(5), _pages(5)
    assert backend.exists_prefix(keys) == 0
    assert backend.put_from(keys[:3], list(pages[:3])) == [True, True, True]
    assert backend.exists_prefix(keys) == 3
    assert backend.exists_prefix([keys[3], keys[0]]) == 0
    out = torch.zeros_like(pages)
    origins: list[str | None] = []
    assert backend.get_into(keys, list(out), origins) == [True, True, True, False, False]
    assert torch.equal(out[:3], pages[:3])
    assert not out[3:].any()  # a miss leaves the host page untouched
    assert origins == ["prefill", "prefill", "prefill", None, None]
    stats = backend.stats()
    assert (stats["pages_written"], stats["pages_read"], stats["misses"]) == (3, 3, 2)
    assert stats["bytes_read"] == 3 * PAGE_BYTES
    assert stats["corrupt_pages"] == 0


def test_stored_files_are_the_service_accounts_alone(kind: str, make_backend: Factory,
                                                     tmp_path) -> None:
    """Stored K/V is the tenants' prompts in all but name (authenticated, not encrypted):
    the files and directories a backend creates carry no group or other permission (they
    were 0644 and 0755: any local account read every tenant's pages)."""
    if kind == "mooncake":
        pytest.skip("Mooncake keeps pages in its segments, not in files")
    backend = make_backend()
    assert backend.put_from(_keys(3), list(_pages(3))) == [True, True, True]
    store = tmp_path / "store"
    created = [store, *store.rglob("*")]
    assert len(created) > 1
    assert {oct(path.stat().st_mode & 0o777) for path in created} <= {"0o600", "0o700"}


def test_hf3fs_data_files_made_before_are_narrowed_on_open(kind: str, make_backend: Factory,
                                                          tmp_path) -> None:
    """hf3fs data files live as long as the store: one created readable by others (before
    files were private, or by hand) kept every page written after into a readable file."""
    if kind != "hf3fs":
        pytest.skip("only hf3fs keeps its data files across opens")
    make_backend().close()
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert files
    for path in files:
        path.chmod(0o644)
    backend = make_backend()
    assert backend.put_from(_keys(1), list(_pages(1))) == [True]
    assert {oct(path.stat().st_mode & 0o777) for path in files} == {"0o600"}


def test_dedup_second_put_is_skipped_and_counted(make_backend: Factory) -> None:
    backend = make_backend()
    keys, pages = _keys(4), _pages(4)
    assert backend.put_from(keys[:2], list(pages[:2])) == [True, True]
    other = _pages(4, seed=1)
    assert backend.put_from(keys, list(other), origin="decode") == [True] * 4
    stats = backend.stats()
    assert (stats["pages_written"], stats["pages_skipped"]) == (4, 2)
    out = torch.zeros_like(pages)
    origins: list[str | None] = []
    assert backend.get_into(keys, list(out), origins) == [True] * 4
    assert torch.equal(out[:2], pages[:2])  # the first write of a key wins
    assert torch.equal(out[2:], other[2:])
    assert origins == ["prefill", "prefill", "decode", "decode"]


def test_lru_eviction_when_full(make_backend: Factory) -> None:
    backend = make_backend(capacity_pages=4)
    keys, pages = _keys(6), _pages(6)
    for i in range(4):
        assert backend.put_from([keys[i]], [pages[i]]) == [True]
    assert backend.get_into([keys[0]], [torch.zeros(PAGE_BYTES, dtype=torch.uint8)]) == [True]
    assert backend.put_from(keys[4:6], list(pages[4:6])) == [True, True]
    # keys[0] was used most recently before the new puts, so keys[1] and keys[2] went first.
    present = [backend.exists_prefix([k]) for k in keys]
    assert present == [1, 0, 0, 1, 1, 1]
    out = torch.zeros_like(pages)
    assert backend.get_into(keys, list(out)) == [True, False, False, True, True, True]
    assert torch.equal(out[3:], pages[3:]) and torch.equal(out[0], pages[0])
    stats = backend.stats()
    assert stats["evictions"] == 2
    assert stats["used_pages"] == 4
    assert stats["free_pages"] + stats["used_pages"] + stats["reserved_pages"] == 4


@pytest.mark.parametrize("kind", ["hf3fs", "hf3fs_service"])
def test_hf3fs_accounting_free_used_reserved(make_backend: Factory) -> None:
    backend = make_backend(capacity_pages=5)
    keys, pages = _keys(8), _pages(8)
    backend.put_from(keys[:3], list(pages[:3]))
    backend.put_from(keys[3:8], list(pages[3:8]))
    backend.delete(keys[5:6])
    stats = backend.stats()
    assert stats["free_pages"] + stats["used_pages"] + stats["reserved_pages"] == 5
    assert (stats["used_pages"], stats["reserved_pages"], stats["deleted_pages"]) == (4, 0, 1)


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corrupt_page_is_a_counted_miss(make_backend: Factory, where: str) -> None:
    backend = make_backend()
    keys, pages = _keys(2), _pages(2)
    backend.put_from(keys, list(pages))
    _flip_byte(backend, keys[1], HEADER_BYTES + 1000 if where == "payload" else 40)
    out = torch.zeros_like(pages)
    origins: list[str | None] = []
    assert backend.get_into(keys, list(out), origins) == [True, False]
    assert origins == ["prefill", None]
    stats = backend.stats()
    assert (stats["corrupt_pages"], stats["pages_read"]) == (1, 1)


def test_truncated_page_is_a_counted_miss(make_backend: Factory) -> None:
    backend = make_backend(num_data_files=1)
    keys, pages = _keys(1), _pages(1)
    backend.put_from(keys, list(pages))
    _truncate(backend, keys[0], HEADER_BYTES + PAGE_BYTES // 2)
    assert backend.get_into(keys, [torch.zeros(PAGE_BYTES, dtype=torch.uint8)]) == [False]
    stats = backend.stats()
    assert stats["corrupt_pages"] == 1 and stats["truncated_pages"] == 1


def test_foreign_fingerprint_is_a_counted_miss(make_backend: Factory) -> None:
    backend = make_backend()
    keys, pages = _keys(1), _pages(1)
    backend.put_from(keys, list(pages))
    foreign = PageSpec(
        fingerprint="model=other", payload_bytes=PAGE_BYTES, num_layers=2, page_size=4
    )
    assert backend.write_object(
        keys[0], encode_object(foreign, keys[0], "prefill", byte_view(pages[0]))
    )
    assert backend.get_into(keys, [torch.zeros(PAGE_BYTES, dtype=torch.uint8)]) == [False]
    stats = backend.stats()
    assert stats["corrupt_pages"] == 1 and stats["foreign_pages"] == 1


def test_page_stored_under_another_key_is_a_miss(make_backend: Factory) -> None:
    backend = make_backend()
    keys, pages = _keys(2), _pages(2)
    backend.put_from(keys, list(pages))
    backend.write_object(keys[1], backend.read_object(keys[0]))
    assert backend.get_into(keys[1:], [torch.zeros(PAGE_BYTES, dtype=torch.uint8)]) == [False]
    assert backend.stats()["wrong_key_pages"] == 1


def test_tenants_never_share_pages(make_backend: Factory) -> None:
    backend = make_backend()
    pages = _pages(3)
    backend.put_from(_keys(3, "tenant-a"), list(pages))
    assert backend.exists_prefix(_keys(3, "tenant-b")) == 0
    assert backend.get_into(_keys(1, "tenant-b"), [torch.zeros(PAGE_BYTES, dtype=torch.uint8)]) == [
        False
    ]


def test_delete(make_backend: Factory) -> None:
    backend = make_backend()
    keys, pages = _keys(3), _pages(3)
    backend.put_from(keys, list(pages))
    backend.delete(keys[1:2])
    assert backend.exists_prefix(keys) == 1
    assert backend.get_into(keys, list(torch.zeros_like(pages))) == [True, False, True]
    assert backend.put_from(keys[1:2], [pages[1]]) == [True]  # can be written again
    assert backend.exists_prefix(keys) == 3


def test_second_client_sees_committed_pages(make_backend: Factory) -> None:
    """A fresh client on the same storage (a restarted server) finds every page."""
    first = make_backend()
    keys, pages = _keys(4), _pages(4)
    first.put_from(keys, list(pages), origin="decode")
    second = make_backend()
    assert second.exists_prefix(keys) == 4
    out = torch.zeros_like(pages)
    origins: list[str | None] = []
    assert second.get_into(keys, list(out), origins) == [True] * 4
    assert torch.equal(out, pages) and origins == ["decode"] * 4


def test_wrong_page_size_is_a_configuration_error(make_backend: Factory) -> None:
    backend = make_backend()
    with pytest.raises(ValueError, match="bytes"):
        backend.put_from(_keys(1), [torch.zeros(PAGE_BYTES - 1, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="keys but"):
        backend.get_into(_keys(2), [torch.zeros(PAGE_BYTES, dtype=torch.uint8)])


def test_clear_removes_pages_written_by_any_client(make_backend: Factory) -> None:
    writer = make_backend()
    keys, pages = _keys(3), _pages(3)
    writer.put_from(keys, list(pages))
    other = make_backend()
    other.clear()  # type: ignore[attr-defined]
    assert other.exists_prefix(keys) == 0
    # The writer misses too (with in-process hf3fs metadata its stale index still lists the
    # pages, but their slots were invalidated).
    assert writer.get_into(keys, list(torch.zeros_like(pages))) == [False] * 3


MAC_KEY = derive_key(b"cluster-secret-one-" * 2, "page-mac")
OTHER_MAC_KEY = derive_key(b"cluster-secret-two-" * 2, "page-mac")


def _forged(spec_key: bytes | None, key: bytes, payload: torch.Tensor,
            payload_bytes: int = PAGE_BYTES) -> bytes:
    """A well-formed page (valid header CRC and payload checksum) under `key`, MAC'd with
    `spec_key` (None: no MAC, a version-1 page), as a forger with storage access writes it.
    It keeps the xxh3 checksum even when sealed, so a keyless reader can check (and serve) it."""
    spec = PageSpec(
        fingerprint=FINGERPRINT,
        payload_bytes=payload_bytes,
        num_layers=2,
        page_size=4,
        checksum="xxh3",
        mac_key=spec_key,
    )
    return encode_object(spec, key, "prefill", byte_view(payload))


@pytest.mark.parametrize("mac", [True, False], ids=["mac_on", "mac_off"])
def test_forged_page_is_served_only_without_the_mac(make_backend: Factory, mac: bool) -> None:
    """Pages written straight into the store (hf3fs slots, the page file, the Mooncake object)
    with a valid checksum but no valid MAC: with a MAC key they are counted misses, never
    served; with the MAC off the same pages are served (what the protection is for)."""
    backend = make_backend(page_mac_key=MAC_KEY if mac else None)
    keys, pages = _keys(3), _pages(3)
    assert backend.put_from(keys, list(pages)) == [True] * 3
    evil = _pages(2, seed=7)
    assert backend.write_object(keys[1], _forged(None, keys[1], evil[0]))  # no MAC at all
    assert backend.write_object(keys[2], _forged(OTHER_MAC_KEY, keys[2], evil[1]))  # 2nd secret
    assert backend.exists_prefix(keys) == 3  # existence is not trust: the read decides
    out = torch.zeros_like(pages)
    found = backend.get_into(keys, list(out))
    stats = backend.stats()
    if mac:
        assert found == [True, False, False]
        assert torch.equal(out[0], pages[0])
        assert (stats["rejected_mac_pages"], stats["rejected_checksum_pages"]) == (2, 0)
        assert stats["misses"] == 2 and stats["pages_read"] == 1
    else:
        assert found == [True, True, True]
        assert torch.equal(out[1:], evil)  # the forgery is served
        assert stats["rejected_mac_pages"] == 0


@pytest.mark.parametrize("kind", ["hf3fs", "hf3fs_service", "file"])
@pytest.mark.parametrize("pipeline_pages", [4, 0], ids=["pipelined", "inline"])
def test_forgeries_in_every_page_group_are_refused_beside_the_read(
    make_backend: Factory, pipeline_pages: int
) -> None:
    """14 sealed 512 KiB pages read in groups of 4 verified on the pipeline's helper thread
    and written in groups sealed on it (hf3fs and file, page_pipeline.py): forgeries in the first,
    a middle and the last group are counted misses and every other page reads back byte-exact;
    the same page by page (pipeline_pages 0), where no helper thread ever starts."""
    page_bytes, count = 512 << 10, 14
    backend = make_backend(page_mac_key=MAC_KEY, pipeline_pages=pipeline_pages,
                           page_bytes=page_bytes)
    gen = torch.Generator().manual_seed(3)
    pages, evil = torch.randint(0, 256, (2, count, page_bytes), dtype=torch.uint8, generator=gen)
    keys = _keys(count)
    assert backend.put_from(keys, list(pages)) == [True] * count
    forged = {1: None, 6: OTHER_MAC_KEY, 13: None}  # index -> the forger's key (None: no MAC)
    for i, forger_key in forged.items():
        assert backend.write_object(keys[i], _forged(forger_key, keys[i], evil[i], page_bytes))
    out = torch.zeros_like(pages)
    assert backend.get_into(keys, list(out)) == [i not in forged for i in range(count)]
    genuine = [i for i in range(count) if i not in forged]
    assert torch.equal(out[genuine], pages[genuine])
    stats = backend.stats()
    assert (stats["rejected_mac_pages"], stats["pages_read"]) == (3, count - 3)
    helper = backend._pipeline._helper_thread  # type: ignore[attr-defined]  # noqa: SLF001
    assert (helper is not None) is (pipeline_pages > 0)  # the verify really ran beside the read


@pytest.mark.parametrize("kind", ["hf3fs", "file"])
def test_by_default_sealed_batches_try_both_ways_and_refuse_forgeries_either_way(
    make_backend: Factory
) -> None:
    """The store's default (`pipeline_pages` None, "auto"): each batch of sealed pages that
    spans several groups runs beside the I/O or page by page as measured (the choice itself:
    test_page_pipeline.py); its warm-up runs the batches of each operation on the helper and
    page by page in turn (the 1st and 3rd on the helper, the 2nd and 4th page by page), and a
    forgery is a counted miss, never served, both ways. `stats()` counts the calls each way and their cost."""
    count, page_bytes = 8, 512 << 10  # groups of 4 pages (2 MiB): 2 groups a batch
    backend = make_backend(page_mac_key=MAC_KEY, page_bytes=page_bytes)
    gen = torch.Generator().manual_seed(5)
    pages, evil = torch.randint(0, 256, (2, count, page_bytes), dtype=torch.uint8, generator=gen)
    keys = _keys(count)
    for batch in range(4):
        backend.delete(keys)
        assert backend.put_from(keys, list(pages)) == [True] * count
        assert backend.write_object(keys[batch], _forged(None, keys[batch], evil[batch],
                                                         page_bytes))
        out = torch.zeros_like(pages)
        assert backend.get_into(keys, list(out)) == [i != batch for i in range(count)]
        genuine = [i for i in range(count) if i != batch]
        assert torch.equal(out[genuine], pages[genuine])
    stats = backend.stats()
    assert stats["rejected_mac_pages"] == 4
    assert [stats[f"pipeline_{op}_{way}_calls"] for op in ("read", "write")
            for way in ("pipelined", "inline", "busy")] == [2, 2, 0, 2, 2, 0]
    assert min(stats[f"pipeline_{op}_{way}_ns_per_page"] for op in ("read", "write")
               for way in ("pipelined", "inline")) > 0
    helper = backend._pipeline._helper_thread  # type: ignore[attr-defined]  # noqa: SLF001
    assert helper is not None  # the pipelined batches really ran on the helper


@pytest.mark.parametrize("kind", ["file"])
def test_a_pipelined_file_put_changes_the_store_exactly_as_page_by_page(
    make_backend: Factory
) -> None:
    """The seal of group g+1 runs on the helper before group g is written; every index change
    (skip an already stored page, evict, store) still happens on the caller in batch order.
    A full store (capacity 4), a batch of new pages, a duplicate key in another group and the
    stored pages again: the same pages survive, the same counts, pipelined or not (when the
    helper decided the skips, the pipelined put wrote and evicted other pages)."""
    page_bytes = 512 << 10  # groups of 4 pages
    gen = torch.Generator().manual_seed(9)
    pages = torch.randint(0, 256, (8, page_bytes), dtype=torch.uint8, generator=gen)
    old, new = _keys(4), [bytes([0xA0 + i]) * 32 for i in range(3)]
    batch = [new[0], new[1], new[2], old[0], new[0], old[1], old[2], old[3]]
    outcomes = []
    for pipeline_pages in (0, 4):
        backend = make_backend(page_mac_key=MAC_KEY, capacity_pages=4,
                               pipeline_pages=pipeline_pages, page_bytes=page_bytes,
                               namespace=f"mode{pipeline_pages}")  # a store of its own
        assert backend.put_from(old, list(pages[:4])) == [True] * 4
        assert backend.put_from(batch, list(pages)) == [True] * 8
        stats = backend.stats()
        present = [key in set(backend.keys()) for key in old + new]
        counts = [stats[name] for name in ("pages_written", "pages_skipped", "evictions")]
        outcomes.append((present, counts))
    assert outcomes[1] == outcomes[0]


@pytest.mark.parametrize("kind", ["hf3fs", "file"])
def test_unsealed_and_fixed_pipelines_report_no_adaptive_calls(make_backend: Factory) -> None:
    """Only the adaptive default measures: an unsealed store and a fixed `pipeline_pages` have
    no `pipeline_*` stats (nothing to choose)."""
    for backend in (make_backend(), make_backend(page_mac_key=MAC_KEY, pipeline_pages=4)):
        assert not [name for name in backend.stats() if name.startswith("pipeline_")]


def test_mac_pages_detect_corruption_and_read_back_exactly(make_backend: Factory) -> None:
    backend = make_backend(page_mac_key=MAC_KEY)
    keys, pages = _keys(2), _pages(2)
    backend.put_from(keys, list(pages))
    blob = bytearray(backend.read_object(keys[1]))
    assert blob[4] == 3  # format version 3: the page carries a MAC
    _flip_byte(backend, keys[1], HEADER_BYTES + 7)
    out = torch.zeros_like(pages)
    assert backend.get_into(keys, list(out)) == [True, False]
    assert torch.equal(out[0], pages[0])
    assert backend.stats()["rejected_checksum_pages"] == 1


@pytest.mark.parametrize("checksum", ["auto", "xxh3"], ids=["no_checksum", "xxh3_kept"])
def test_a_forgery_inside_a_genuine_sealed_header_is_a_counted_miss(
    make_backend: Factory, checksum: str
) -> None:
    """A forger who keeps a genuine sealed page's header (writer id, nonce, tag, key check or
    checksum) and swaps in its own payload, header CRC intact: the MAC fails, so it is a
    counted miss on every backend, never served, whether sealed pages carry no checksum (the
    default: labelled corruption, as its key check is genuine) or keep the xxh3 (labelled
    corruption too: the payload no longer matches the checksum). Pages of the same store
    that were not touched are served byte-exact."""
    backend = make_backend(page_mac_key=MAC_KEY, checksum=checksum)
    keys, pages = _keys(2), _pages(2)
    assert backend.put_from(keys, list(pages)) == [True, True]
    blob = backend.read_object(keys[1])  # type: ignore[attr-defined]
    assert blob[66] == (2 if checksum == "auto" else 1)  # checksum algorithm: none / xxh3
    evil = _pages(1, seed=9)[0]
    forged = blob[:HEADER_BYTES] + bytes(evil.numpy())
    assert backend.write_object(keys[1], forged)  # type: ignore[attr-defined]
    out = torch.zeros_like(pages)
    assert backend.get_into(keys, list(out)) == [True, False]
    assert torch.equal(out[0], pages[0])  # page 1 reported missing: never served
    stats = backend.stats()
    assert (stats["rejected_checksum_pages"], stats["rejected_mac_pages"]) == (1, 0)
    assert stats["misses"] == 1 and stats["pages_read"] == 1


@pytest.mark.parametrize("replace", [True, False], ids=["replace_on", "replace_off"])
def test_rejected_page_is_replaced_by_the_next_genuine_put(
    make_backend: Factory, replace: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forged page (no MAC) and an other-secret page (a secret rotation) under live keys:
    the read refuses them, the recomputed genuine pages are put, and the next read serves
    them. With the replacement off (the old behaviour) the put skips the keys as present and
    the prefix stays a storage miss for good."""
    backend = make_backend(page_mac_key=MAC_KEY)
    if not replace:
        monkeypatch.setattr(backend, "_replace_rejected", lambda keys: None)
    keys, pages = _keys(3), _pages(3)
    evil = _pages(2, seed=7)
    assert backend.put_from(keys, list(pages)) == [True] * 3
    # the forger overwrites the stored objects (write_object: hf3fs overwrites a live slot)
    assert backend.write_object(keys[1], _forged(None, keys[1], evil[0]))
    assert backend.write_object(keys[2], _forged(OTHER_MAC_KEY, keys[2], evil[1]))
    assert backend.get_into(keys, list(torch.zeros_like(pages))) == [True, False, False]
    assert backend.put_from(keys, list(pages)) == [True] * 3  # the prefill recomputed them
    out = torch.zeros_like(pages)
    found = backend.get_into(keys, list(out))
    stats = backend.stats()
    if replace:
        assert found == [True] * 3
        assert torch.equal(out, pages)
        assert stats["replaced_rejected_pages"] == 2
        assert (stats["pages_written"], stats["pages_skipped"]) == (5, 1)
        assert stats["rejected_mac_pages"] == 2  # the first read only
    else:
        assert found == [True, False, False]
        assert stats["replaced_rejected_pages"] == 0
        assert (stats["pages_written"], stats["pages_skipped"]) == (3, 3)
        assert stats["rejected_mac_pages"] == 4


def test_genuine_page_is_not_replaced_and_a_refused_key_once(make_backend: Factory) -> None:
    """Only keys a read refused are replaced (a verified or unread page is still skipped),
    and a refusal replaces one put only."""
    backend = make_backend(page_mac_key=MAC_KEY)
    keys, pages = _keys(2), _pages(2)
    assert backend.put_from(keys, list(pages)) == [True, True]
    assert backend.write_object(keys[1], _forged(None, keys[1], pages[1]))
    assert backend.get_into(keys, list(torch.zeros_like(pages))) == [True, False]
    other = _pages(2, seed=3)
    assert backend.put_from(keys, list(other)) == [True, True]
    assert backend.put_from(keys, list(other)) == [True, True]
    out = torch.zeros_like(pages)
    assert backend.get_into(keys, list(out)) == [True, True]
    assert torch.equal(out[0], pages[0]) and torch.equal(out[1], other[1])
    stats = backend.stats()
    assert stats["replaced_rejected_pages"] == 1
    assert (stats["pages_written"], stats["pages_skipped"]) == (3, 3)


@pytest.mark.parametrize("read", ["get_into", "read_layers"])
def test_a_keyless_node_never_replaces_a_sealed_page(
    make_backend: Factory, kind: str, read: str
) -> None:
    """A sealed page without a checksum is a counted `needs_key` miss for a keyless reader,
    but it is valid for the keyed ones: the keyless node's next put of the key skips it as
    present instead of replacing it, and a keyed reader still reads the original."""
    from pdcache.offload_manager.storage.layer_reads import LayerStream

    if kind == "hf3fs":
        pytest.skip("in-process metadata: a second client's index is its own open's scan")
    keyed = make_backend(page_mac_key=MAC_KEY)
    keys, pages = _keys(2), _pages(2)
    assert keyed.put_from(keys, list(pages)) == [True, True]
    keyless = make_backend(page_mac_key=None)
    if read == "read_layers" and not getattr(keyless, "streams_layers", False):
        pytest.skip("no layer-major reads on this backend")
    dest = list(torch.zeros_like(pages))
    if read == "get_into":
        assert keyless.get_into(keys, dest) == [False, False]
    else:
        assert keyless.read_layers(keys, dest, LayerStream(2, 2, 1)) == [False, False]
    assert keyless.stats()["rejected_needs_key_pages"] >= 1
    assert keyless.put_from(keys, list(_pages(2, seed=5))) == [True, True]
    stats = keyless.stats()
    assert (stats["replaced_rejected_pages"], stats["pages_written"]) == (0, 0)
    out = torch.zeros_like(pages)
    assert keyed.get_into(keys, list(out)) == [True, True]
    assert torch.equal(out, pages)


def test_a_backend_on_a_borrowed_mooncake_client_leaves_it_open(
        tmp_path, request: pytest.FixtureRequest, mooncake_clients: MooncakeClients) -> None:
    """`MooncakeStoreBackend(client=...)`: closing the backend unregisters its buffers and
    leaves the client serving: a second backend on the same client (same namespace) reads the
    first one's pages back byte-exact (with the client closed by the first, it could not)."""
    config = _config("mooncake", str(tmp_path), request)
    client = mooncake_clients.get(0)
    first = MooncakeStoreBackend(config, client=client)
    keys, pages = _keys(2), _pages(2, seed=5)
    assert first.put_from(keys, list(pages)) == [True, True]
    first.close()
    second = MooncakeStoreBackend(config, client=client)
    try:
        out = torch.zeros_like(pages)
        assert second.get_into(keys, list(out)) == [True, True] and torch.equal(out, pages)
    finally:
        second.close()
