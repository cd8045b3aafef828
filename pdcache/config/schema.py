"""The topology schema: frozen sections of the TOML file that describes a whole deployment.

Parsing and coercion are in `pdcache.config.parse`, cross-key checks in
`pdcache.config.validate`; errors are `TopologyError`s naming the file, the key and what was
expected. Everything here is plain data: no I/O, no torch, so the launcher stays light.

One source per setting: a setting a runtime config also holds is declared once. The
`[scheduler]` table is the engine's own `SchedulerConfig` (`pdcache.engine.scheduler_config`,
torch-free). Shared settings are base classes that a section and its runtime config both
inherit, their keys staying flat in the TOML table, all torch-free:

- here: `ApiSettings` and `RouterSettings` (`NodeSpec` / `RouterSpec` and the processes'
  `ServerConfig` / `RouterConfig`), `TenantLimits` (`TenantSpec`, the router's `Tenant`),
  `NodeAuthSettings` (`SecuritySpec`, `ServerConfig`);
- `pdcache.engine.cache_settings`: `DeviceCacheSettings` (`CacheSpec`, `CacheConfig`) and its
  `PageGeometry` (the router's `RouterConfig` too);
- `pdcache.offload_manager.tier_settings`: `TierSettings` (`CacheSpec`, `HiCacheConfig`);
- `pdcache.offload_manager.storage.config`: `StorageSettings` (`StorageSpec`,
  `StorageConfig`) and `StorageKeys` (`StorageConfig`, `config.security.SecuritySettings`);
- `pdcache.transfer.config`: `TransferSettings` (`TransferSpec`, `TransferConfig`).

A runtime object is built from a section with `field_values`, never field by field
(tests/config/test_one_source.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from pdcache.engine.cache_settings import DeviceCacheSettings
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.offload_manager.storage.config import StorageSettings
from pdcache.offload_manager.tier_settings import TierSettings
from pdcache.transfer.config import TransferSettings

Role = Literal["prefill", "decode", "unified"]
# output formats of pdcache.wire.tool_calls.TOOL_CALL_PARSERS (SGLang's --tool-call-parser
# names); tests/wire/test_tool_calls.py checks the two agree
ToolCallParser = Literal["hermes", "qwen", "qwen25", "llama3", "deepseekv3", "kimi_k2",
                         "qwen3_coder", "gpt-oss"]
# thinking formats of pdcache.wire.reasoning.REASONING_PARSERS (SGLang's --reasoning-parser
# names); tests/wire/test_family_parsers.py checks the two agree
ReasoningParser = Literal["deepseek-r1", "qwen3", "gpt-oss"]
PD_ROLES = ("prefill", "decode")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
               "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class TopologyError(ValueError):
    """A topology file (or a --set override) is invalid; the message names file, key, expectation."""

    exit_code = 2

    def __init__(self, source: str | Path, key: str, problem: str) -> None:
        where = f"{source}: {key}: " if key else f"{source}: "
        super().__init__(where + problem)
        self.source = str(source)
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class ErrorContext:
    """Where a topology came from, for errors: the file and the keys `--set` changed."""

    source: Path
    set_keys: frozenset[str] = frozenset()

    def error(self, key: str, problem: str) -> TopologyError:
        if key in self.set_keys:
            problem += " (from --set)"
        return TopologyError(self.source, key, problem)


def _size(**kw: Any) -> Any:
    """A byte-size field: an integer of bytes or a string such as "4GiB" or "512MB"."""
    return field(metadata={"size": True}, **kw)


def parse_size(text: str) -> int | None:
    """Bytes in "4GiB", "512MB", "64k"; None when the text is not a size."""
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        return None
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def field_values(source: Any, part: type | None = None) -> dict[str, Any]:
    """Field name -> value of the dataclass instance `source`; only the fields of `part` (a
    dataclass `source` is or inherits) when given. How one settings object is made from
    another (`ApiSettings(**field_values(node, ApiSettings))`) without copying its fields one
    by one."""
    return {f.name: getattr(source, f.name) for f in fields(part or source)}


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True, kw_only=True)
class ApiSettings:
    """How an HTTP API answers requests: the keys `[[node]]` and `[router]` share.

    Declared once, here: `NodeSpec`, `RouterSpec`, a node's `pdcache.server.bridge.ServerConfig`
    and the router's `pdcache.router.config.RouterConfig` inherit these fields (flat keys of
    their TOML tables), and a node's `NodeSetup.server` is this part of its `NodeSpec`."""

    # deadline of one request (a node: every wait on its engine; the router: the whole request)
    request_timeout_s: float = 600.0
    tool_call_parser: ToolCallParser = "hermes"  # how model output becomes OpenAI tool_calls
    reasoning_parser: ReasoningParser | None = None  # thinking → reasoning_content; None: off
    # /generate streams deltas, not cumulative chunks (SGLang's --incremental-streaming-output);
    # a request's `incremental_streaming_output` wins
    incremental_streaming_output: bool = False
    # on SIGTERM the server stops accepting and lets requests in flight finish this long
    # before it cuts them (a rollout, a scale-down); the launcher and a rendered pod's grace
    # period wait for it
    drain_s: float = 30.0
    # a larger request body is refused (413) as it is read, never buffered whole
    max_request_bytes: int = _size(default=32 * 2**20)


