"""The SGLang HiCache storage plugin, loaded by SGLang's own backend factory.

Needs `sglang` installed without its dependencies (see scripts/setup.sh / cpu-deps-notes.md).
SGLang's real host pool classes import torchvision and CUDA-only modules, so the host pool
here is `SglangLikeHostPool`: the buffer shapes and flat-page methods of SGLang 0.5.23's
MHATokenToKVPoolHost / MLATokenToKVPoolHost, nothing else (what the plugin reads).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

hicache_storage = pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang is not installed (pip install --no-deps sglang==0.5.23 + light deps)",
)
backend_factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from pdcache.engine.kv_geometry import KVGeometry  # noqa: E402
from pdcache.engine.page_keys import kv_fingerprint  # noqa: E402
from pdcache.integrations import sglang as plugin  # noqa: E402
from pdcache.offload_manager.host_pool import HostKVPool  # noqa: E402
from pdcache.offload_manager.storage import BACKENDS, create_backend  # noqa: E402
from pdcache.offload_manager.storage.config import (  # noqa: E402
    StorageConfig,
    storage_keys_from_spec,
)
from pdcache.offload_manager.storage.page_format import HEADER_BYTES, encode_object  # noqa: E402
from tests.storage_doubles import FaultyFileBackend  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4
NUM_PAGES = 12
FAULTY = "faulty-file"  # FaultyFileBackend's registry name (`faulty_backend`)


class SglangLikeHostPool:
    """SGLang's host pool surface the plugin uses: layout, geometry, kv_buffer, flat pages."""

    def __init__(self, layout: str, mla: bool = False, dtype: torch.dtype = torch.float32,
                 seed: int | None = None) -> None:
        self.layout, self.page_size, self.dtype = layout, PAGE, dtype
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = LAYERS, HEADS, HEAD_DIM, HEAD_DIM
        self.page_num, self.size = NUM_PAGES, NUM_PAGES * PAGE
        if mla:
            self.kv_cache_dim = 24
        self.kv_buffer = torch.zeros(self._dims(mla), dtype=dtype)
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=gen))

    def _dims(self, mla: bool) -> tuple[int, ...]:
        n, s, pages, L, H, D = self.size, PAGE, NUM_PAGES, LAYERS, HEADS, HEAD_DIM
        if mla:
            dim = self.kv_cache_dim
            return {"layer_first": (L, n, 1, dim), "page_first": (n, L, 1, dim),
                    "page_first_direct": (pages, L, s, 1, dim)}[self.layout]
        return {"layer_first": (2, L, n, H, D), "page_first": (2, n, L, H, D),
                "page_first_direct": (2, pages, L, s, H, D),
                "page_head": (2, pages, H, s, L, D)}[self.layout]

    def _page(self, index: int) -> torch.Tensor:
        mla = hasattr(self, "kv_cache_dim")
        kv = self.kv_buffer if mla else self.kv_buffer[0:2]  # MHA: K and V axis first
        if self.layout == "layer_first":
            return kv[:, index : index + PAGE] if mla else kv[:, :, index : index + PAGE]
        if self.layout == "page_first":
            return kv[index : index + PAGE] if mla else kv[:, index : index + PAGE]
        return kv[index // PAGE] if mla else kv[:, index // PAGE]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self._page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.view(page.shape))

    def kv(self, layer: int, kv: int, token: int) -> torch.Tensor:
        """K (kv=0) or V (kv=1) of all heads of one host token, read the layout's own way."""
        if self.layout == "layer_first":
            return self.kv_buffer[kv, layer, token]
        if self.layout == "page_first":
            return self.kv_buffer[kv, token, layer]
        page, offset = divmod(token, PAGE)
        if self.layout == "page_first_direct":
            return self.kv_buffer[kv, page, layer, offset]
        return self.kv_buffer[kv, page, :, offset, layer]


def sglang_config(extra: dict, model: str = "org/model", tp_rank: int = 0, tp_size: int = 1,
                  mla: bool = False, **more: int):
    return hicache_storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model, extra_config=dict(extra), **more,
    )


def storage_table(tmp_path: Path, backend: str) -> dict:
    """A storage table: hf3fs, or a directory backend (`file`, or `FAULTY`: the file backend
    with switchable faults, registered by the `faulty_backend` fixture)."""
    if backend == "hf3fs":
        return {"backend": "hf3fs", "path": str(tmp_path / "hf3fs"), "capacity_pages": 64,
                "io_engine": "posix", "metadata": "inproc", "num_data_files": 2}
    return {"backend": backend, "path": str(tmp_path / "file")}


def make_plugin(tmp_path: Path, pool: SglangLikeHostPool, backend: str = "file", **kw):
    """The plugin exactly as SGLang builds it: factory, then register_mem_pool_host."""
    extra = plugin.extra_config(storage=storage_table(tmp_path, backend))
    extra = json.loads(json.dumps(extra))  # what arrives through the CLI flag
    config = sglang_config(extra, **kw)
    backend_obj = backend_factory.StorageBackendFactory.create_backend("dynamic", config, pool)
    backend_obj.register_mem_pool_host(pool)
    return backend_obj


@pytest.fixture
def faulty_backend() -> Iterator[str]:
    """The name of `FaultyFileBackend` in the storage registry, for a test's storage table."""
    BACKENDS.register(FAULTY, "tests.storage_doubles:FaultyFileBackend")
    try:
        yield FAULTY
    finally:
        BACKENDS.unregister(FAULTY)


@pytest.fixture
def plugins():
    opened = []
    yield opened
    for p in opened:
        p.close()


def open_plugin(plugins, *args, **kw):
    p = make_plugin(*args, **kw)
    plugins.append(p)
    return p


