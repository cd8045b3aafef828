"""Authenticated pages through a real prefill path (docs/security.md): a forger with write
access to the storage tier (file pages, hf3fs slots, Mooncake Store objects) stores, under the
victim prompt's page keys, well-formed pages (valid header CRC and payload checksum) holding
another prompt's KV. With the page MAC on they are counted misses and the output tokens equal
the no-cache run; with it off the same pages are served as storage hits (what the MAC is for).
With the MAC on, the refusing node's write-back replaces the forged pages, so the next node is
served the genuine ones (the tier re-warms instead of missing that prefix forever).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from pdcache.offload_manager.storage import create_backend  # noqa: E402
from pdcache.offload_manager.storage.config import StorageConfig  # noqa: E402
from pdcache.utils.secret import derive_key  # noqa: E402
from tests.hicache_support import (  # noqa: E402
    OTHER,
    PROMPT,
    PROMPT_PAGES,
    check_every_tier,
    metric,
    post,
    prompt_keys,
    reference_tokens,
    scrape,
    served,
    storage_config,
    tiered,
)

NEW_TOKENS = 8
MAC_KEY = derive_key(b"a cluster secret of this test", "page-mac")


@pytest.fixture(scope="module")
def expected(tiny) -> list[int]:
    return reference_tokens(tiny, PROMPT)


def _storage(tiny, backend: str, tmp_path, request: pytest.FixtureRequest) -> StorageConfig:
    if backend == "mooncake":
        return storage_config(
            tiny[0],
            backend="mooncake",
            mooncake_master=request.getfixturevalue("mooncake_master"),
            mooncake_segment_bytes=16 << 20,
            mooncake_local_buffer_bytes=16 << 20,
            namespace=f"mac-{tmp_path.name}"[:40],
        )
    return storage_config(tiny[0], backend=backend, path=str(tmp_path))


@pytest.mark.parametrize("mac", [True, False], ids=["mac_on", "mac_off"])
@pytest.mark.parametrize("backend", ["file", "hf3fs", "mooncake"])
def test_forged_pages_are_misses_with_the_mac(
    tiny, expected, tmp_path, request, backend: str, mac: bool
) -> None:
    storage = _storage(tiny, backend, tmp_path, request).replace(
        page_mac_key=MAC_KEY if mac else None
    )
    first = tiered(tiny, storage, prefetch_policy="wait_complete")
    with served(first) as client:
        post(client, OTHER, NEW_TOKENS)  # real KV of another prompt (MAC'd with the MAC on)
        check_every_tier(first)
        other_keys = prompt_keys(storage, OTHER)[:PROMPT_PAGES]
        stolen = torch.zeros(PROMPT_PAGES, storage.page_bytes, dtype=torch.uint8)
        assert first.storage.get_into(other_keys, list(stolen)) == [True] * PROMPT_PAGES
    # the forger: storage access, no secret; it rewraps that KV under PROMPT's keys with a
    # valid checksum (a version-1 page) and writes it straight into the store
    forger = create_backend(storage.replace(page_mac_key=None))
    try:
        victim_keys = prompt_keys(storage, PROMPT)[:PROMPT_PAGES]
        assert forger.put_from(victim_keys, list(stolen)) == [True] * PROMPT_PAGES

        fresh = tiered(tiny, storage, prefetch_policy="wait_complete")
        with served(fresh) as client:
            out = post(client, PROMPT, NEW_TOKENS)
            check_every_tier(fresh)
            samples = scrape(client)
            if mac:  # `fresh` stays open: Mooncake objects live in the writer's segment
                again = _rewarmed(tiny, storage)
        rejected = metric(
            samples, "pdcache_storage_rejected_pages_total", server="u0", reason="mac"
        )
        storage_hits = out["meta_info"]["cached_tokens_details"]["storage"]
        pipeline_calls = metric(samples, "pdcache_storage_mac_pipeline_calls_total",
                                server="u0", call="read_inline")
        # exported where the store chooses (sealed hf3fs and file); this prompt's pages fit
        # one group, so nothing was chosen
        chooses = mac and backend in ("hf3fs", "file")
        assert (pipeline_calls == 0) if chooses else pipeline_calls is None
        if mac:
            assert storage_hits == 0
            assert out["output_ids"] == expected
            assert rejected is not None and rejected >= 1
            replaced = metric(samples, "pdcache_storage_replaced_pages_total", server="u0")
            assert replaced == PROMPT_PAGES
            # `fresh` refused the forgery, recomputed the prompt, and its write-back replaced
            # the refused pages: a third node is served the genuine pages from storage
            assert again["meta_info"]["cached_tokens_details"]["storage"] == PROMPT_PAGES * 4
            assert again["output_ids"] == expected
        else:  # the same forgery is served: the prompt's KV comes from OTHER
            assert storage_hits == PROMPT_PAGES * 4
            assert out["output_ids"] != expected
            assert rejected == 0
    finally:
        forger.close()


def _rewarmed(tiny, storage: StorageConfig) -> dict:
    """A new node's answer to PROMPT on the same storage."""
    node = tiered(tiny, storage, prefetch_policy="wait_complete")
    with served(node) as client:
        out = post(client, PROMPT, NEW_TOKENS)
        check_every_tier(node)
    return out