@dataclass(frozen=True)
class ModelSpec:
    """`[model]`: a random-initialised preset (`tiny`, `small`; MLA + MoE: `tiny-mla`,
    `small-mla`) or a checkpoint directory."""

    preset: str | None = None  # random-weight preset: tiny, small, tiny-mla, small-mla (or `path`)
    # a Hugging Face checkpoint directory (config.json, safetensors, tokenizer)
    path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights and KV cache dtype
    seed: int = 0  # seed of a preset's weights (and of sampling)
    # the model name the API reports (default: the preset's or directory's)
    served_name: str | None = None

    @property
    def ref(self) -> str:
        """What `pdcache serve --model` takes: the preset name or the path."""
        return self.preset if self.preset is not None else str(self.path)


@dataclass(frozen=True)
class CacheSpec(DeviceCacheSettings, TierSettings):
    """`[cache]` (and per-node `[node.cache]` overrides): device/host sizing and policies.

    `page_size`, `device_eviction` and `session_idle_s` are `DeviceCacheSettings`', declared
    once beside the engine's `CacheConfig`, which inherits them too; the host and storage
    tiers' policies and the page-key scheme are `TierSettings`', declared once beside the
    nodes' `HiCacheConfig`."""

    device_pages: int = 2048  # device KV pool size in pages
    host_ratio: float | None = None  # host pool = device pool × ratio (default 2.0)
    # host pool size in bytes (instead of host_ratio / host_pages)
    host_bytes: int | None = _size(default=None)
    host_pages: int | None = None  # host pool in pages; 0 = none (unified nodes without storage)
    # false: no prefix reuse (unified: no lower tiers either; decode: prefill sends every
    # prompt page, decode frees pages once offloaded); prefill nodes always keep it
    prefix_cache: bool = True
    # layer-streamed prefetch (docs/design.md §4.11): read stored pages layer-major and start
    # the forward while later layers are still being read; off by default (measured slower on
    # a 2-core CPU, where the reads take the forward's core); `prefetch_layers_per_read` layers
    # per read step of a page
    prefetch_layerwise: bool = False
    prefetch_layers_per_read: int = 1  # layer-streamed prefetch: layers per read step of a page
    # CPU device pools: copy loads host → device on a thread of their own, layer l+1 while
    # layer l is computed (docs/design.md §4.11, "Loads copied ahead"); off by default (no
    # measured gain on a 2-core CPU); off: each layer is copied on the engine thread when the
    # forward reaches it. No effect on CUDA pools.
    load_copy_ahead: bool = False

    @property
    def effective_host_ratio(self) -> float:
        unset = self.host_ratio is None and self.host_bytes is None and self.host_pages is None
        return 2.0 if unset else self.host_ratio or 0.0


@dataclass(frozen=True)
class MetadataServiceSpec:
    """`[storage.metadata_service]`: the shared 3FS metadata service (global KV manager)."""

    start: bool = True  # the launcher starts it; false when it runs elsewhere already
    bind_host: str | None = None  # defaults to the host of storage.metadata
    state_dir: str = "./.pdcache/metadata"  # where the metadata service keeps its SQLite index
    # where the index lives: "sqlite" (one replica, one host) or "etcd" (every address of
    # storage.metadata is a replica; they elect a leader on [storage.etcd]; docs/design.md §4.4)
    store: Literal["sqlite", "etcd"] = "sqlite"
    lease_ttl_s: int = 3  # store etcd: how long a dead leader keeps the lead (>= 2)