def hashes(n: int, start: int = 0) -> list[str]:
    tokens = list(range(start, start + n * PAGE))
    return plugin.sglang_chain_hashes(tokens, PAGE)


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


# ---------------------------------------------------------------------------- loading


def test_factory_loads_plugin_class(tmp_path, plugins):
    pool = SglangLikeHostPool("page_first", seed=1)
    backend = open_plugin(plugins, tmp_path, pool)
    assert isinstance(backend, hicache_storage.HiCacheStorage)
    assert type(backend).__name__ == plugin.CLASS_NAME
    assert backend.fingerprint == kv_fingerprint("org/model", "float32", PAGE, LAYERS, HEADS,
                                                 HEAD_DIM, "page_first", 0, 1)
    assert backend.storage_config.page_bytes == LAYERS * 2 * PAGE * HEADS * HEAD_DIM * 4


def test_missing_storage_section_is_a_clear_error(tmp_path):
    config = sglang_config({"backend_name": "pdcache", "module_path": plugin.MODULE_PATH,
                            "class_name": plugin.CLASS_NAME})
    with pytest.raises(ValueError, match="pdcache_config"):
        backend_factory.StorageBackendFactory.create_backend("dynamic", config, None)


def test_pdcache_toml_configures_the_plugin(tmp_path, plugins):
    toml = tmp_path / "storage.toml"
    toml.write_text(f'[storage]\nbackend = "file"\npath = "{tmp_path / "fromtoml"}"\n')
    config = sglang_config(plugin.extra_config(pdcache_config=str(toml)))
    backend = backend_factory.StorageBackendFactory.create_backend("dynamic", config, None)
    plugins.append(backend)
    backend.register_mem_pool_host(SglangLikeHostPool("page_first"))
    assert backend.storage_config.backend == "file"
    assert backend.storage_config.path == str(tmp_path / "fromtoml")


def test_topology_storage_table_maps_to_storage_config():
    from pdcache.config import load_topology

    root = Path(__file__).resolve().parents[2]
    spec = load_topology(root / "configs" / "local-1p1d.toml").storage
    table = storage_keys_from_spec(spec)
    config = StorageConfig.from_mapping({**table, "page_bytes": 4096})
    assert (config.backend, config.metadata, config.capacity_bytes) == (
        spec.backend, spec.metadata, spec.capacity)
    assert not any(k.startswith("mooncake_") for k in table)  # hf3fs: no mooncake keys
    store = load_topology(root / "configs" / "local-mooncake-store.toml").storage
    mooncake = storage_keys_from_spec(store)
    assert (mooncake["mooncake_master"], mooncake["mooncake_metadata"]) == (
        store.mooncake.master, store.mooncake.metadata_server)


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_generic_round_trip_is_byte_exact(tmp_path, plugins, backend):
    src = SglangLikeHostPool("page_first", seed=2)
    store = open_plugin(plugins, tmp_path, src, backend)
    keys = hashes(3)
    pages = [src.get_data_page(p * PAGE) for p in (1, 4, 7)]
    assert store.batch_set(keys, pages) is True
    assert store.batch_exists(keys) == 3
    assert store.batch_exists(keys + hashes(1, start=999)) == 3
    assert store.exists(keys[0]) and not store.exists(hashes(1, start=999)[0])
    got = store.batch_get(keys, [src.get_dummy_flat_data_page() for _ in keys])
    for page, out in zip(pages, got):
        assert out is not None and torch.equal(out, page)
    assert store.batch_get(hashes(1, start=999), [src.get_dummy_flat_data_page()]) == [None]


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct",
                                    "page_head"])
def test_zero_copy_round_trip_per_layout(tmp_path, plugins, layout):
    src = SglangLikeHostPool(layout, seed=3)
    dst = SglangLikeHostPool(layout)
    writer = open_plugin(plugins, tmp_path, src, "hf3fs")
    keys = hashes(4)
    assert writer.batch_set_v1(keys, indices([0, 3, 5, 9])) == [True] * 4
    writer.close()
    reader = open_plugin(plugins, tmp_path, dst, "hf3fs")  # reopened: index rebuilt from disk
    assert reader.batch_exists(keys) == 4
    assert reader.batch_get_v1(keys, indices([2, 3, 4, 11])) == [True] * 4
    for s, d in zip([0, 3, 5, 9], [2, 3, 4, 11]):
        assert torch.equal(src.get_data_page(s * PAGE), dst.get_data_page(d * PAGE))
    assert torch.count_nonzero(dst.get_data_page(0)) == 0  # untouched page stays untouched


def test_pages_are_shared_across_host_layouts(tmp_path, plugins):
    src = SglangLikeHostPool("page_first", seed=4)
    dst = SglangLikeHostPool("layer_first")
    writer = open_plugin(plugins, tmp_path, src)
    reader = open_plugin(plugins, tmp_path, dst)
    keys = hashes(2)
    assert writer.batch_set_v1(keys, indices([1, 2])) == [True, True]
    assert reader.batch_get_v1(keys, indices([6, 7])) == [True, True]
    for s, d in ((1, 6), (2, 7)):
        for layer in range(LAYERS):
            for kv in (0, 1):
                for t in range(PAGE):
                    assert torch.equal(src.kv(layer, kv, s * PAGE + t), dst.kv(layer, kv, d * PAGE + t))


