"""The security settings of one process: the cluster secret, loaded once, and its derived keys.

`security_for(spec)` reads `[security] secret_file` (refusing a file others may read) and
derives one key per use (`pdcache.utils.secret.derive_key`), so the rest of the process reads
frozen bytes, never the file or the environment:

- `node_http_token`: the bearer credential of node HTTP endpoints (`Authorization: Bearer
  TOKEN`); the router and the launcher send it, `pdcache.server.routes` checks it.
- `page_mac_key`: the keyed MAC of stored pages (storage backends, the SGLang plugin).
- `zmq_control_key`: the transfer control plane (bootstrap sockets).
- `metadata_key`: the 3FS metadata service's requests.

Without a secret every key is None: nothing is authenticated (single-host development).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdcache.config.schema import SecuritySpec, TenantSpec, Topology, TopologyError
from pdcache.offload_manager.storage.config import StorageKeys
from pdcache.utils.secret import SecretError, derive_key, load_secret

NODE_HTTP, PAGE_MAC, ZMQ_CONTROL, METADATA = "node-http", "page-mac", "zmq-control", "metadata"


@dataclass(frozen=True, repr=False, kw_only=True)
class SecuritySettings(SecuritySpec, StorageKeys):
    """`[security]` loaded: the cluster secret of this process and the keys derived from it
    (all None without). Its `secret_file` (where the secret came from, for messages, never the
    bytes) and `metrics_auth` are the section's own fields, inherited; the storage client's
    keys (`page_mac_key`, `metadata_key`) are `StorageKeys`', which `StorageConfig` inherits
    too."""

    secret: bytes | None = None
    node_http_token: str | None = None
    zmq_control_key: bytes | None = None

    @classmethod
    def from_secret(cls, secret: bytes | None, metrics_auth: bool = False,
                    secret_file: str | None = None) -> SecuritySettings:
        if secret is None:
            return cls(metrics_auth=metrics_auth)
        return cls(secret=secret, metrics_auth=metrics_auth,
                   node_http_token=derive_key(secret, NODE_HTTP).hex(),
                   page_mac_key=derive_key(secret, PAGE_MAC),
                   zmq_control_key=derive_key(secret, ZMQ_CONTROL),
                   metadata_key=derive_key(secret, METADATA), secret_file=secret_file)

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def node_headers(self) -> dict[str, str]:
        """Headers that authenticate a request to a node (empty without a secret)."""
        if self.node_http_token is None:
            return {}
        return {"Authorization": f"Bearer {self.node_http_token}"}

    def __repr__(self) -> str:  # never print key material
        return (f"SecuritySettings(enabled={self.enabled}, secret_file={self.secret_file!r}, "
                f"metrics_auth={self.metrics_auth})")


def security_for(spec: SecuritySpec, source: str | Path = "<topology>") -> SecuritySettings:
    """Load `spec.secret_file` (once per process). Raises TopologyError naming the key when
    the file is missing, too short or readable by others."""
    if spec.secret_file is None:
        return SecuritySettings(metrics_auth=spec.metrics_auth)
    try:
        secret = load_secret(spec.secret_file)
    except SecretError as exc:
        raise TopologyError(source, "security.secret_file", str(exc)) from None
    return SecuritySettings.from_secret(secret, spec.metrics_auth, spec.secret_file)


def tenant_api_key(tenant: TenantSpec, source: str | Path = "<topology>",
                   environ: Mapping[str, str] = os.environ) -> str:
    """A tenant's API key: `api_key`, or the variable `api_key_env` names (the topology
    names it, so reading it is explicit configuration). Raises TopologyError when unset."""
    if tenant.api_key is not None:
        return tenant.api_key
    assert tenant.api_key_env is not None  # validation: exactly one of the two
    key = environ.get(tenant.api_key_env, "")
    if not key:
        raise TopologyError(source, f"router.tenant.{tenant.name}.api_key_env",
                            f"environment variable {tenant.api_key_env} is not set (or "
                            f"empty): it should hold tenant {tenant.name!r}'s API key")
    return key


def tenant_quotas(topology: Topology) -> dict[str, int]:
    """Tenant namespace -> storage quota in bytes, of the tenants that have one (what every
    node's storage enforces where its backend can)."""
    from pdcache.offload_manager.storage.config import TENANT_PREFIX

    tenants = topology.router.tenant if topology.router is not None else ()
    return {TENANT_PREFIX + t.name: t.storage_quota for t in tenants
            if t.storage_quota is not None}