@dataclass(frozen=True)
class EtcdSpec:
    """`[storage.etcd]`: the etcd cluster the replicated hf3fs metadata (or Mooncake's masters
    in HA mode) run on."""

    endpoints: tuple[str, ...] = ()  # client HOST:PORT of every member
    # the launcher starts one local member per endpoint (peer port = client port + 1); false
    # when the cluster runs elsewhere already
    start: bool = True
    data_dir: str = "./.pdcache/etcd"  # members' data (the launcher's members), one dir each
    prefix: str = "/pdcache/metadata"  # key prefix of this deployment's index


@dataclass(frozen=True)
class MooncakeStoreSpec:
    """`[storage.mooncake]`: Mooncake Store master and client settings."""

    master: str = "127.0.0.1:50051"  # rpc host:port of mooncake_master
    metadata_server: str = "http://127.0.0.1:8080/metadata"  # or "P2PHANDSHAKE"
    start_master: bool = True  # the launcher starts mooncake_master (false: it runs elsewhere)
    metrics_port: int = 9003  # mooncake_master's metrics port
    global_segment_size: int = _size(default=512 * 2**20)  # bytes each node contributes to the store
    local_buffer_size: int = _size(default=64 * 2**20)  # each node's local transfer buffer
    protocol: Literal["tcp", "rdma"] = "tcp"  # the store's transfer protocol
    devices: tuple[str, ...] = ()  # RDMA NICs for the store (protocol rdma)
    # masters elect a leader on [storage.etcd] and replicate through Mooncake's etcd op-log
    # (mooncake_master --enable_ha --enable_oplog): `master` then lists every master,
    # comma-separated, and clients find the leader through etcd (metadata_server must be
    # "P2PHANDSHAKE": an embedded HTTP metadata server would die with its master)
    ha: bool = False
    cluster_id: str = "pdcache"  # ha: the masters' --cluster_id, the clients' too

    @property
    def master_address(self) -> tuple[str, int]:
        """(host, port) of the (first) master."""
        return self.master_addresses[0]

    @property
    def master_addresses(self) -> tuple[tuple[str, int], ...]:
        return tuple(split_host_port(a.strip()) for a in self.master.split(",") if a.strip())

    @property
    def http_metadata_address(self) -> tuple[str, int] | None:
        """(host, port) of an HTTP metadata server, or None for P2PHANDSHAKE."""
        match = re.match(r"^http://([^:/]+):(\d+)(/.*)?$", self.metadata_server)
        return (match.group(1), int(match.group(2))) if match else None


@dataclass(frozen=True, kw_only=True)
class StorageSpec(StorageSettings):
    """`[storage]`: the shared storage tier every prefill (and offloading decode) node uses.

    The keys a storage client runs with too (io_engine, metadata, namespace, the session
    lifecycle, the delays) are `StorageSettings`', declared once beside `StorageConfig`."""

    # "none", or a name in pdcache.offload_manager.storage.BACKENDS: "hf3fs", "file",
    # "mooncake", or one a plugin registered (checked by validate against the registry)
    backend: str = "none"
    # hf3fs / file: directory (or 3FS mount) holding the stored pages
    path: str = "./.pdcache/storage"
    capacity: int = _size(default=4 * 2**30)  # bytes of stored pages before eviction
    # hf3fs and file with sealed pages (a cluster secret): "on" verifies (seals) page groups
    # on a helper thread beside the next group's read (write), "off" goes page by page, "auto"
    # runs each batch the way that measured faster lately (posix I/O; docs/security.md
    # "Verified beside the read")
    page_pipeline: Literal["auto", "on", "off"] = "auto"
    metadata_service: MetadataServiceSpec = field(default_factory=MetadataServiceSpec)
    etcd: EtcdSpec = field(default_factory=EtcdSpec)
    mooncake: MooncakeStoreSpec = field(default_factory=MooncakeStoreSpec)

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    @property
    def metadata_address(self) -> tuple[str, int] | None:
        """(host, port) of the (first) metadata service, or None when metadata is in-process."""
        addresses = self.metadata_addresses
        return addresses[0] if addresses else None

    @property
    def metadata_addresses(self) -> tuple[tuple[str, int], ...]:
        """(host, port) of every metadata-service replica; () when metadata is in-process."""
        if self.metadata == "inproc":
            return ()
        return tuple(split_host_port(a.strip().removeprefix("tcp://"))
                     for a in self.metadata.split(",") if a.strip())

    @property
    def uses_metadata_service(self) -> bool:
        return self.backend == "hf3fs" and self.metadata_address is not None

    @property
    def uses_etcd(self) -> bool:
        """Something keeps its state on [storage.etcd]: the hf3fs metadata replicas, or the
        Mooncake masters in HA mode."""
        if self.backend == "mooncake":
            return self.mooncake.ha
        return self.uses_metadata_service and self.metadata_service.store == "etcd"