def test_mla_pages_are_shared_by_tp_ranks_and_written_once(tmp_path, plugins):
    src = SglangLikeHostPool("page_first", mla=True, seed=5)
    rank0 = open_plugin(plugins, tmp_path, src, tp_rank=0, tp_size=2, mla=True)
    rank1 = open_plugin(plugins, tmp_path, SglangLikeHostPool("page_first_direct", mla=True),
                        tp_rank=1, tp_size=2, mla=True)
    keys = hashes(2)
    assert rank1.batch_set_v1(keys, indices([0, 1])) == [True, True]  # not the writer: no-op
    assert rank0.batch_exists(keys) == 0
    assert rank0.batch_set_v1(keys, indices([3, 4])) == [True, True]
    assert rank1.batch_get_v1(keys, indices([5, 6])) == [True, True]
    assert torch.equal(src.kv_buffer[3 * PAGE : 5 * PAGE].permute(1, 0, 2, 3),
                       rank1.mem_pool_host.kv_buffer[5:7].permute(1, 0, 2, 3, 4).reshape(
                           LAYERS, 2 * PAGE, 1, 24))


def test_decode_context_parallel_shards_never_read_each_other(tmp_path, plugins):
    """With DCP each rank holds another shard of an MLA page and SGLang makes one writer per
    shard; the plugin named them alike (MLA: replicated over TP), so rank 1 found rank 0's
    shard under its key, read its bytes (verified: another shard's K/V) and skipped its own
    write. Each DCP rank's pages carry its rank now."""
    shards = [SglangLikeHostPool("page_first", mla=True, seed=seed) for seed in (1, 2)]
    ranks = [open_plugin(plugins, tmp_path, shards[r], tp_rank=r, tp_size=2, mla=True,
                         dcp_rank=r, dcp_size=2, logical_page_size=2 * PAGE) for r in (0, 1)]
    assert ranks[0].fingerprint != ranks[1].fingerprint
    keys = hashes(1)
    assert ranks[0].batch_set_v1(keys, indices([0])) == [True]
    assert ranks[1].batch_exists(keys) == 0  # rank 0's shard is not rank 1's


def test_mla_fingerprint_is_a_pdcache_mla_nodes(tmp_path, plugins):
    """SGLang's MLA host pages hold pdcache's latent page bytes (one row of kv_cache_dim per
    token and layer), so the plugin names them as a pdcache MLA node of the same model does:
    both read each other's pages; an MHA node of the same bytes per page never does."""
    store = open_plugin(plugins, tmp_path, SglangLikeHostPool("page_first", mla=True), mla=True)
    latent = KVGeometry.mla(LAYERS, kv_lora_rank=16, rope_dim=8, dtype="float32")
    assert store.fingerprint == latent.fingerprint("org/model", PAGE)
    same_bytes = KVGeometry.mha(LAYERS, kv_heads=1, head_dim=12, dtype="float32")
    assert same_bytes.page_bytes(PAGE) == latent.page_bytes(PAGE)
    assert store.fingerprint != same_bytes.fingerprint("org/model", PAGE)
    assert store.storage_config.page_bytes == latent.page_bytes(PAGE)


# ---------------------------------------------------------------------------- safety


@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_corrupt_page_is_a_miss(tmp_path, plugins, backend):
    src = SglangLikeHostPool("page_first", seed=6)
    dst = SglangLikeHostPool("page_first")
    store = open_plugin(plugins, tmp_path, src, backend)
    keys = hashes(3)
    assert store.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    bad = store.storage_keys([keys[1]])[0]
    blob = bytearray(store.backend.read_object(bad))
    blob[-1] ^= 0xFF  # last payload byte
    assert store.backend.write_object(bad, bytes(blob))
    store.mem_pool_host = dst  # read into a clean pool
    assert store.batch_get_v1(keys, indices([4, 5, 6])) == [True, False, True]
    assert torch.count_nonzero(dst.get_data_page(5 * PAGE)) == 0
    assert store.pdcache_stats()["corrupt_pages"] == 1


def test_two_models_never_share_pages(tmp_path, plugins):
    src = SglangLikeHostPool("page_first", seed=7)
    a = open_plugin(plugins, tmp_path, src, model="org/model-a")
    b = open_plugin(plugins, tmp_path, SglangLikeHostPool("page_first"), model="org/model-b")
    a2 = open_plugin(plugins, tmp_path, SglangLikeHostPool("page_first"), model="org/model-a")
    keys = hashes(2)
    assert a.batch_set_v1(keys, indices([0, 1])) == [True, True]
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, indices([0, 1])) == [False, False]
    assert a2.batch_get_v1(keys, indices([0, 1])) == [True, True]


def test_tp_shards_never_collide(tmp_path, plugins):
    shard0 = SglangLikeHostPool("page_first", seed=8)
    shard1 = SglangLikeHostPool("page_first", seed=9)
    p0 = open_plugin(plugins, tmp_path, shard0, tp_rank=0, tp_size=2)
    p1 = open_plugin(plugins, tmp_path, shard1, tp_rank=1, tp_size=2)
    solo = open_plugin(plugins, tmp_path, SglangLikeHostPool("page_first"), tp_rank=0, tp_size=1)
    keys = hashes(2)
    assert p0.batch_set_v1(keys, indices([0, 1])) == [True, True]
    assert p1.batch_exists(keys) == 0 and solo.batch_exists(keys) == 0
    assert p1.batch_set_v1(keys, indices([0, 1])) == [True, True]
    fresh = SglangLikeHostPool("page_first")
    p0.mem_pool_host = fresh
    assert p0.batch_get_v1(keys, indices([0, 1])) == [True, True]
    assert torch.equal(fresh.kv_buffer[:, : 2 * PAGE], shard0.kv_buffer[:, : 2 * PAGE])
    assert not torch.equal(fresh.kv_buffer[:, : 2 * PAGE], shard1.kv_buffer[:, : 2 * PAGE])


