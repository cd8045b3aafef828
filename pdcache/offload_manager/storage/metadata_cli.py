"""`pdcache metadata-server`: run the global KV manager (hf3fs key -> slot index service)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import zmq

from pdcache.offload_manager.storage.config import STORAGE_EVICTIONS
from pdcache.offload_manager.storage.etcd_store import EtcdIndexStore, parse_endpoints
from pdcache.offload_manager.storage.lifecycle import StorageEviction
from pdcache.offload_manager.storage.metadata_service import (
    MetadataService,
    metadata_key,
    serve,
)
from pdcache.utils.ports import port_number
from pdcache.utils.secret import SecretError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=port_number, default=18000, help="port to bind (0: any free port)")
    parser.add_argument(
        "--state-dir", default=None, help="directory of the persisted index (store sqlite)"
    )
    parser.add_argument(
        "--store",
        choices=("sqlite", "etcd"),
        default="sqlite",
        help="where the index lives: sqlite (one host) or etcd (replicated; several "
        "metadata-server replicas elect a leader on it)",
    )
    parser.add_argument(
        "--etcd-endpoints", default="", help="store etcd: HOST:PORT of the etcd members, comma-separated"
    )
    parser.add_argument(
        "--etcd-prefix", default="/pdcache/metadata", help="store etcd: key prefix of this index"
    )
    parser.add_argument(
        "--advertise",
        default="",
        help="store etcd: the address clients reach this replica at (tcp://HOST:PORT; "
        "default tcp://--host:--port)",
    )
    parser.add_argument(
        "--lease-ttl",
        type=int,
        default=3,
        help="store etcd: seconds a dead leader keeps the lead (its etcd lease TTL)",
    )
    parser.add_argument(
        "--capacity-pages",
        type=int,
        default=0,
        help="cap on slots per pool (default: what the first client asks for)",
    )
    parser.add_argument(
        "--reservation-ttl",
        type=float,
        default=60.0,
        help="seconds before an uncommitted reservation is reclaimed",
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        help="cluster secret file: every request must carry its derived credential "
        "(docs/security.md); default: unauthenticated",
    )
    parser.add_argument(
        "--eviction",
        choices=STORAGE_EVICTIONS,
        default="lru",
        help="which page a full pool evicts: lru, or session (closed conversations' pages "
        "first, active ones protected within the bound; `[storage] eviction`)",
    )
    parser.add_argument(
        "--session-protect-share",
        type=float,
        default=0.5,
        help="session eviction: at most this share of a pool is protected",
    )
    parser.add_argument(
        "--session-protect-bytes",
        type=int,
        default=0,
        help="session eviction: protected bytes per session (0: no per-session cap)",
    )
    parser.add_argument(
        "--session-idle-s",
        type=float,
        default=300.0,
        help="session eviction: a session without a write for this long is closed",
    )
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        auth_key = metadata_key(args.secret_file) if args.secret_file else None  # before binding
    except SecretError as exc:
        raise SystemExit(f"pdcache metadata-server: --secret-file: {exc}") from None
    eviction = StorageEviction(
        args.eviction, args.session_protect_share, args.session_protect_bytes, args.session_idle_s
    )
    service = MetadataService(
        args.state_dir, args.capacity_pages, args.reservation_ttl, eviction=eviction,
        store=_store(args),
    )
    service.start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def announce(endpoint: str) -> None:
        print(f"pdcache metadata-server listening on {endpoint}", flush=True)

    try:
        port = "*" if args.port == 0 else str(args.port)  # zmq spells "any free port" as *
        serve(service, f"tcp://{args.host}:{port}", stop, on_ready=announce, auth_key=auth_key)
    except zmq.ZMQError as exc:  # the port is taken, the address is not this host's
        raise SystemExit(f"pdcache metadata-server: cannot listen on {args.host}:{args.port}: "
                         f"{exc}") from None
    finally:
        service.close()
    return 0


def _store(args: argparse.Namespace) -> EtcdIndexStore | None:
    if args.store == "sqlite":
        if not args.state_dir:
            raise SystemExit("pdcache metadata-server: --store sqlite needs --state-dir")
        return None
    if not args.etcd_endpoints:
        raise SystemExit("pdcache metadata-server: --store etcd needs --etcd-endpoints")
    if args.port == 0:
        raise SystemExit("pdcache metadata-server: --store etcd needs a fixed --port (replicas "
                         "advertise it to clients)")
    if not args.advertise and args.host in ("0.0.0.0", "::", "*", ""):
        raise SystemExit("pdcache metadata-server: --host is a wildcard; give --advertise "
                         "tcp://ADDRESS:PORT, the address clients reach this replica at")
    advertise = args.advertise or f"tcp://{args.host}:{args.port}"
    return EtcdIndexStore(parse_endpoints(args.etcd_endpoints), advertise, args.etcd_prefix,
                          args.lease_ttl)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pdcache metadata-server")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