@dataclass(frozen=True, kw_only=True)
class TransferSpec(TransferSettings):
    """`[transfer]`: how prefill pushes KV pages into decode memory.

    `engine`, `protocol`, `prefill_waits_for_decode` and `lost_peer_hold_s` are
    `TransferSettings`', declared once beside the nodes' `TransferConfig`, which inherits them
    too."""

    devices: tuple[str, ...] = ()  # RDMA NICs, e.g. ["mlx5_0", "mlx5_1"]
    timeout_s: float = 30.0  # bootstrap and per-room transfer deadline


@dataclass(frozen=True, kw_only=True)
class TenantLimits:
    """What one tenant may use at the router, declared once: `TenantSpec` (a
    `[[router.tenant]]` table) and the router's `pdcache.router.tenants.Tenant` inherit it."""

    # sequences (a batch x n; an OpenAI request's n choices) and calls to every node
    # (/close_session, /server_info) of this tenant in flight at the router; 0 = no limit
    max_inflight: int = 0


@dataclass(frozen=True)
class TenantSpec(TenantLimits):
    """One `[[router.tenant]]`: a principal of the router, known by its API key.

    Its key (`api_key`, or the environment variable `api_key_env` names, read by the router
    process: `config.security.tenant_api_key`) authenticates its requests; its name derives
    the page-key namespace its requests' `cache_salt` lives in and scopes its `session_id`s.
    Its limits at the router are `TenantLimits`'."""

    name: str  # the tenant's name (scopes its cache salt, sessions and quota)
    api_key: str | None = None  # its API key, inline (or api_key_env)
    api_key_env: str | None = None  # the environment variable the router reads its key from
    storage_quota: int | None = _size(default=None)  # bytes of its stored pages (file backend)


@dataclass(frozen=True, kw_only=True)
class NodeAuthSettings:
    """Which node HTTP endpoints need the cluster secret's credential besides those that
    always do, declared once: `SecuritySpec` (`[security]`) and a node's
    `pdcache.server.bridge.ServerConfig` inherit it."""

    metrics_auth: bool = False  # /metrics of nodes needs the credential too


@dataclass(frozen=True)
class SecuritySpec(NodeAuthSettings):
    """`[security]`: the cluster secret every process of the deployment shares.

    With `secret_file`, node HTTP endpoints other than /health (and /metrics unless
    `metrics_auth`, `NodeAuthSettings`') need the credential derived from it; stored pages,
    the control plane and the metadata service are authenticated with keys derived from it
    (docs/design.md §8)."""

    # the cluster secret (pdcache secret; the launcher makes one when unset)
    secret_file: str | None = None

    @property
    def enabled(self) -> bool:
        return self.secret_file is not None


@dataclass(frozen=True, kw_only=True)
class RouterSettings(ApiSettings):
    """What a router does with requests: the `[router]` keys its process runs with.

    Declared once, here: `RouterSpec` (the `[router]` table) and the router process's
    `pdcache.router.config.RouterConfig` inherit these fields."""

    name: str = "router"  # the router's name (its process and /metrics label)
    # how a prefill node is picked (cache_aware: the longest cached prefix)
    prefill_policy: Literal["round_robin", "least_load", "cache_aware"] = "cache_aware"
    # how a decode node is picked
    decode_policy: Literal["round_robin", "least_load"] = "round_robin"
    # cache_aware: a prefix match wins only while its node has at most this many more requests
    # in flight than the least loaded one (else least load); 0 = no bound
    cache_aware_balance: int = 32
    api_key: str | None = None  # one client key for every request (or [[router.tenant]] tables)
    connect_timeout_s: float = 5.0  # connecting to a node
    # connections to the nodes held at once (requests; health probes have a pool of their
    # own); a request finding none free within connect_timeout_s is answered 503 router_busy
    max_node_connections: int = 4096
    health_interval_s: float = 2.0  # between health probes of every node
    max_inflight_per_node: int = 0  # requests in flight per node before the router queues; 0 = no limit
    max_queue: int = 1024  # requests the router queues when every node is at its limit
    max_attempts: int = 3  # tries of a request whose node was unreachable or answered 503
    first_token_from_prefill: bool = True  # PD streams: the first token is prefill's (early)
    tls_cert: str | None = None  # PEM certificate chain: the router serves HTTPS
    tls_key: str | None = None  # PEM private key of tls_cert