def test_v1_failures_are_per_key_false_never_none(tmp_path, plugins, faulty_backend):
    pool = SglangLikeHostPool("page_first", seed=10)
    store = open_plugin(plugins, tmp_path, pool, backend=faulty_backend)
    keys = hashes(2)
    assert store.batch_set_v1(keys, indices([0, 1])) == [True, True]
    assert store.batch_get_v1(keys, indices([0])) == [False, False]  # wrong index count
    assert store.batch_get_v1(["not-hex", keys[1]], indices([2, 3])) == [False, True]
    assert store.batch_get_v1(["not-hex"], indices([2])) == [False]  # no valid key: no IO
    assert store.batch_set_v1(["not-hex"], indices([2])) == [False]
    assert store.batch_exists(["not-hex", keys[1]]) == 0

    assert isinstance(store.backend, FaultyFileBackend)
    store.backend.down = True  # get_into, put_from and exists_prefix raise OSError
    assert store.batch_get_v1(keys, indices([2, 3])) == [False, False]
    assert store.batch_set_v1(keys, indices([2, 3])) == [False, False]
    assert store.batch_exists(keys) == 0
    assert store.batch_get(keys, None) == [None, None]
    assert store.pdcache_stats()["plugin_errors"] == 5
    unregistered = plugin.PdcacheHiCacheStorage(sglang_config(plugin.extra_config(
        storage=storage_table(tmp_path, "file"))), {})
    assert unregistered.batch_get_v1(keys, indices([0, 1])) == [False, False]


def test_batches_move_in_parallel_chunks_byte_exact(tmp_path, plugins):
    """A batch larger than a chunk is cut over the IO threads; every page lands in place."""
    src, dst = SglangLikeHostPool("page_first", seed=22), SglangLikeHostPool("page_first")
    extra = plugin.extra_config(storage=storage_table(tmp_path, "hf3fs"), chunk_bytes=1,
                                io_threads=3)
    store = backend_factory.StorageBackendFactory.create_backend("dynamic", sglang_config(extra), src)
    plugins.append(store)
    store.register_mem_pool_host(src)
    keys, pages = hashes(NUM_PAGES), list(range(NUM_PAGES))
    assert len(store._chunks(keys)) == NUM_PAGES  # one page per chunk (chunk_bytes=1)
    assert store.batch_set_v1(keys, indices(pages)) == [True] * NUM_PAGES
    store.mem_pool_host = dst
    assert store.batch_get_v1(keys, indices(pages[::-1])) == [True] * NUM_PAGES
    for page in pages:
        last = NUM_PAGES - 1 - page
        assert torch.equal(dst.get_data_page(last * PAGE), src.get_data_page(page * PAGE))


def test_read_past_its_deadline_never_touches_the_host_pool(tmp_path, plugins, faulty_backend):
    """SGLang reuses the host pages of a failed read at once: a backend read that finishes
    after the plugin gave up must not copy into them."""
    import threading

    src = SglangLikeHostPool("page_first", seed=23)
    extra = plugin.extra_config(storage=storage_table(tmp_path, faulty_backend), io_timeout_s=0.2)
    store = backend_factory.StorageBackendFactory.create_backend("dynamic", sglang_config(extra), src)
    plugins.append(store)
    store.register_mem_pool_host(src)
    keys = hashes(2)
    assert store.batch_set_v1(keys, indices([0, 1])) == [True, True]
    release = threading.Event()
    assert isinstance(store.backend, FaultyFileBackend)
    store.backend.read_gate = release  # every read waits for it (10 s at most)
    dst = SglangLikeHostPool("page_first")
    store.mem_pool_host = dst
    assert store.batch_get_v1(keys, indices([2, 3])) == [False, False]
    release.set()
    store._io.shutdown(wait=True)  # the late reads have finished
    assert not dst.kv_buffer.any()
    assert store.pdcache_stats()["plugin_errors"] == 1


def test_split_read_past_its_deadline_is_waited_for(tmp_path, plugins, faulty_backend):
    """Zero-copy IO cannot be held back: a split read running past io_timeout_s is a miss,
    and the call returns only once it stopped touching the pool."""
    import time

    src = SglangLikeHostPool("page_first", seed=29)
    extra = plugin.extra_config(storage=storage_table(tmp_path, faulty_backend), payload="split",
                                io_timeout_s=0.2)
    store = backend_factory.StorageBackendFactory.create_backend("dynamic", sglang_config(extra), src)
    plugins.append(store)
    store.register_mem_pool_host(src)
    keys = hashes(2)
    assert store.batch_set_v1(keys, indices([0, 1])) == [True, True]
    backend = store.backend
    assert isinstance(backend, FaultyFileBackend)
    backend.read_delay_s = 0.6
    started = time.monotonic()
    found = store.batch_get_v1(keys, indices([2, 3]))
    # The first chunk ran past the deadline: a miss; any IO that started has ended by now.
    assert found[0] is False and backend.reads_finished == backend.reads_started >= 1
    assert time.monotonic() - started >= 0.6
    assert store.pdcache_stats()["plugin_errors"] == 1


def test_one_deadline_per_call_not_per_chunk(tmp_path, plugins, faulty_backend):
    """A hung backend holds SGLang's thread for io_timeout_s once, not once per chunk."""
    import threading
    import time

    src = SglangLikeHostPool("page_first", seed=31)
    extra = plugin.extra_config(storage=storage_table(tmp_path, faulty_backend), io_timeout_s=0.3,
                                chunk_bytes=1, io_threads=2)
    store = backend_factory.StorageBackendFactory.create_backend("dynamic", sglang_config(extra), src)
    plugins.append(store)
    store.register_mem_pool_host(src)
    keys = hashes(NUM_PAGES)
    assert store.batch_set_v1(keys, indices(list(range(NUM_PAGES)))) == [True] * NUM_PAGES
    release = threading.Event()
    assert isinstance(store.backend, FaultyFileBackend)
    store.backend.read_gate = release  # every read hangs until the test ends (10 s at most)
    assert len(store._chunks(keys)) > 2
    started = time.monotonic()
    try:
        assert store.batch_get_v1(keys, indices(list(range(NUM_PAGES)))) == [False] * NUM_PAGES
        assert time.monotonic() - started < 0.3 * 2
    finally:
        release.set()


