"""`pdcache metadata-server`: run the global KV manager (hf3fs key -> slot index service)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from pdcache.offload_manager.storage.config import STORAGE_EVICTIONS
from pdcache.offload_manager.storage.lifecycle import StorageEviction
from pdcache.offload_manager.storage.metadata_service import (
    MetadataService,
    metadata_key,
    serve,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=18000, help="port to bind (0: any free port)")
    parser.add_argument("--state-dir", required=True, help="directory of the persisted index")
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
    auth_key = metadata_key(args.secret_file) if args.secret_file else None  # before binding
    eviction = StorageEviction(
        args.eviction, args.session_protect_share, args.session_protect_bytes, args.session_idle_s
    )
    service = MetadataService(
        args.state_dir, args.capacity_pages, args.reservation_ttl, eviction=eviction
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def announce(endpoint: str) -> None:
        print(f"pdcache metadata-server listening on {endpoint}", flush=True)

    try:
        port = "*" if args.port == 0 else str(args.port)  # zmq spells "any free port" as *
        serve(service, f"tcp://{args.host}:{port}", stop, on_ready=announce, auth_key=auth_key)
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pdcache metadata-server")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
