"""The plugin's settings from SGLang's extra config, and the shard identity that decides
which pages are interchangeable (the fingerprint)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcache.integrations.sglang.geometry import PageGeometry
from pdcache.offload_manager.storage.config import StorageKeys, storage_keys_from_spec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PAYLOAD_LAYOUT = "page_first"  # pdcache's host page layout, the layout named in fingerprints
PAYLOADS = ("pdcache", "split")
CHUNK_BYTES = 8 << 20  # "pdcache" payload: at most about this many bytes per chunk of a batch


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's part of `--hicache-storage-backend-extra-config` (other keys are SGLang's).

    `storage` holds pdcache `StorageConfig` keys (backend, path, capacity_pages or
    capacity_bytes, metadata, namespace, io_engine, mooncake_*); `pdcache_config` names a
    pdcache TOML (a topology file, whose `[storage]` table is translated, or a file of
    StorageConfig keys); keys in `storage` override the file. page_bytes, dtype, layers, page
    size and fingerprint always come from SGLang.
    """

    storage: Mapping[str, Any] = field(default_factory=dict)
    model_name: str | None = None  # fingerprint model name; default: SGLang's model name
    origin: str = "prefill"  # recorded in page headers; "decode" on offloading decode nodes
    chunk_bytes: int = CHUNK_BYTES
    io_timeout_s: float = 60.0  # one SGLang batch call; past it its pages are failures
    key_namespace: str = ""  # extra tenant namespace salted into every key (deployment-wide)
    payload: str = "pdcache"  # "pdcache": pdcache's page layout; "split": zero-copy K/V objects
    allow_clear: bool = False  # let SGLang's clear-storage admin call empty the shared namespace
    io_threads: int = 0  # threads moving chunks of a batch; 0: min(4, CPU count), at least 2
    # the cluster secret file (pdcache.utils.secret): pages are MAC'd with the key pdcache
    # nodes derive from it, so both engines write and accept exactly the same authenticated
    # pages (docs/security.md); "": checksums only
    secret_file: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> PluginSettings:
        extra = dict(extra or {})
        table: dict[str, Any] = {}
        topology_secret = ""
        if extra.get("pdcache_config"):
            table.update(load_storage_table(extra["pdcache_config"]))
            topology_secret = topology_secret_file(extra["pdcache_config"])
        inline = extra.get("storage", {})
        if not isinstance(inline, Mapping):
            raise ValueError(f"extra-config 'storage' must be an object, got {inline!r}")
        table.update(inline)
        if "backend" not in table:
            raise ValueError("pdcache plugin: set 'pdcache_config' (a pdcache TOML) or "
                             "'storage': {'backend': ..., ...} in the extra config")
        origin = str(extra.get("origin", "prefill"))
        if origin not in ("prefill", "decode"):
            raise ValueError(f"pdcache plugin: origin must be prefill|decode, got {origin!r}")
        chunk = int(extra.get("chunk_bytes", CHUNK_BYTES))
        timeout = float(extra.get("io_timeout_s", 60.0))
        namespace = str(extra.get("key_namespace", ""))
        payload = str(extra.get("payload", "pdcache"))
        if payload not in PAYLOADS:
            raise ValueError(f"pdcache plugin: payload must be one of {PAYLOADS}, got {payload!r}")
        allow_clear = bool(extra.get("allow_clear", False))
        threads = int(extra.get("io_threads", 0))
        if threads < 0:
            raise ValueError(f"pdcache plugin: io_threads must be >= 0, got {threads}")
        # the topology's cluster secret unless the extra config names one (it was dropped:
        # the plugin then wrote unsealed pages the deployment's nodes refuse)
        secret_file = str(extra.get("secret_file", topology_secret))
        return cls(table, extra.get("model_name"), origin, chunk, timeout, namespace, payload,
                   allow_clear, threads, secret_file)

    def storage_keys(self) -> StorageKeys:
        """The storage client's keys derived from `secret_file` as a pdcache node derives
        them: the page MAC key and the metadata service's request key (only the MAC key was
        derived: a metadata service started with the secret, as `pdcache launch` starts it,
        refused every request of the plugin). None of them without a secret file; one that is
        missing or readable by others is an error (SecretError)."""
        if not self.secret_file:
            return StorageKeys()
        from pdcache.config.security import SecuritySettings
        from pdcache.utils.secret import load_secret

        keys = SecuritySettings.from_secret(load_secret(self.secret_file))
        return StorageKeys(page_mac_key=keys.page_mac_key, metadata_key=keys.metadata_key)

    @property
    def threads(self) -> int:
        return self.io_threads or max(2, min(4, os.cpu_count() or 2))