# ---------------------------------------------------------------------------- interop


def test_chain_matches_sglang_hash_functions():
    utils = pytest.importorskip("sglang.srt.mem_cache.utils")
    tokens = list(range(100, 100 + 3 * PAGE + 1))
    try:
        theirs = utils.get_hash_str(tokens[: 3 * PAGE], None, page_size=PAGE)
    except RuntimeError as exc:  # the native hash extension needs a C++ compiler + OpenSSL
        pytest.skip(f"SGLang's native hash extension does not build here: {exc}")
    assert plugin.sglang_chain_hashes(tokens, PAGE) == theirs
    seed = utils.storage_namespace_seed(None, "tenant-1")
    assert plugin.sglang_namespace_seed("tenant-1").hex() == seed
    salted = utils.get_hash_str(tokens[: 3 * PAGE], seed, page_size=PAGE)
    assert plugin.sglang_chain_hashes(tokens, PAGE, cache_salt="tenant-1") == salted
    assert salted != theirs
    tail = plugin.sglang_chain_hashes(tokens[PAGE:], PAGE, prior_hash=theirs[0])
    assert tail == theirs[1:]


def pdcache_side(tmp_path: Path, model: str, backend: str, page_mac_key: bytes | None = None):
    """A pdcache node's view: its own backend over the same storage, its own host pool."""
    fingerprint = kv_fingerprint(model, "float32", PAGE, LAYERS, HEADS, HEAD_DIM)
    host = HostKVPool(4, KVGeometry.mha(LAYERS, HEADS, HEAD_DIM, "float32"), PAGE)
    config = StorageConfig.from_mapping({
        **storage_table(tmp_path, backend), "page_bytes": host.page_nbytes,
        "fingerprint": fingerprint, "num_layers": LAYERS, "page_size": PAGE, "dtype": "float32"})
    return create_backend(config.replace(page_mac_key=page_mac_key)), host, fingerprint


@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_sglang_writes_pdcache_reads(tmp_path, plugins, backend):
    tokens = list(range(7, 7 + 3 * PAGE))
    src = SglangLikeHostPool("page_first", seed=11)
    store = open_plugin(plugins, tmp_path, src, backend, model="org/model")
    assert store.batch_set_v1(plugin.sglang_chain_hashes(tokens, PAGE), indices([2, 0, 5])) == [True] * 3
    store.close()
    native, host, fingerprint = pdcache_side(tmp_path, "org/model", backend)
    try:
        keys = plugin.sglang_compatible_page_keys(tokens, PAGE, fingerprint)
        assert native.exists_prefix(keys) == 3
        origins: list[str | None] = []
        assert native.get_into(keys, host.page_bytes([1, 2, 3]), origins) == [True] * 3
        assert origins == ["prefill"] * 3
        for page, first in zip([1, 2, 3], [2, 0, 5]):
            for layer in range(LAYERS):
                for kv in (0, 1):
                    for t in range(PAGE):
                        assert torch.equal(host.host_kv[page, layer, kv, t],
                                           src.kv(layer, kv, first * PAGE + t))
        other = kv_fingerprint("org/other", "float32", PAGE, LAYERS, HEADS, HEAD_DIM)
        assert native.exists_prefix(plugin.sglang_compatible_page_keys(tokens, PAGE, other)) == 0
    finally:
        native.close()


@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_pdcache_writes_sglang_reads(tmp_path, plugins, backend):
    tokens = list(range(50, 50 + 2 * PAGE + 2))  # the partial last page gets no key
    native, host, fingerprint = pdcache_side(tmp_path, "org/model", backend)
    try:
        host.host_kv.copy_(torch.randn(host.host_kv.shape, generator=torch.Generator().manual_seed(12)))
        keys = plugin.sglang_compatible_page_keys(tokens, PAGE, fingerprint)
        assert len(keys) == 2
        assert native.put_from(keys, host.page_bytes([3, 1]), origin="decode") == [True, True]
    finally:
        native.close()
    dst = SglangLikeHostPool("page_head")
    store = open_plugin(plugins, tmp_path, dst, backend, model="org/model")
    sglang_keys = plugin.sglang_chain_hashes(tokens, PAGE)
    assert store.batch_exists(sglang_keys) == 2
    assert store.batch_get_v1(sglang_keys, indices([8, 9])) == [True, True]
    for page, first in ((3, 8), (1, 9)):
        for layer in range(LAYERS):
            for kv in (0, 1):
                for t in range(PAGE):
                    assert torch.equal(dst.kv(layer, kv, first * PAGE + t),
                                       host.host_kv[page, layer, kv, t])


# ---------------------------------------------------------------------------- split payload


def make_split_plugin(tmp_path: Path, pool: SglangLikeHostPool, backend: str = "file", **kw):
    extra = plugin.extra_config(storage=storage_table(tmp_path, backend), payload="split")
    store = backend_factory.StorageBackendFactory.create_backend(
        "dynamic", sglang_config(extra, **kw), pool)
    store.register_mem_pool_host(pool)
    return store


@pytest.mark.parametrize("layout,mla", [("page_first", False), ("page_first_direct", False),
                                        ("page_first", True)])