@dataclass(frozen=True, kw_only=True)
class RouterSpec(RouterSettings):
    """`[router]`: the OpenAI-compatible front door; absent table = no router."""

    host: str = "127.0.0.1"  # where the router listens
    port: int = 8000  # the router's HTTP port
    tenant: tuple[TenantSpec, ...] = ()  # [[router.tenant]]; with any, every request needs a key

    @property
    def url(self) -> str:
        scheme = "https" if self.tls_cert else "http"
        return f"{scheme}://{self.host}:{self.port}"


@dataclass(frozen=True)
class LaunchSpec:
    """`[launch]`: how the launcher runs and supervises processes."""

    python: str | None = None  # interpreter for nodes; default: the launcher's own
    health_timeout_s: float = 300.0  # how long a process may take to become healthy
    # SIGTERM to SIGKILL on stop: a process's drain_s (30) and its close (a decode node's
    # offload flush, up to 20 s)
    stop_grace_s: float = 60.0
    restart_backoff_s: float = 1.0  # first restart delay of a dead process (doubling)
    restart_backoff_max_s: float = 30.0  # the longest restart delay
    # a process that dies this many times in a row without becoming healthy (again) stops the
    # launch with its log's tail, instead of being restarted forever
    max_failures_in_row: int = 5
    ssh_user: str | None = None  # --ssh: the remote user (default: ssh's)
    ssh_options: tuple[str, ...] = ("-o", "BatchMode=yes")  # --ssh: extra ssh options
    remote_workdir: str | None = None  # where the repo and config live on remote hosts
    remote_python: str = "python3"  # --ssh: the interpreter on remote hosts


@dataclass(frozen=True)
class KubernetesSpec:
    """`[kubernetes]`: how `pdcache launch --render k8s` lays the topology out on a cluster
    (docs/kubernetes.md). Nothing here is read by a running process."""

    mode: Literal["rbg", "plain"] = "rbg"  # a RoleBasedGroup, or StatefulSets + Services
    name: str = "pdcache"  # the group's name: pods, services and DNS names derive from it
    namespace: str = "default"  # the namespace of every manifest
    image: str = "pdcache:0.1.0"  # an image with pdcache installed (docs/kubernetes.md)
    # the etcd members' image, when [storage.etcd] start = true renders them (an etcd 3.4+)
    etcd_image: str = "quay.io/coreos/etcd:v3.5.17"
    # the containers' imagePullPolicy
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    secret_name: str = "pdcache-cluster-secret"  # Secret with key `cluster.secret` (+ tenants')
    gpus: int = 0  # per prefill / decode / unified pod
    gpu_resource: str = "nvidia.com/gpu"  # the GPU resource name requested
    # "device-plugin": request `rdma_resource`; "host-network": the host's network and
    # /dev/infiniband (Mooncake's production layout); "none": TCP only
    rdma: Literal["none", "device-plugin", "host-network"] = "none"
    rdma_resource: str = "rdma/hca"  # rdma device-plugin: the resource requested
    # shared storage for hf3fs / file: "pvc:NAME" (ReadWriteMany claim) or "hostpath:/DIR"
    # (a 3FS FUSE mount on every host); "" with storage in use is refused
    storage_volume: str = ""
    model_volume: str = ""  # "pvc:NAME" or "hostpath:/DIR" holding [model] path (a checkpoint)
    cpu: str = "2"  # CPU request of every prefill / decode / unified pod
    memory: str = "8Gi"  # memory request of every prefill / decode / unified pod
    # requests of the router, metadata service, etcd and Mooncake master pods: a node's
    # sizing (its host KV pool) is not theirs, and changing it rolls no etcd member
    service_cpu: str = "1"  # CPU request of the router, metadata, etcd and Mooncake pods
    service_memory: str = "2Gi"  # memory request of those pods
    startup_probe_s: int = 600  # how long a node may load its model before liveness counts
    port_base: int = 30000  # node HTTP port in every pod (bootstrap: port_base + 1)


