"""Frozen configuration of the prefill → decode KV transfer (control plane + data engine).

`TransferSettings` declares, once, the settings the topology's `[transfer]` table
(`pdcache.config.schema.TransferSpec`) and a node's `TransferConfig` share; both inherit it,
and a node's `TransferConfig` is made from its `TransferSpec` with `field_values`. Standard
library only (and `pdcache.transfer` imports nothing on package import), so the schema that
inherits it stays free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

TransferEngine = Literal["mooncake", "zmq", "nixl"]
TransferProtocol = Literal["tcp", "rdma"]
ENGINE_NAMES: tuple[str, ...] = get_args(TransferEngine)


@dataclass(frozen=True, kw_only=True)
class TransferSettings:
    """Which data engine moves the pages, over what, and the PD admission and lost-peer
    policies: the `[transfer]` keys a node's transfer layer runs with unchanged. Keyword-only,
    so subclasses keep their own positional fields."""

    # P->D transfer engine: mooncake, zmq (no RDMA), nixl
    engine: TransferEngine = "mooncake"
    protocol: TransferProtocol = "tcp"  # tcp or rdma (mooncake, nixl)
    # PD admission (docs/pd-protocol.md): a prefill node holds a PD request out of its compute
    # queue until decode's RoomRequest for the room arrived (decode reserved its pages), for at
    # most room_timeout_s + bootstrap_timeout_s. False computes at once and holds the K/V on
    # prefill until decode asks (for bootstrap_timeout_s): measured worse, kept for the A/B.
    prefill_waits_for_decode: bool = True  # no prefill compute before decode reserved the pages
    # decode: a lost prefill peer's pages stay fenced (busy) until its AbortAck, its address
    # re-registering with another boot id, or this (docs/design.md §4.5): a stalled prefill
    # that resumes may still write them
    lost_peer_hold_s: float = 120.0


@dataclass(frozen=True)
class TransferConfig(TransferSettings):
    """Everything the transfer layer of one node needs; built once and passed explicitly.

    `protocol` and `device_names` are handed to the data engine unchanged: `tcp` and "" on a
    laptop, `rdma` and e.g. "mlx5_0,mlx5_1" on a cluster (Mooncake); NIXL picks its backend
    from `nixl_backend`. The settings it shares with `[transfer]` are `TransferSettings`'.
    """

    device_names: str = ""
    local_host: str = "127.0.0.1"  # address the data engine advertises and listens on
    metadata_server: str = "P2PHANDSHAKE"  # Mooncake: no etcd needed with P2P handshakes
    # Mooncake reads these from the environment only; see MooncakeEngine.environment.
    tcp_bind_address: str = ""  # MC_TCP_BIND_ADDRESS; "" = local_host
    mooncake_log_level: str = "ERROR"  # MC_LOG_LEVEL
    nixl_backend: str = "UCX"
    # Deadlines (seconds). Every wait in the transfer layer is bounded by one of these.
    bootstrap_timeout_s: float = 30.0  # a room's two halves (prefill KV, decode pages) meet
    room_timeout_s: float = 120.0  # a room from creation to Success, on both sides
    heartbeat_interval_s: float = 1.0
    # A peer silent for interval * misses is declared dead and its rooms fail. Keep this well
    # above scheduling stalls: a live peer declared dead may still write pages decode freed.
    heartbeat_misses: int = 5
    abort_ack_timeout_s: float = 10.0  # decode keeps aborted pages until prefill acks (or this)
    # Decode holds a finished request's last output until the prefill peers recorded its
    # pending marks (docs/design.md §4.10, "Delivery"), at most this long (checked every tick,
    # <= 0.25 s): a peer that does not answer costs each answer this, until it is declared lost.
    pending_ack_timeout_s: float = 0.5
    # Limits.
    max_message_bytes: int = 1 << 20  # control messages; larger ones are rejected and counted
    max_batch_entries: int = 1024  # entries per engine batch (Mooncake TCP lanes queue ~2048)
    max_batch_bytes: int = 64 << 20  # bytes per engine batch; bounds abort latency too
    transfer_workers: int = 2  # sender threads running engine writes
    finished_rooms_kept: int = 65536  # outcomes remembered after release, for poll()/late msgs
    # Of those, decode keeps each successful room's prefill report (for a `wait` after the
    # release) until the reports' logprob bytes pass this; older ones are dropped first.
    finished_report_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_NAMES:
            raise ValueError(f"transfer.engine: unknown '{self.engine}', choose {ENGINE_NAMES}")
        for name in ("bootstrap_timeout_s", "room_timeout_s", "heartbeat_interval_s",
                     "abort_ack_timeout_s", "lost_peer_hold_s", "pending_ack_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"transfer.{name} must be > 0, got {getattr(self, name)}")
        for name in ("heartbeat_misses", "max_message_bytes", "max_batch_entries",
                     "max_batch_bytes", "transfer_workers", "finished_rooms_kept",
                     "finished_report_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"transfer.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def peer_dead_after_s(self) -> float:
        """Silence after which a peer is declared dead and its rooms fail."""
        return self.heartbeat_interval_s * self.heartbeat_misses