def test_split_payload_round_trip(tmp_path, plugins, layout, mla):
    src = SglangLikeHostPool(layout, mla=mla, seed=13)
    dst = SglangLikeHostPool(layout, mla=mla)
    store = make_split_plugin(tmp_path, src, "hf3fs", mla=mla)
    plugins.append(store)
    keys = hashes(3)
    assert store.storage_config.page_bytes == store.geometry.page_bytes
    assert store.batch_set_v1(keys, indices([1, 2, 6])) == [True] * 3
    # one stored object per page: the pdcache page format over the page's runs in pool order
    # (K then V), checksum included, exactly as if the page were one contiguous buffer
    layout_order = memoryview(src.get_data_page(PAGE).view(torch.uint8).numpy())
    key = plugin.derive_storage_key(store.salt, keys[0])
    assert store.backend.read_object(key) == encode_object(store.backend.spec, key, "prefill",
                                                           layout_order)
    assert store.batch_exists(keys) == 3
    store.mem_pool_host = dst
    assert store.batch_get_v1(keys, indices([3, 4, 5])) == [True] * 3
    for s, d in ((1, 3), (2, 4), (6, 5)):
        assert torch.equal(src.get_data_page(s * PAGE), dst.get_data_page(d * PAGE))
    flat = store.batch_get(keys[:1], [src.get_dummy_flat_data_page()])[0]
    assert torch.equal(flat, src.get_data_page(PAGE))