_TOPOLOGY_ONLY = {"metadata_service", "start_master", "metrics_port"}


def topology_secret_file(path: str | Path) -> str:
    """`[security] secret_file` of a pdcache topology TOML ("" for none, or a file of
    StorageConfig keys)."""
    data = tomllib.loads(Path(path).read_text())
    if "node" not in data and "model" not in data:
        return ""
    from pdcache.config import load_topology

    return load_topology(path).security.secret_file or ""


def load_storage_table(path: str | Path) -> dict[str, Any]:
    """StorageConfig keys from a pdcache topology TOML or a TOML of StorageConfig keys."""
    data = tomllib.loads(Path(path).read_text())
    if "node" in data or "model" in data:
        from pdcache.config import load_topology

        return storage_keys_from_spec(load_topology(path).storage)
    table = data.get("storage", data)
    if _TOPOLOGY_ONLY & set(table):
        raise ValueError(f"{path}: [storage] has topology keys but the file has no [model]/"
                         "[[node]]; give the whole topology file")
    return dict(table)


@dataclass(frozen=True)
class ShardIdentity:
    """The parts of SGLang's HiCacheStorageConfig that decide which pages are interchangeable."""

    model_name: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    rank_replicated: bool = False  # MLA: every TP rank holds the same KV
    is_writer: bool = True
    # decode context parallelism (MLA): each DCP rank holds another shard of a page, so the
    # MLA replication is per DCP rank (SGLang's own Mooncake backend keys them apart too)
    dcp_rank: int = 0
    dcp_size: int = 1
    # data-parallel attention: each DP rank is a process of its own with the same tp_rank
    # (SGLang passes the attention group's); its pages are interchangeable with the other
    # DP ranks' (not in the fingerprint), but its writer is another process
    dp_rank: int = 0

    @classmethod
    def from_sglang(cls, config: Any, model_name: str | None) -> ShardIdentity:
        name = model_name or config.model_name or ""
        replicated = bool(config.is_mla_model)
        writer = bool(getattr(config, "is_storage_writer", (not replicated) or config.tp_rank == 0))
        return cls(name, config.tp_rank, config.tp_size, config.pp_rank, config.pp_size,
                   config.attn_cp_rank, config.attn_cp_size, replicated, writer,
                   int(getattr(config, "dcp_rank", 0) or 0),
                   int(getattr(config, "dcp_size", 1) or 1),
                   int(getattr(config, "dp_rank", 0) or 0))

    def fingerprint(self, geometry: PageGeometry, payload: str = "pdcache") -> str:
        tp_rank, tp_size = (0, 1) if self.rank_replicated else (self.tp_rank, self.tp_size)
        # pdcache's page layout: the same fingerprint as a pdcache node's of this model; split
        # payloads keep SGLang's own byte order: only SGLang nodes of this layout share them
        order = f"sglang-{geometry.kind}-{geometry.layout}-split" if payload == "split" else None
        fp = geometry.kv_geometry.fingerprint(self.model_name, geometry.page_size, tp_rank,
                                              tp_size, order)
        if self.pp_size > 1:
            fp += f";pp={self.pp_rank}/{self.pp_size}"
        if self.cp_size > 1:
            fp += f";cp={self.cp_rank}/{self.cp_size}"
        if self.dcp_size > 1:  # the same key from two DCP ranks served one's bytes to the other
            fp += f";dcp={self.dcp_rank}/{self.dcp_size}"
        return fp