@dataclass(frozen=True)
class NodeSpec(ApiSettings):
    """One `[[node]]`: a prefill, decode or unified server, with its effective cache settings."""

    name: str  # the node's name (--node NAME, labels, page attribution)
    role: Role  # prefill, decode or unified
    port: int  # its HTTP port
    host: str = "127.0.0.1"  # where others reach it (its URL, bootstrap and transfer address)
    bootstrap_port: int | None = None  # prefill only: ZMQ bootstrap endpoint
    # where it listens (HTTP, bootstrap) when not `host`: "0.0.0.0" behind a name that resolves
    # only once the node runs (a Kubernetes pod's DNS name)
    bind_host: str | None = None
    offload: bool | None = None  # decode only: write generated KV to storage (default: on)
    offload_staging_pages: int | None = None  # decode only: host staging pages (default 256)
    offload_stride_pages: int | None = None  # decode only: offload every N full pages (default 1)
    offload_pending_ttl_s: float | None = None  # decode only: TTL of its pending marks (default 10)
    kernels: str = "auto"  # KV kernel backend (pdcache.kernels): auto, reference, torch, ...
    devices: tuple[str, ...] | None = None  # overrides transfer.devices on this node
    cache: CacheSpec = field(default_factory=CacheSpec)  # [cache] merged with [node.cache]
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # [scheduler] + [node.scheduler]
    command: tuple[str, ...] | None = None  # replaces the node command ({python} {config} ...)
    # argv put before the node's command by the launcher: ["ip", "netns", "exec", "NS"],
    # ["nsenter", "--net=/run/netns/NS", "--"], ["numactl", "-N", "0"], ["taskset", "-c", "2"]
    launch_prefix: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()  # argv appended to the node command
    env: Mapping[str, str] = field(default_factory=dict)  # environment variables of the node process
    # the launcher's health check: http /health, tcp connect, or none
    health: Literal["http", "tcp", "none"] = "http"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def bootstrap_address(self) -> str | None:
        return None if self.bootstrap_port is None else f"{self.host}:{self.bootstrap_port}"


@dataclass(frozen=True)
class Endpoint:
    """Where one component listens: what the router, the nodes and the launcher connect to."""

    name: str
    role: str
    host: str
    port: int
    bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Topology:
    """A whole deployment. Built only by `load_topology` / `parse_topology`, which validate it."""

    source: Path
    overrides: tuple[str, ...]
    model: ModelSpec
    cache: CacheSpec
    scheduler: SchedulerConfig
    storage: StorageSpec
    transfer: TransferSpec
    router: RouterSpec | None
    launch: LaunchSpec
    nodes: tuple[NodeSpec, ...]
    security: SecuritySpec = field(default_factory=SecuritySpec)
    kubernetes: KubernetesSpec = field(default_factory=KubernetesSpec)

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"{self.source}: no node named '{name}' (nodes: {self.node_names()})")

    def node_names(self) -> str:
        return ", ".join(n.name for n in self.nodes)

    def nodes_with_role(self, role: str) -> tuple[NodeSpec, ...]:
        return tuple(n for n in self.nodes if n.role == role)

    @property
    def is_pd(self) -> bool:
        return any(n.role in PD_ROLES for n in self.nodes)

    def endpoints(self) -> dict[str, Endpoint]:
        """Name → endpoint of every node and of the router (the HTTP services)."""
        out = {n.name: Endpoint(n.name, n.role, n.host, n.port, n.bootstrap_port) for n in self.nodes}
        if self.router is not None:
            out[self.router.name] = Endpoint(self.router.name, "router", self.router.host, self.router.port)
        return out

    def hosts(self) -> tuple[str, ...]:
        """Every host that runs something, in first-seen order."""
        seen: dict[str, None] = {}
        for node in self.nodes:
            seen[node.host] = None
        if self.router is not None:
            seen[self.router.host] = None
        return tuple(seen)


def split_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"'{text}' is not HOST:PORT")
    return host, int(port)