def test_split_payload_truncated_page_is_a_miss_and_never_seen_by_pdcache_payload(tmp_path,
                                                                                  plugins):
    src = SglangLikeHostPool("page_first", seed=14)
    split = make_split_plugin(tmp_path, src)
    plugins.append(split)
    keys = hashes(2)
    assert split.batch_set_v1(keys, indices([0, 1])) == [True, True]
    key = plugin.derive_storage_key(split.salt, keys[1])
    blob = split.backend.read_object(key)
    assert split.backend.write_object(key, blob[: len(blob) // 2])  # K of page 1, no V
    assert split.batch_get_v1(keys, indices([4, 5])) == [True, False]
    reordered = open_plugin(plugins, tmp_path, SglangLikeHostPool("page_first"))
    assert reordered.batch_exists(keys) == 0


@pytest.mark.parametrize("backend,checksum", [("file", "auto"), ("file", "crc32"),
                                              ("hf3fs", "auto"), ("mooncake", "auto")])
def test_backend_stores_a_page_given_as_runs_as_the_concatenated_page(tmp_path, monkeypatch,
                                                                      backend, checksum):
    """The scatter/gather entry point the split payload uses: a host page handed over as a
    tuple of runs is the page of their concatenation (same object bytes, same checksum) and
    reads back into runs or into one buffer."""
    table = {**storage_table(tmp_path, backend), "page_bytes": 4096, "checksum": checksum,
             "fingerprint": "runs", "capacity_pages": 8}
    with ExitStack() as stack:
        if backend == "mooncake":
            pytest.importorskip("mooncake.store")
            monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
            monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
            from pdcache.offload_manager.storage.mooncake_store import LocalMooncakeMaster

            master = stack.enter_context(LocalMooncakeMaster())
            table.update(mooncake_master=master.address, mooncake_segment_bytes=16 << 20,
                         mooncake_local_buffer_bytes=16 << 20)
        store = create_backend(StorageConfig.from_mapping(table))
        stack.callback(store.close)
        src = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=torch.Generator().manual_seed(21))
        runs = (src[5000:6000], src[0:3096])  # out of order and apart
        whole = torch.cat(runs)
        by_runs, by_page = bytes(range(32)), bytes(range(1, 33))
        assert store.put_from([by_runs, by_page], [runs, whole]) == [True, True]
        for key in (by_runs, by_page):
            assert store.read_object(key) == encode_object(store.spec, key, "prefill",
                                                           memoryview(whole.numpy()))
        into_page, into_runs = torch.zeros(4096, dtype=torch.uint8), torch.zeros_like(src)
        assert store.get_into([by_runs], [into_page]) == [True]
        assert torch.equal(into_page, whole)
        assert store.get_into([by_page], [(into_runs[5000:6000], into_runs[0:3096])]) == [True]
        assert torch.equal(into_runs[5000:6000], runs[0]) and torch.equal(into_runs[:3096], runs[1])
        assert not into_runs[3096:5000].any() and not into_runs[6000:].any()


def test_split_payload_needs_contiguous_pages(tmp_path):
    with pytest.raises(ValueError, match="page_first"):
        make_split_plugin(tmp_path, SglangLikeHostPool("layer_first"))


def test_hf3fs_inproc_metadata_gives_each_rank_its_own_files(tmp_path, plugins):
    p0 = open_plugin(plugins, tmp_path, SglangLikeHostPool("page_first", seed=15), "hf3fs",
                     tp_rank=0, tp_size=2)
    p1 = open_plugin(plugins, tmp_path, SglangLikeHostPool("page_first", seed=16), "hf3fs",
                     tp_rank=1, tp_size=2)
    assert p0.storage_config.namespace != p1.storage_config.namespace
    keys = hashes(2)
    assert p0.batch_set_v1(keys, indices([0, 1])) == [True, True]
    assert p1.batch_set_v1(keys, indices([0, 1])) == [True, True]
    fresh = SglangLikeHostPool("page_first")
    p0.mem_pool_host = fresh
    assert p0.batch_get_v1(keys, indices([0, 1])) == [True, True]
    assert torch.equal(fresh.kv_buffer[:, : 2 * PAGE], SglangLikeHostPool("page_first", seed=15).kv_buffer[:, : 2 * PAGE])
    with pytest.raises(ValueError, match="metadata service"):
        make_plugin(tmp_path, SglangLikeHostPool("page_first", mla=True), "hf3fs",
                    tp_rank=0, tp_size=2, mla=True)


def test_hf3fs_inproc_metadata_gives_each_dp_attention_rank_its_own_files(tmp_path, plugins):
    """DP-attention ranks are processes with the same tp_rank: they opened one set of files
    with in-process metadata and overwrote each other's slots (their pages then missed)."""
    dp0 = open_plugin(plugins, tmp_path, SglangLikeHostPool("page_first", seed=17), "hf3fs",
                      dp_rank=0)
    dp1 = open_plugin(plugins, tmp_path, SglangLikeHostPool("page_first", seed=18), "hf3fs",
                      dp_rank=1)
    assert dp0.storage_config.namespace != dp1.storage_config.namespace
    assert dp0.fingerprint == dp1.fingerprint  # the same KV: shared through the service
    first, second = hashes(2), hashes(2, start=100)
    assert dp0.batch_set_v1(first, indices([0, 1])) == [True, True]
    assert dp1.batch_set_v1(second, indices([0, 1])) == [True, True]
    fresh = SglangLikeHostPool("page_first")
    dp0.mem_pool_host = fresh
    assert dp0.batch_get_v1(first, indices([0, 1])) == [True, True]
    assert torch.equal(fresh.kv_buffer[:, : 2 * PAGE],
                       SglangLikeHostPool("page_first", seed=17).kv_buffer[:, : 2 * PAGE])
    with pytest.raises(ValueError, match="metadata service"):
        make_plugin(tmp_path, SglangLikeHostPool("page_first", mla=True), "hf3fs",
                    mla=True, dp_rank=1)


@pytest.mark.slow
def test_live_sharing_through_the_metadata_service(tmp_path, plugins):
    """SGLang (plugin) and a pdcache node open the same hf3fs store at once, as in production."""
    from pdcache.offload_manager.storage.metadata_service import LocalMetadataService

    with LocalMetadataService(tmp_path / "meta") as service:
        table = {**storage_table(tmp_path, "hf3fs"), "metadata": service.address}
        extra = plugin.extra_config(storage=table)
        src = SglangLikeHostPool("page_first", seed=17)
        store = backend_factory.StorageBackendFactory.create_backend(
            "dynamic", sglang_config(extra), src)
        plugins.append(store)
        store.register_mem_pool_host(src)
        fingerprint = kv_fingerprint("org/model", "float32", PAGE, LAYERS, HEADS, HEAD_DIM)
        host = HostKVPool(4, KVGeometry.mha(LAYERS, HEADS, HEAD_DIM, "float32"), PAGE)
        native = create_backend(StorageConfig.from_mapping({
            **table, "page_bytes": host.page_nbytes, "fingerprint": fingerprint,
            "num_layers": LAYERS, "page_size": PAGE, "dtype": "float32"}))
        try:
            prompt = list(range(300, 300 + 2 * PAGE))
            answer = prompt + list(range(900, 900 + 2 * PAGE))
            assert store.batch_set_v1(plugin.sglang_chain_hashes(prompt, PAGE), indices([0, 1])) == [True] * 2
            keys = plugin.sglang_compatible_page_keys(answer, PAGE, fingerprint)
            assert native.exists_prefix(keys) == 2  # the prompt, written by SGLang
            host.host_kv.copy_(torch.randn(host.host_kv.shape, generator=torch.Generator().manual_seed(18)))
            assert native.put_from(keys[2:], host.page_bytes([0, 1]), origin="decode") == [True] * 2
            sglang_keys = plugin.sglang_chain_hashes(answer, PAGE)
            assert store.batch_exists(sglang_keys) == 4
            assert store.batch_get_v1(sglang_keys[2:], indices([6, 7])) == [True] * 2
            for page, first in ((0, 6), (1, 7)):
                for layer in range(LAYERS):
                    assert torch.equal(src.kv(layer, 1, first * PAGE), host.host_kv[page, layer, 1, 0])
        finally:
            native.close()


def test_bench_runs_and_checks_bytes(tmp_path, capsys):
    from pdcache.bench import sglang_plugin_bench

    out = tmp_path / "bench.json"
    argv = ["--backends", "file,hf3fs", "--pages", "6", "--layers", "2", "--kv-heads", "2",
            "--head-dim", "8", "--page-size", "4", "--repeat", "1", "--generic",
            "--dir", str(tmp_path), "--json", str(out)]
    assert sglang_plugin_bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    native, parallel, reordered, split, generic = ("native: one call", "native: batch over",
                                                   "plugin v1, payload=pdcache",
                                                   "plugin v1, payload=split", "plugin flat")
    expected = [native, parallel, reordered, split, generic] * 2
    assert [r["path"].startswith(e) for r, e in zip(rows, expected)] == [True] * 10
    assert all(r["read_GBps"] > 0 and r["read_GBps_med"] > 0 for r in rows)
    assert all("read_overhead_med" in r and "read_overhead_par" in r for r in rows[2:5])
    assert "SGLang plugin vs native" in capsys.readouterr().out


def test_clear_needs_allow_clear(tmp_path, plugins):
    pool = SglangLikeHostPool("page_first", seed=19)
    store = open_plugin(plugins, tmp_path, pool)
    keys = hashes(2)
    assert store.batch_set_v1(keys, indices([0, 1])) == [True, True]
    store.clear()
    assert store.batch_exists(keys) == 2
    extra = plugin.extra_config(storage=storage_table(tmp_path, "file"), allow_clear=True)
    admin = backend_factory.StorageBackendFactory.create_backend("dynamic", sglang_config(extra), pool)
    plugins.append(admin)
    admin.register_mem_pool_host(pool)
    admin.clear()
    assert store.batch_exists(keys) == 0


# ---------------------------------------------------------------------------- authenticated pages


@pytest.mark.parametrize("mac", [True, False], ids=["mac_on", "mac_off"])
@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_secret_file_macs_pages_like_pdcache_and_rejects_forgeries(tmp_path, plugins, backend,
                                                                   mac):
    from pdcache.utils.secret import create_secret, derive_key, load_secret

    secret = create_secret(tmp_path / "secret")
    src = SglangLikeHostPool("page_first", seed=21)
    options = {"secret_file": str(secret)} if mac else {}
    extra = plugin.extra_config(storage=storage_table(tmp_path, backend), **options)
    store = backend_factory.StorageBackendFactory.create_backend(
        "dynamic", sglang_config(json.loads(json.dumps(extra))), src)
    plugins.append(store)
    store.register_mem_pool_host(src)
    assert store.storage_config.page_mac_key == (
        derive_key(load_secret(secret), "page-mac") if mac else None)
    keys = hashes(3)
    assert store.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    # a forgery: another page's payload under keys[1], valid checksum, no MAC (version 1)
    forged_key, donor_key = store.storage_keys([keys[1], keys[2]])
    no_mac = store.storage_config.replace(page_mac_key=None).page_spec()
    donor = store.backend.read_object(donor_key)[HEADER_BYTES:]
    assert store.backend.write_object(forged_key,
                                      encode_object(no_mac, forged_key, "prefill", donor))
    dst = SglangLikeHostPool("page_first")
    store.mem_pool_host = dst
    got = store.batch_get_v1(keys, indices([4, 5, 6]))
    stats = store.pdcache_stats()
    if mac:
        assert got == [True, False, True] and stats["rejected_mac_pages"] == 1
        assert torch.count_nonzero(dst.get_data_page(5 * PAGE)) == 0
    else:
        assert got == [True, True, True] and stats["rejected_mac_pages"] == 0
        assert torch.equal(dst.get_data_page(5 * PAGE), dst.get_data_page(6 * PAGE))


def test_plugin_authenticates_to_a_secured_metadata_service(tmp_path, plugins):
    """`pdcache launch` starts the metadata service with the cluster secret: the plugin given
    that secret derived only the page MAC key, so the service refused its every request and
    SGLang could not attach its storage (register_mem_pool_host raised)."""
    from pdcache.offload_manager.storage.metadata_service import LocalMetadataService
    from pdcache.utils.secret import create_secret

    secret = create_secret(tmp_path / "secret")
    with LocalMetadataService(tmp_path / "meta", secret_file=secret) as service:
        table = {**storage_table(tmp_path, "hf3fs"), "metadata": service.address}
        src = SglangLikeHostPool("page_first", seed=23)
        extra = plugin.extra_config(storage=table, secret_file=str(secret))
        store = backend_factory.StorageBackendFactory.create_backend(
            "dynamic", sglang_config(json.loads(json.dumps(extra))), src)
        plugins.append(store)
        store.register_mem_pool_host(src)
        keys = hashes(2)
        assert store.batch_set_v1(keys, indices([0, 1])) == [True, True]
        assert store.batch_exists(keys) == 2


def test_a_topology_s_secret_reaches_the_plugin(tmp_path, plugins):
    """`pdcache_config` naming a topology took its [storage] only: its [security] secret_file
    was dropped and the plugin wrote unsealed pages the deployment's nodes refuse."""
    from pdcache.utils.secret import create_secret, derive_key, load_secret

    secret = create_secret(tmp_path / "secret")
    root = Path(__file__).resolve().parents[2]
    text = (root / "configs" / "unified.toml").read_text()
    topology = tmp_path / "topology.toml"
    topology.write_text(f'[security]\nsecret_file = "{secret}"\n\n{text}')
    config = sglang_config(plugin.extra_config(pdcache_config=str(topology),
                                               storage=storage_table(tmp_path, "file")))
    store = backend_factory.StorageBackendFactory.create_backend("dynamic", config, None)
    plugins.append(store)
    store.register_mem_pool_host(SglangLikeHostPool("page_first"))
    assert store.storage_config.page_mac_key == derive_key(load_secret(secret), "page-mac")
    assert store.storage_config.metadata_key == derive_key(load_secret(secret), "metadata")


def test_plugin_pages_verify_under_the_pdcache_node_key(tmp_path, plugins):
    """Same secret, same MAC: a pdcache node with the derived key reads what the plugin wrote;
    one with another secret's key rejects every page."""
    from pdcache.utils.secret import create_secret, derive_key, load_secret

    secret = create_secret(tmp_path / "secret")
    tokens = list(range(7, 7 + 3 * PAGE))
    src = SglangLikeHostPool("page_first", seed=22)
    extra = plugin.extra_config(storage=storage_table(tmp_path, "file"), secret_file=str(secret))
    store = backend_factory.StorageBackendFactory.create_backend(
        "dynamic", sglang_config(extra), src)
    plugins.append(store)
    store.register_mem_pool_host(src)
    assert store.batch_set_v1(plugin.sglang_chain_hashes(tokens, PAGE), indices([2, 0, 5])) == [
        True] * 3
    for key, served in ((derive_key(load_secret(secret), "page-mac"), True),
                        (derive_key(b"another cluster's secret", "page-mac"), False)):
        native, host, fingerprint = pdcache_side(tmp_path, "org/model", "file", key)
        try:
            keys = plugin.sglang_compatible_page_keys(tokens, PAGE, fingerprint)
            assert native.get_into(keys, host.page_bytes([1, 2, 3])) == [served] * 3
            assert native.stats()["rejected_mac_pages"] == (0 if served else 3)
        finally:
            native.close()
