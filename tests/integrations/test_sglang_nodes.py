"""Running pdcache nodes and SGLang servers (the pdcache storage plugin) share pages.

With `key_scheme = "sglang"` a pdcache node names its stored pages the way the plugin does,
and the plugin's `model_name` equals the node's model identity (`model_identity()`, here
`preset:tiny:seed=0`): a prefill node's write-through pages are found by SGLang, SGLang's
pages by a fresh pdcache node, and a decode node's offloaded answer pages by SGLang under
`sglang_chain_hashes(prompt + answer)`. The plugin is loaded through SGLang's own backend
factory; the SGLang host pool is a lookalike in the `page_head` layout (a different byte order
than pdcache's host pages), as in tests/integrations/test_sglang.py. The topology / flag
plumbing tests at the end run without sglang.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdcache.config import (
    TopologyError,
    add_node_flags,
    parse_topology,
    setup_for,
    topology_from_flags,
)
from pdcache.engine.config import ModelConfig
from pdcache.engine.loader import load_model
from pdcache.engine.page_keys import PageKeyScheme, sglang_chain_hashes
from pdcache.integrations import sglang as plugin
from pdcache.offload_manager.builder import TieredEngine, model_identity
from pdcache.offload_manager.hicache import HiCacheConfig
from tests.hicache_support import (
    PAGE,
    PROMPT,
    PROMPT_PAGES,
    generate,
    reference_tokens,
    storage_config,
    tiered,
)

try:
    from sglang.srt.mem_cache import hicache_storage
    from sglang.srt.mem_cache.storage import backend_factory
except ImportError:
    hicache_storage = backend_factory = None

needs_sglang = pytest.mark.skipif(
    backend_factory is None,
    reason="sglang is not installed (pip install --no-deps sglang==0.5.23 + light deps)")

IDENTITY = model_identity("tiny", 0)  # the pdcache nodes' model name in the fingerprint
POOL_PAGES = 20


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def expected(tiny) -> list[int]:
    return reference_tokens(tiny, PROMPT)


class SglangLikeHostPool:
    """What the plugin's v1 calls read of SGLang's MHATokenToKVPoolHost, layout page_head:
    `kv_buffer[2 (K, V), page, head, token in page, layer, head_dim]`."""

    def __init__(self, config: ModelConfig, pages: int = POOL_PAGES) -> None:
        self.layout, self.page_size, self.dtype = "page_head", PAGE, torch.float32
        self.layer_num, self.head_num = config.num_hidden_layers, config.num_key_value_heads
        self.head_dim = self.v_head_dim = config.head_dim
        self.page_num, self.size = pages, pages * PAGE
        self.kv_buffer = torch.zeros((2, pages, self.head_num, PAGE, self.layer_num,
                                      self.head_dim), dtype=self.dtype)

    def page(self, index: int) -> torch.Tensor:
        """Host page `index` as `[layer, K/V, token, head, head_dim]` (pdcache's order)."""
        return self.kv_buffer[:, index].permute(3, 0, 2, 1, 4)


def host_indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def open_plugin(pool: SglangLikeHostPool, root: Path, model_name: str = IDENTITY,
                **options: str):
    """The plugin as SGLang builds it (factory, then register_mem_pool_host), on the `file`
    backend at `root`; SGLang's served model name differs, `model_name` is the override."""
    extra = plugin.extra_config(storage={"backend": "file", "path": str(root)},
                                model_name=model_name, **options)
    config = hicache_storage.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="served/tiny", extra_config=json.loads(json.dumps(extra)))
    backend = backend_factory.StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def node(tiny, root: Path, scheme: str = "sglang", page_mac_key: bytes | None = None,
         **hicache) -> TieredEngine:
    """A started tiny engine with host tier and `file` storage at `root`."""
    storage = storage_config(tiny[0], backend="file", path=str(root))
    return tiered(tiny, storage.replace(page_mac_key=page_mac_key),
                  prefetch_policy="wait_complete", key_scheme=scheme, **hicache)


