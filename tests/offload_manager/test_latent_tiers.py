"""MLA latent pages (one slab per layer) through every tier byte for byte: device → host →
storage (hf3fs, file, Mooncake Store) written by one HiCache, then prefetched by a fresh one
(new host pool, new device pool) and loaded back onto the device."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.kv_pool import PageAllocator
from pdcache.offload_manager.hicache import HiCache, HiCacheConfig
from pdcache.offload_manager.hiradix import HiRadixTree
from pdcache.offload_manager.host_pool import HostKVPool
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig

PAGE, DEVICE_PAGES = 4, 16
GEOMETRY = KVGeometry.mla(3, kv_lora_rank=24, rope_dim=8, dtype="bfloat16")
TOKENS = list(range(50, 50 + 5 * PAGE))


class Tiers:
    """A latent device pool, its host pool and HiCache over `storage`."""

    def __init__(self, storage) -> None:
        shape = GEOMETRY.device_shape(DEVICE_PAGES, PAGE)
        self.device_kv = torch.zeros(shape, dtype=torch.bfloat16)
        self.alloc = PageAllocator(DEVICE_PAGES)
        self.host = HostKVPool(8, GEOMETRY, PAGE)
        self.tree = HiRadixTree(PAGE, self.alloc, self.host)
        config = HiCacheConfig(prefetch_policy="wait_complete")
        self.cache = HiCache(self.tree, self.device_kv, storage, config,
                             GEOMETRY.fingerprint("latent-test", PAGE))
        self.cache.start()

    def close(self) -> None:
        assert self.cache.wait_idle(10)
        self.cache.check()
        self.cache.close()


def _storage(kind: str, tmp_path, request) -> StorageConfig:
    settings: dict = dict(backend=kind, path=str(tmp_path / kind), capacity_pages=64,
                          page_bytes=GEOMETRY.page_bytes(PAGE),
                          fingerprint=GEOMETRY.fingerprint("latent-test", PAGE),
                          num_layers=GEOMETRY.num_layers, page_size=PAGE, dtype=GEOMETRY.dtype,
                          namespace=f"t{uuid.uuid4().hex[:10]}")
    if kind == "mooncake":
        settings.update(mooncake_master=request.getfixturevalue("mooncake_master"),
                        mooncake_segment_bytes=16 << 20, mooncake_local_buffer_bytes=16 << 20)
    return StorageConfig(**settings)


@pytest.mark.parametrize("kind", ["hf3fs", "file", "mooncake"])
def test_latent_pages_round_trip_every_tier_byte_exact(kind, tmp_path, request) -> None:
    config = _storage(kind, tmp_path, request)
    storage = create_backend(config)
    try:
        writer = Tiers(storage)
        pages = writer.alloc.alloc(len(TOKENS) // PAGE)
        latent = torch.randn(GEOMETRY.device_shape(len(pages), PAGE),
                             generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        writer.device_kv[:, :, pages] = latent
        writer.cache.backup(TOKENS, "", writer.tree.insert(TOKENS, pages, "").last_node)
        writer.close()
        assert writer.cache.stats.backup_storage_pages == len(pages)

        reader = Tiers(storage)  # new host and device pools: only storage holds the pages
        assert reader.cache.start_prefetch("r", TOKENS + [1], "", 0, len(pages)) == len(pages)
        deadline = time.monotonic() + 10
        while not reader.cache.prefetch_ready("r") and time.monotonic() < deadline:
            time.sleep(0.01)
        fetched = reader.cache.take_prefetch("r")
        host_pages = fetched.host_page_ids
        assert len(host_pages) == len(pages)
        # the host copy is the page-first latent: [L, 1, S, 1, D] per page, byte for byte
        want_host = latent.permute(2, 0, 1, 3, 4, 5)
        assert torch.equal(reader.host.host_kv[host_pages].view(torch.int16),
                           want_host.view(torch.int16))
        device_pages = reader.alloc.alloc(len(pages))
        _, load = reader.cache.load(reader.cache.match(TOKENS, "", 0)[1], fetched, device_pages)
        load.finish()
        assert torch.equal(reader.device_kv[:, :, device_pages].view(torch.int16),
                           latent.view(torch.int16))
        reader.close()
    finally:
        storage.close()
