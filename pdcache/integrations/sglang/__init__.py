"""pdcache storage as an SGLang HiCache L3 backend (`--hicache-storage-backend dynamic`).

SGLang loads the class `PdcacheHiCacheStorage` from this module with

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "pdcache",
        "module_path": "pdcache.integrations.sglang", "class_name": "PdcacheHiCacheStorage",
        "interface_v1": 1, "pdcache_config": "/etc/pdcache/topology.toml"}'

(or the storage keys inline: `"storage": {"backend": "hf3fs", ...}`, the form
`pdcache launch CONFIG --render sglang` writes; see docs/sglang.md) and hands it page hash
keys plus its config (model name, TP/PP/CP ranks). The plugin stores pages through a pdcache
storage backend (`hf3fs`, `mooncake`, `file`), so SGLang gets the stored page object of
docs/design.md §4.3 (header + checksum: a corrupt, truncated or foreign page is a miss, never wrong
KV) and pdcache's metadata service and capacity management.

Keys. SGLang's key of page i is `g_i = SHA256(g_{i-1} || tokens_i)` (hex), with
`g_{-1}` = nothing, or SGLang's namespace seed when the request carries a cache_salt or
extra_key. The plugin stores it under `SHA256(salt || bytes(g_i))` with
`salt = make_salt(fingerprint, key_namespace)` (pdcache.engine.page_keys): the fingerprint binds
model name, KV dtype, page size, layer count, KV heads and head dim of this shard, and the TP
shard (rank/size; PP stage and attention-CP rank when used), so models, tenants and shards
never read each other's pages. pdcache nodes run with `[cache] key_scheme = "sglang"` in
their topology (`--key-scheme sglang` without one) name their pages the same way
(`pdcache.engine.page_keys.PageKeyScheme`; `sglang_compatible_page_keys`, re-exported here,
computes the same keys) and share pages with SGLang in both directions: prefill write-through,
prefetch, and decode offload, whose answer pages continue SGLang's hash chain. Which settings
must match is listed in `INTEROP` below.

Payload (`"payload"` in the extra config).
- `"pdcache"` (default): whatever SGLang's host layout (layer_first, page_first,
  page_first_direct, page_head), a page is stored in pdcache's host page layout: MHA `[layers,
  2 (K, V), page_size, kv_heads, head_dim]`, MLA `[layers, page_size, 1, kv_cache_dim]`, in the
  KV dtype. A pdcache node reads SGLang's pages straight into its host pool (and the other way
  round), and SGLang nodes with different host layouts share pages. Costs one reordering copy
  per page through a staging buffer (no SGLang host layout keeps a page's K and V in one run,
  and the checksum needs the stored bytes in order): a batch is cut into chunks that the IO
  threads move in parallel, each reordering its chunk and doing its backend IO (numpy's copy
  and pread/pwrite release the GIL; XXH3 holds it for about 10 us a page), so the copy of one
  chunk overlaps the IO of another and no stage waits for a pipeline to fill or drain. The copy
  costs CPU (about 80 us per 512 KiB page each way here, against 170-180 us of backend work):
  it is hidden when a core is free, not on a machine whose cores the IO already fills.
- `"split"`: zero-copy. A page is stored as one object whose payload is the page's contiguous
  runs in SGLang's pool (K then V for MHA, the page for MLA; host layouts page_first and
  page_first_direct), read and written in place with scatter/gather IO (preadv/pwritev,
  Mooncake's multi-buffer transfers; the checksum is computed over the runs in order). Pages
  are shared only between SGLang nodes with the same host layout (the layout is part of the
  fingerprint).

Robustness. `batch_get_v1` / `batch_set_v1` never raise and never return None (SGLang's
prefetch thread dies on either): every failure is a per-key False, logged and counted.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from pdcache.engine.page_keys import derive_storage_key, make_salt
from pdcache.engine.page_keys import (  # the "sglang" key scheme, re-exported for plugin users
    sglang_chain_hashes as sglang_chain_hashes,
)
from pdcache.engine.page_keys import (
    sglang_compatible_page_keys as sglang_compatible_page_keys,
)
from pdcache.engine.page_keys import sglang_namespace_seed as sglang_namespace_seed
from pdcache.integrations.sglang.backend import PdcacheStorageImpl
from pdcache.integrations.sglang.geometry import PageGeometry, dtype_name
from pdcache.integrations.sglang.settings import (
    CHUNK_BYTES,
    PAYLOAD_LAYOUT,
    PAYLOADS,
    PluginSettings,
    ShardIdentity,
    load_storage_table,
)
from pdcache.utils.registry import MissingDependencyError

__all__ = ["CHUNK_BYTES", "CLASS_NAME", "INTEROP", "MODULE_PATH", "PAYLOADS", "PAYLOAD_LAYOUT",
           "PageGeometry", "PdcacheStorageImpl", "PluginSettings", "ShardIdentity",
           "derive_storage_key", "dtype_name", "extra_config", "extra_config_json",
           "load_storage_table", "make_salt", "sglang_chain_hashes",
           "sglang_compatible_page_keys", "sglang_namespace_seed"]

CLASS_NAME = "PdcacheHiCacheStorage"
MODULE_PATH = "pdcache.integrations.sglang"

# Settings that must be equal on a pdcache node and an SGLang node for them to share pages.
INTEROP = (
    "storage: the same backend and location (hf3fs: path, namespace, metadata service and "
    "capacity; mooncake: master and namespace; file: path and namespace)",
    "model name: `model_name` in the plugin config (default: SGLang's served model name) "
    "equals the pdcache nodes' model identity, `pdcache.offload_manager.builder."
    "model_identity()` (`preset:NAME:seed=N` or `ckpt:DIR:DIGEST`; the rendered script sets "
    "it as $PDCACHE_MODEL_NAME)",
    "KV dtype, page size, number of layers, KV heads per shard and head dim",
    "TP shard: tp_rank / tp_size (pdcache nodes are 0/1); MLA pages are shared by all ranks",
    "key namespace: the plugin's `key_namespace` (default \"\") equals the pdcache nodes' "
    "`[cache] key_namespace` (`--key-namespace`, default \"\")",
    "request tenant: the same cache_salt on both sides (SGLang seeds its chain with it)",
    "key scheme: the pdcache nodes run with `[cache] key_scheme = \"sglang\"` (`--key-scheme "
    "sglang`); with the default \"pdcache\" they never see SGLang's pages",
)


@functools.lru_cache(maxsize=1)
def _sglang_class() -> type:
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    except ImportError as exc:
        raise MissingDependencyError(
            "the SGLang storage plugin", "sglang==0.5.23",
            "it runs inside SGLang: on a GPU host install sglang, which brings its CUDA torch; "
            "on CPU, for tests only: pip install --no-deps sglang==0.5.23 plus the light "
            "packages in scripts/setup.sh",
        ) from exc
    return type(CLASS_NAME, (PdcacheStorageImpl, HiCacheStorage),
                {"__module__": __name__, "__doc__": PdcacheStorageImpl.__doc__})


def __getattr__(name: str) -> Any:
    # SGLang's factory does getattr(module, class_name): build the subclass on first use, so
    # importing this module (key helpers) never imports SGLang.
    if name == CLASS_NAME:
        return _sglang_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def extra_config(
    pdcache_config: str | None = None,
    storage: Mapping[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The `--hicache-storage-backend-extra-config` object that loads this plugin."""
    config: dict[str, Any] = {"backend_name": "pdcache", "module_path": MODULE_PATH,
                              "class_name": CLASS_NAME, "interface_v1": 1}
    if pdcache_config is not None:
        config["pdcache_config"] = str(pdcache_config)
    if storage:
        config["storage"] = dict(storage)
    config.update(options)
    return config


def extra_config_json(*args: Any, **kwargs: Any) -> str:
    return json.dumps(extra_config(*args, **kwargs), separators=(",", ":"))