def prompt_kv(built: TieredEngine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(device, host) K/V of the full pages of `tokens` on an idle node, `[page, layer, K/V,
    token, head, head_dim]` each."""
    match = built.hicache.tree.match_prefix(tokens)
    assert match.cached_len == len(tokens) // PAGE * PAGE
    device = built.engine.pool.device_kv[:, :, match.page_ids].permute(2, 0, 1, 3, 4, 5)
    host_ids = [p for n in match.last_node.path_from_root() for p in n.host_page_ids]
    host_ids = host_ids[: len(match.page_ids)]  # the last node may hold more pages
    return device.clone(), built.hicache.host_pool.host_kv[host_ids].clone()


def served_by_node_a(tiny, root: Path) -> tuple[torch.Tensor, list[int]]:
    """Node A serves PROMPT with write-through to `root`; returns its prompt pages' KV (device
    and host copies checked equal) and the answer."""
    node_a = node(tiny, root)
    try:
        answer, out = generate(node_a.engine, "a", PROMPT)
        assert out.cached.total == 0
        assert node_a.hicache.wait_idle(20)
        # prompt + answer (41 + 8 tokens, KV for 48) are inserted and written: 12 pages
        assert node_a.hicache.stats.backup_storage_pages == PROMPT_PAGES + 2
        device, host = prompt_kv(node_a, PROMPT)
        assert torch.equal(device, host)
        return device, answer
    finally:
        node_a.close()


def pool_pages(pool: SglangLikeHostPool, pages: list[int]) -> torch.Tensor:
    return torch.stack([pool.page(p) for p in pages])


# ---------------------------------------------------------------------------- pdcache → SGLang


@needs_sglang
def test_prefill_node_pages_are_found_by_sglang(tiny, tmp_path) -> None:
    device, answer = served_by_node_a(tiny, tmp_path / "a")
    pool = SglangLikeHostPool(tiny[0].config)
    store = open_plugin(pool, tmp_path / "a")
    try:
        hashes = sglang_chain_hashes(PROMPT, PAGE)
        assert store.batch_exists(hashes) == PROMPT_PAGES
        assert store.batch_exists(sglang_chain_hashes(PROMPT + answer, PAGE)) == 12
        pages = [19 - i for i in range(PROMPT_PAGES)]  # anywhere in SGLang's pool
        assert store.batch_get_v1(hashes, host_indices(pages)) == [True] * PROMPT_PAGES
        assert torch.equal(pool_pages(pool, pages), device)  # byte-exact, other layout
        assert store.batch_exists(sglang_chain_hashes(PROMPT, PAGE, cache_salt="t")) == 0
    finally:
        store.close()


# ---------------------------------------------------------------------------- SGLang → pdcache


@needs_sglang
def test_sglang_pages_are_found_by_a_fresh_node(tiny, tmp_path, expected) -> None:
    device, _ = served_by_node_a(tiny, tmp_path / "a")
    pool = SglangLikeHostPool(tiny[0].config)
    hashes = sglang_chain_hashes(PROMPT, PAGE)
    pages = [2 * i + 1 for i in range(PROMPT_PAGES)]
    reader = open_plugin(pool, tmp_path / "a")
    try:
        assert reader.batch_get_v1(hashes, host_indices(pages)) == [True] * PROMPT_PAGES
    finally:
        reader.close()
    writer = open_plugin(pool, tmp_path / "b")  # new storage: only what SGLang writes
    try:
        assert writer.batch_set_v1(hashes, host_indices(pages)) == [True] * PROMPT_PAGES
    finally:
        writer.close()
    node_b = node(tiny, tmp_path / "b")  # empty device and host tiers
    try:
        tokens, out = generate(node_b.engine, "b", PROMPT)
        assert tokens == expected
        assert (out.cached.device, out.cached.host, out.cached.storage) == (0, 0, 40)
        assert out.cached.storage_from_decode == 0 and out.computed_tokens == len(PROMPT) - 40
        assert node_b.hicache.stats.prefetch_pages == PROMPT_PAGES
        assert node_b.hicache.stats.prefetch_failed_pages == 0
        assert node_b.hicache.wait_idle(20)
        assert torch.equal(prompt_kv(node_b, PROMPT)[0], device)
    finally:
        node_b.close()


@needs_sglang
@pytest.mark.parametrize("reader", ["same_secret", "other_secret", "no_secret"])
def test_sglang_pages_with_a_secret_are_served_only_under_its_key(tiny, tmp_path, expected,
                                                                  reader: str) -> None:
    """The plugin with `secret_file` MACs its pages like a pdcache node: a node on the same
    secret serves them from storage; a node on another secret rejects every one (counted) and
    computes the same tokens; a node without a secret (MAC off) cannot check them (sealed pages
    carry no checksum by default, page_format.py) and refuses them as `needs_key` (not
    `foreign`: it lacks the secret, the pages are its model's), same tokens."""
    from pdcache.utils.secret import create_secret, derive_key, load_secret

    secret = create_secret(tmp_path / "secret")
    device, _ = served_by_node_a(tiny, tmp_path / "a")
    pool = SglangLikeHostPool(tiny[0].config)
    hashes = sglang_chain_hashes(PROMPT, PAGE)
    pages = [2 * i + 1 for i in range(PROMPT_PAGES)]
    source = open_plugin(pool, tmp_path / "a")
    try:
        assert source.batch_get_v1(hashes, host_indices(pages)) == [True] * PROMPT_PAGES
    finally:
        source.close()
    writer = open_plugin(pool, tmp_path / "b", secret_file=str(secret))
    try:
        assert writer.batch_set_v1(hashes, host_indices(pages)) == [True] * PROMPT_PAGES
    finally:
        writer.close()
    keys = {"same_secret": derive_key(load_secret(secret), "page-mac"),
            "other_secret": derive_key(b"another cluster's secret file", "page-mac"),
            "no_secret": None}
    node_b = node(tiny, tmp_path / "b", page_mac_key=keys[reader])
    try:
        tokens, out = generate(node_b.engine, "b", PROMPT)
        assert tokens == expected
        served = 40 if reader == "same_secret" else 0
        assert out.cached.storage == served
        stats = node_b.storage.stats()
        reason = "needs_key" if reader == "no_secret" else "mac"
        assert stats[f"rejected_{reason}_pages"] == (0 if served else PROMPT_PAGES)  # all refused
        assert stats["rejected_mac_pages"] + stats["rejected_needs_key_pages"] == (
            0 if served else PROMPT_PAGES)
        assert stats["rejected_foreign_pages"] == 0
    finally:
        node_b.close()


@needs_sglang
def test_mismatched_scheme_or_model_finds_nothing(tiny, tmp_path) -> None:
    served_by_node_a(tiny, tmp_path / "a")
    pool = SglangLikeHostPool(tiny[0].config)
    other_model = open_plugin(pool, tmp_path / "a", model_name="org/tiny")
    try:  # SGLang's default: its served model name, not the pdcache identity
        assert other_model.batch_exists(sglang_chain_hashes(PROMPT, PAGE)) == 0
    finally:
        other_model.close()
    native = node(tiny, tmp_path / "a", scheme="pdcache")  # node A's pages, pdcache's names
    try:
        assert generate(native.engine, "n", PROMPT)[1].cached.total == 0
        assert native.hicache.stats.prefetch_pages == 0
    finally:
        native.close()


# ---------------------------------------------------------------------------- decode offload


@needs_sglang
def test_decode_offloaded_answer_pages_are_found_by_sglang(tiny, tmp_path, expected) -> None:
    from tests.pd_harness import node_setups, start_stack

    prefill, decode = node_setups(tmp_path, tiny[0], PAGE, "zmq", offload=True, backend="file",
                                  storage_settings={"path": str(tmp_path / "s")})
    hicache = replace(prefill.tiers.hicache, key_scheme="sglang")
    sglang_keys = replace(prefill.cache_tiers, key_scheme="sglang")
    prefill = replace(prefill, tiers=replace(prefill.tiers, hicache=hicache),
                      cache_tiers=sglang_keys)
    stack = start_stack(prefill, replace(decode, cache_tiers=sglang_keys))
    try:
        answer = stack.generate(PROMPT, 8)[1]["output_ids"]
        assert answer == expected
        assert stack.offload_idle(30)
        offload = stack.decode_server_app.state.offload
        assert offload.stats.pages_offloaded + offload.stats.pages_skipped == 12
    finally:
        stack.close()
    kv_tokens = PROMPT + answer  # 49 tokens: 12 full pages, the last answer token has no KV
    hashes = sglang_chain_hashes(kv_tokens, PAGE)
    assert len(hashes) == 12
    pool = SglangLikeHostPool(tiny[0].config)
    store = open_plugin(pool, tmp_path / "s")
    try:
        assert store.batch_exists(hashes) == 12
        assert store.batch_get_v1(hashes, host_indices(list(range(12)))) == [True] * 12
    finally:
        store.close()
    longer = kv_tokens + [5, 6, 7]  # the next turn, on a fresh node: every page from storage
    node_c = node(tiny, tmp_path / "s")
    try:
        tokens, out = generate(node_c.engine, "c", longer)
        assert tokens == reference_tokens(tiny, longer)
        assert (out.cached.device, out.cached.host, out.cached.storage) == (0, 0, 48)
        assert out.cached.storage_from_decode >= 8  # the answer's pages came from decode
        assert torch.equal(prompt_kv(node_c, kv_tokens)[0], pool_pages(pool, list(range(12))))
    finally:
        node_c.close()


# ---------------------------------------------------------------------------- plumbing

TOPOLOGY = """
[model]
preset = "tiny"
[cache]
page_size = 4
device_pages = 64
{cache}
[storage]
backend = "file"
path = "{path}"
[[node]]
name = "u0"
role = "unified"
port = 31000
{node}
"""


def topology(tmp_path: Path, cache: str = "", node: str = "", overrides: tuple = ()):
    text = TOPOLOGY.format(cache=cache, path=tmp_path / "s", node=node)
    return parse_topology(text, "t.toml", overrides)


def test_topology_key_scheme_reaches_hicache(tiny, tmp_path) -> None:
    topo = topology(tmp_path, 'key_scheme = "sglang"\nkey_namespace = "team-a"')
    setup = setup_for(topo, "u0", tiny[0].config)
    assert (setup.key_scheme, setup.key_namespace) == ("sglang", "team-a")
    assert (setup.tiers.hicache.key_scheme, setup.tiers.hicache.key_namespace) == (
        "sglang", "team-a")
    default = topology(tmp_path)
    plain = setup_for(default, "u0", tiny[0].config)
    assert plain.tiers.hicache.key_scheme == "pdcache" and plain.key_namespace == ""
    over = topology(tmp_path, overrides=("cache.key_scheme=sglang",))
    assert setup_for(over, "u0", tiny[0].config).key_scheme == "sglang"


def test_bad_key_scheme_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(TopologyError, match=r"cache.key_scheme: unknown value.*pdcache, sglang"):
        topology(tmp_path, 'key_scheme = "vllm"')
    with pytest.raises(TopologyError, match=r"node.u0.cache.key_scheme: must equal"):
        topology(tmp_path, node='cache = { key_scheme = "sglang" }')
    with pytest.raises(ValueError, match=r"unknown key scheme 'vllm'; expected one of: pdcache"):
        HiCacheConfig(key_scheme="vllm")


def test_key_scheme_flags(tiny) -> None:
    parser = argparse.ArgumentParser()
    add_node_flags(parser, "decode")
    args = parser.parse_args(["--key-scheme", "sglang", "--key-namespace", "ns",
                              "--storage-backend", "file"])
    setup = setup_for(topology_from_flags(args, "decode"), args.name, tiny[0].config)
    assert (setup.key_scheme, setup.key_namespace, setup.offload is not None) == ("sglang", "ns", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--key-scheme", "vllm"])


def test_pdcache_scheme_keys_are_unchanged_and_namespaced() -> None:
    from pdcache.engine.page_keys import chain_page_keys, make_salt, sglang_compatible_page_keys

    tokens = list(range(3, 3 + 5 * PAGE + 2))
    native = PageKeyScheme("fp", PAGE)
    assert native.keys(tokens, "t")[0] == chain_page_keys(tokens, PAGE, make_salt("fp", "t"))
    spaced = PageKeyScheme("fp", PAGE, namespace="ns").keys(tokens, "t")[0]
    assert not set(spaced) & set(native.keys(tokens, "t")[0])
    sglang = PageKeyScheme("fp", PAGE, "sglang", "ns")
    keys, chain = sglang.keys(tokens, "t")
    assert keys == sglang_compatible_page_keys(tokens, PAGE, "fp", "ns", "t")
    head, state = sglang.keys(tokens[: 2 * PAGE], "t")  # a decode node continuing the chain
    assert head + sglang.keys(tokens[2 * PAGE :], "t", state)[0] == keys
    assert state == bytes.fromhex(sglang_chain_hashes(tokens, PAGE, cache_salt="t")[1])
