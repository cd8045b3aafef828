"""The frozen configuration of one storage backend client (docs/design.md §4.4, §4.6).

`StorageSettings` declares, once, the settings a topology's `[storage]` table
(`pdcache.config.schema.StorageSpec`) and a client's `StorageConfig` share; both inherit it.
`StorageKeys`, the keys derived from the cluster secret, is shared the same way by
`StorageConfig` and the process's `pdcache.config.security.SecuritySettings`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:  # page_format needs torch; this module stays light (renderer, plugin config)
    from pdcache.offload_manager.storage.lifecycle import SessionLifecycle, StorageEviction
    from pdcache.offload_manager.storage.page_format import PageSpec
    from pdcache.offload_manager.storage.state_format import StateSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

StorageEviction = Literal["lru", "session"]
IoEngine = Literal["posix", "usrbio"]
STORAGE_EVICTIONS: tuple[str, ...] = get_args(StorageEviction)  # storage.lifecycle's policies
IO_ENGINES: tuple[str, ...] = get_args(IoEngine)
SLOT_ALIGN = 4096


def storage_keys_from_spec(spec: Any) -> dict[str, Any]:
    """StorageConfig keys (all but the page geometry) for a topology's `[storage]` table.

    `spec` is a `pdcache.config.StorageSpec` or anything with its attributes (backend,
    path, capacity, io_engine, metadata, namespace, mooncake.*, fault_injection). The one mapping used by pdcache
    nodes (`pdcache.config.node_setup`), the SGLang plugin and the SGLang renderer, so both
    engines open the same storage. Mooncake keys appear only for the mooncake backend.
    """
    from pdcache.offload_manager.storage import BACKENDS

    if spec.backend not in BACKENDS:
        raise ValueError(f"storage.backend = {spec.backend!r}: no storage to configure "
                         f"(one of {BACKENDS.names()} is needed)")
    keys: dict[str, Any] = {
        "backend": spec.backend, "path": spec.path, "capacity_bytes": spec.capacity,
        "io_engine": spec.io_engine, "metadata": spec.metadata, "namespace": spec.namespace,
    }
    eviction = getattr(spec, "eviction", "lru")
    if eviction != "lru":  # the session lifecycle's keys (file, hf3fs in-process, mooncake)
        keys.update(
            eviction=eviction, session_protect_share=spec.session_protect_share,
            session_protect_bytes=spec.session_protect_bytes,
            session_idle_s=spec.session_idle_s,
        )
    if getattr(spec, "write_delay_s", 0.0):
        keys["write_delay_s"] = spec.write_delay_s
    page_pipeline = getattr(spec, "page_pipeline", "auto")
    if page_pipeline != "auto":  # StorageConfig's default (None) is "auto"
        keys["pipeline_pages"] = PIPELINE_ON_PAGES if page_pipeline == "on" else 0
    if getattr(spec, "state_capacity", 0):  # hybrid models' state objects
        keys["state_capacity"] = spec.state_capacity
    if getattr(spec, "fault_injection", ""):  # chaos/test only: absent from normal configs
        keys["fault_injection"] = spec.fault_injection
    if spec.backend == "mooncake":
        mooncake = spec.mooncake
        master = mooncake.master
        if getattr(mooncake, "ha", False):  # clients find the leading master through etcd
            master = "etcd://" + ";".join(spec.etcd.endpoints)
            keys["mooncake_cluster_id"] = mooncake.cluster_id
        keys.update(
            mooncake_master=master, mooncake_metadata=mooncake.metadata_server,
            mooncake_protocol=mooncake.protocol, mooncake_device=",".join(mooncake.devices),
            mooncake_segment_bytes=mooncake.global_segment_size,
            mooncake_local_buffer_bytes=mooncake.local_buffer_size,
        )
    return keys


log = logging.getLogger(__name__)

# Stored K/V is the tenants' prompts in all but name (the MAC authenticates it, nothing
# encrypts it): files the backends create are the service account's alone, and so are the
# directories they create (a store shared by several accounts needs its own group setup)
DEFAULT_DATA_FILES = 4  # hf3fs data files of a pool (the default keeps its old pool name)
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def make_private_file(fd: int, path: Path | str) -> None:
    """Narrow an opened data file that others may read to `PRIVATE_FILE_MODE`: an hf3fs data
    file lives as long as its store, so one created before its mode was private (or by hand)
    kept every page written into it world-readable. Warns where the mode cannot change (a
    file of another account)."""
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, PRIVATE_FILE_MODE)
    except OSError as exc:
        log.warning("storage: %s stays readable by others (%s)", path, exc)


def make_private_dir(path: Path) -> None:
    """Create `path` and its missing ancestors with `PRIVATE_DIR_MODE` (`mkdir(parents=True)`
    gives the ancestors the default mode); those that exist keep theirs."""
    missing: list[Path] = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir(PRIVATE_DIR_MODE, exist_ok=True)
TENANT_PREFIX = "tenant/"  # the router's tenant namespaces in cache_salt (router.tenants)
PIPELINE_ON_PAGES = 4  # `[storage] page_pipeline = "on"`: pipeline_pages (groups >= 2 MiB)


def tenant_namespace(cache_salt: str | None) -> str:
    """The tenant namespace a request's `cache_salt` lives in: `tenant/NAME` for the salts a
    router with tenants sends (`tenant/NAME` or `tenant/NAME/CLIENT`), "" for any other."""
    if not cache_salt or not cache_salt.startswith(TENANT_PREFIX):
        return ""
    name = cache_salt[len(TENANT_PREFIX):].split("/", 1)[0]
    return TENANT_PREFIX + name if name else ""


def storage_session(namespace: str, session: str) -> str:
    """The storage lifecycle's id of a write's session: the client's `session_id` inside the
    write's tenant namespace, so tenant A reusing tenant B's id neither spends B's per-session
    protection nor keeps B's session open. An id a router with tenants already scoped to this
    namespace (`tenant/NAME/SID`, router.tenants.node_session_id) is kept; any other is put
    under the namespace (`tenant/A/tenant/B/s1` when A forges B's scoped id); a write without
    a namespace may not claim a tenant's id (`-/tenant/B/s1`)."""
    if not session:
        return ""
    if namespace:
        return session if session.startswith(f"{namespace}/") else f"{namespace}/{session}"
    return f"-/{session}" if session.startswith(TENANT_PREFIX) else session


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


# Backends that take a page's tenant namespace but keep no per-tenant accounting (their space
# comes from the metadata service / the Mooncake master): tenant quotas with them are refused,
# here and when a topology is parsed (pdcache.config.validate).
QUOTA_UNENFORCED_BACKENDS = ("hf3fs", "mooncake")


@dataclass(frozen=True, kw_only=True)
class StorageSettings:
    """Storage settings a topology names and a storage client runs with, declared once:
    `[storage]` (`pdcache.config.schema.StorageSpec`) and `StorageConfig` inherit them."""

    # hf3fs: posix files, or usrbio (the 3FS native client)
    io_engine: IoEngine = "posix"
    # "inproc" or "tcp://HOST:PORT" (the shared metadata service); with metadata_service.store
    # "etcd", one address per replica, comma-separated
    metadata: str = "inproc"
    # storage namespace: deployments with different ones never share pages
    namespace: str = "default"
    # conversation-scoped lifecycle (docs/design.md §4.4): "lru" or "session" (active sessions'
    # pages protected within the bounds, closed / idle ones evicted first)
    eviction: StorageEviction = "lru"
    session_protect_share: float = 0.5  # at most this share of the capacity is protected
    # metadata "size": a topology may give it as "64MiB" (pdcache.config.parse)
    session_protect_bytes: int = field(default=0, metadata={"size": True})  # per session (0: only the share bounds)
    session_idle_s: float = 300.0  # a session without a write for this long is closed
    # every write call waits this long first: emulates a slow or distant store (benchmarks,
    # and the tests of the durable next turn); 0 = off
    write_delay_s: float = 0.0
    # Chaos/test only, never in a deployment (docs/chaos.md): an absolute path of a control
    # file whose number is a delay (s) every storage call waits; set by `pdcache chaos`.
    fault_injection: str = ""
    # hybrid models (recurrent-state checkpoints as stored objects, docs/design.md §4.14):
    # state objects kept (LRU among states, apart from the page capacity); 0: unbounded for
    # file and mooncake; hf3fs keeps states in a slot pool of their own: 0 sizes it to a
    # quarter of the page capacity's bytes (on top of it)
    state_capacity: int = 0


@dataclass(frozen=True, kw_only=True)
class StorageKeys:
    """The keys a storage client authenticates with, derived from the cluster secret, declared
    once: the process's `pdcache.config.security.SecuritySettings` (which derives them) and
    `StorageConfig` (which a node's is handed, `pdcache.config.node_setup.with_keys`) inherit
    them. Never from a file: set by the process that loaded the secret; never printed."""

    # Authenticated pages (docs/security.md): derive_key(cluster secret, "page-mac"). With a
    # key, pages are written with a GMAC (page_format.py) and only pages whose MAC verifies are
    # served; None (no cluster secret): checksums only.
    page_mac_key: bytes | None = field(default=None, repr=False, compare=False)
    # derive_key(cluster secret, "metadata"): authenticates every metadata-service request
    # (hf3fs with metadata = tcp://...); None: unauthenticated.
    metadata_key: bytes | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class StorageConfig(StorageSettings, StorageKeys):
    """Everything a storage client needs; built once per process and passed explicitly.

    Capacity is `capacity_pages` or, when that is 0, `capacity_bytes` divided by the slot size;
    0 for both means "the backend's own limit" (mooncake) and is an error for hf3fs.
    `metadata` is "inproc" or "tcp://host:port" of `pdcache metadata-server`; `namespace`
    names the storage pool (data files, metadata pool, object prefix).

    Of the inherited `StorageSettings`, `eviction` and `session_*` set the conversation-scoped
    lifecycle (storage.lifecycle): with "session" an active session's pages are protected (at
    most `session_protect_share` of the capacity in all, `session_protect_bytes` per session;
    0: no per-session cap) and a session without a write for `session_idle_s` is closed: its
    pages are evicted first. Enforced where the backend owns eviction: file, hf3fs (in-process
    index or the metadata service). `write_delay_s` delays every put_from and
    `fault_injection` every call (`fault_injection.DelayInjectingBackend`).
    """

    backend: str = "hf3fs"
    path: str = ".pdcache/storage"
    page_bytes: int = 0  # payload bytes of one page: all layers' slabs (K and V or a latent)
    capacity_pages: int = 0
    capacity_bytes: int = 0
    fingerprint: str = ""
    num_layers: int = 0
    page_size: int = 0  # tokens per page, recorded in each header
    dtype: str = "uint8"
    # payload checksum of new pages: auto | xxh3 | crc32 | none; "auto": "none" with a page MAC
    # key (the MAC covers the payload), else xxh3 (crc32 without xxhash); "none" needs a key.
    # "xxh3" with a key keeps pages readable by keyless and older readers (docs/security.md)
    checksum: str = "auto"
    # hf3fs
    io_threads: int = 1
    # hf3fs (one I/O thread) and file with sealed pages (page_mac_key): > 0 verifies (reads)
    # and seals (writes) groups of at least this many pages (and 2 MiB) on a helper thread beside
    # the I/O of the next group (page_pipeline.py); 0: page by page on the I/O thread; None
    # (default, "auto"): each batch pipelined or page by page, whichever measured faster
    # lately (page_pipeline.AdaptiveChoice: the pipeline wins only with a free core)
    # (docs/security.md "Verified beside the read")
    pipeline_pages: int | None = None
    num_data_files: int = DEFAULT_DATA_FILES
    recover_index: bool = True  # inproc metadata: rebuild the index from slot headers on open
    reservation_ttl_s: float = 60.0
    usrbio_mount: str = ""  # 3FS mount point (usrbio engine)
    usrbio_entries: int = 64
    # mooncake
    # host:port of the master, or "etcd://HOST:PORT;..." (masters in HA mode: the leader is
    # found through etcd, under `mooncake_cluster_id`)
    mooncake_master: str = "127.0.0.1:50051"
    mooncake_cluster_id: str = ""
    mooncake_metadata: str = "P2PHANDSHAKE"
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_local_hostname: str = "127.0.0.1"
    mooncake_segment_bytes: int = 256 << 20
    mooncake_local_buffer_bytes: int = 64 << 20
    mooncake_batch_pages: int = 256
    # faults
    timeout_s: float = 5.0  # one metadata RPC
    retry_interval_s: float = 1.0  # after a failure, fail fast this long before retrying
    # Tenant storage quotas: tenant namespace ("tenant/NAME", `tenant_namespace`) -> bytes of
    # stored pages (headers included). A tenant at its quota evicts its own least recently
    # used pages, never another's. Enforced by the file backend; hf3fs and Mooncake Store
    # take the namespace but cannot enforce it, so quotas with them are refused (here and at
    # topology parse time, docs/design.md §8).
    namespace_quotas: Mapping[str, int] = field(default_factory=dict, compare=False)
    # Recurrent-state objects (state_format.py, docs/design.md §4.3-4.4): the state geometry
    # (`RecurrentStateGeometry.key()`) and bytes (`state_bytes()`) of this store's states; ""
    # and 0: no state objects (the `*_state` methods refuse). Set from the model
    # (`builder.storage_config_for`); `state_capacity` is `StorageSettings`'.
    state_geometry: str = ""
    state_bytes: int = 0

    def __post_init__(self) -> None:
        from pdcache.offload_manager.storage import BACKENDS as REGISTERED

        # any backend in the registry: the built-in ones, or one a plugin (or test) registered
        self._check(self.backend in REGISTERED, "backend", f"must be one of {REGISTERED.names()}")
        self._check(self.io_engine in IO_ENGINES, "io_engine", f"must be one of {IO_ENGINES}")
        self._check(self.page_bytes > 0, "page_bytes", "must be > 0")
        self._check(self.capacity_pages >= 0, "capacity_pages", "must be >= 0")
        self._check(self.capacity_bytes >= 0, "capacity_bytes", "must be >= 0")
        self._check(self.io_threads >= 1, "io_threads", "must be >= 1")
        pipeline = self.pipeline_pages
        self._check(pipeline is None or (isinstance(pipeline, int) and not isinstance(pipeline, bool)
                                         and pipeline >= 0),
                    "pipeline_pages", f"must be an integer >= 0, or None (auto); got {pipeline!r}")
        self._check(self.num_data_files >= 1, "num_data_files", "must be >= 1")
        self._check(self.timeout_s > 0, "timeout_s", "must be > 0")
        self._check(self.write_delay_s >= 0, "write_delay_s", "must be >= 0")
        ok_meta = self.metadata == "inproc" or self.metadata.startswith("tcp://")
        self._check(ok_meta, "metadata", "must be 'inproc' or 'tcp://host:port'")
        if self.backend == "hf3fs":
            self._check(self.num_pages > 0, "capacity_pages", "hf3fs needs a capacity")
        self._check(self.eviction in STORAGE_EVICTIONS, "eviction",
                    f"must be one of {STORAGE_EVICTIONS}")
        share_ok = 0.0 <= self.session_protect_share <= 1.0
        self._check(share_ok, "session_protect_share", "must be in [0, 1]")
        self._check(self.session_protect_bytes >= 0, "session_protect_bytes", "must be >= 0")
        self._check(self.session_idle_s > 0, "session_idle_s", "must be > 0")
        unenforced = self.backend in QUOTA_UNENFORCED_BACKENDS and bool(self.namespace_quotas)
        self._check(not unenforced, "namespace_quotas",
                    f"the {self.backend} backend does not enforce tenant quotas (file does)")
        self.page_spec()  # validates dtype
        self._check_states()

    def _check_states(self) -> None:
        self._check(self.state_bytes >= 0, "state_bytes", "must be >= 0")
        self._check(self.state_capacity >= 0, "state_capacity", "must be >= 0")
        self._check(bool(self.state_geometry) == (self.state_bytes > 0), "state_bytes",
                    "state objects need both state_geometry and state_bytes > 0")
        if self.state_geometry and self.backend == "hf3fs":
            self._check(self.state_capacity > 0, "state_capacity",
                        "hf3fs keeps states in a slot pool of its own: give it a size")

    def _check(self, ok: bool, key: str, problem: str) -> None:
        if not ok:
            raise ValueError(f"storage.{key} = {getattr(self, key)!r}: {problem}")

    @property
    def slot_bytes(self) -> int:
        """Bytes of one hf3fs slot: header + payload, rounded up to 4 KiB."""
        from pdcache.offload_manager.storage.page_format import HEADER_BYTES

        return _align_up(HEADER_BYTES + self.page_bytes, SLOT_ALIGN)

    @property
    def pool_name(self) -> str:
        """hf3fs data files and metadata pool: one per namespace and slot size, so models with
        other page geometries (e.g. a `tiny` run after a `small` one on the same state
        directory) get their own pool instead of a refusal; keys of models that share a slot
        size never collide since they are salted with the KV fingerprint."""
        # a file count other than the default is part of it: a slot's file and offset follow
        # from the count, and two clients of one pool with different counts overwrote each
        # other's pages
        return f"{self.namespace}.slot{self.slot_bytes}{self._files_suffix}"

    @property
    def _files_suffix(self) -> str:
        return "" if self.num_data_files == DEFAULT_DATA_FILES else f".files{self.num_data_files}"

    @property
    def num_pages(self) -> int:
        if self.capacity_pages:
            return self.capacity_pages
        return self.capacity_bytes // self.slot_bytes

    def page_spec(self) -> PageSpec:
        from pdcache.offload_manager.storage.page_format import PageSpec

        return PageSpec(
            fingerprint=self.fingerprint,
            payload_bytes=self.page_bytes,
            num_layers=self.num_layers,
            page_size=self.page_size,
            dtype=self.dtype,
            checksum=self.checksum,
            mac_key=self.page_mac_key,
        )

    def state_spec(self) -> StateSpec | None:
        """What this store's state objects must match; None without `state_geometry`."""
        if not self.state_geometry:
            return None
        from pdcache.offload_manager.storage.state_format import StateSpec

        return StateSpec(fingerprint=self.fingerprint, geometry=self.state_geometry,
                         state_bytes=self.state_bytes, checksum=self.checksum,
                         mac_key=self.page_mac_key)

    @property
    def state_slot_bytes(self) -> int:
        """Bytes of one hf3fs state slot: state header + state, rounded up to 4 KiB."""
        from pdcache.offload_manager.storage.state_format import STATE_HEADER_BYTES

        return _align_up(STATE_HEADER_BYTES + self.state_bytes, SLOT_ALIGN)

    @property
    def state_pool_name(self) -> str:
        """hf3fs state data files and metadata pool: never a page pool's name (`.state`)."""
        return f"{self.namespace}.state{self.state_slot_bytes}{self._files_suffix}"

    @property
    def storage_eviction(self) -> StorageEviction:
        from pdcache.offload_manager.storage.lifecycle import StorageEviction

        return StorageEviction(self.eviction, self.session_protect_share,
                               self.session_protect_bytes, self.session_idle_s)

    def make_lifecycle(self, capacity_pages: int, slot_bytes: int) -> SessionLifecycle | None:
        """The session lifecycle of a store of `capacity_pages` slots of `slot_bytes` (None
        with `eviction = "lru"`)."""
        return self.storage_eviction.build(capacity_pages, slot_bytes)

    def replace(self, **changes: Any) -> StorageConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> StorageConfig:
        """Build from a TOML/JSON table; unknown keys are an error naming the key."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown storage keys {unknown}; known keys: {sorted(known)}")
        return cls(**dict(values))

    @classmethod
    def from_toml(cls, path: str | Path) -> StorageConfig:
        """Read `[storage]` of a topology file, or the whole file when it has no such table."""
        data = tomllib.loads(Path(path).read_text())
        table = data.get("storage", data)
        return cls.from_mapping(table)
