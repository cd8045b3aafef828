"""`pdcache serve`: one process doing prefill and decode behind the HTTP contract.

Prints `pdcache serve: ready at http://HOST:PORT` (flushed) once the engine is up and the
socket accepts connections; `--port 0` picks a free port, and the printed URL names it.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

import uvicorn

from pdcache.engine.config import DTYPES, CacheConfig, SchedulerConfig

log = logging.getLogger(__name__)

READY_PREFIX = "pdcache serve: ready at "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cache, sched = CacheConfig(), SchedulerConfig()
    parser.add_argument("--model", default="tiny", help="preset (tiny, small) or a HF model dir")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    parser.add_argument("--page-size", type=int, default=cache.page_size)
    parser.add_argument("--device-pages", type=int, default=cache.num_device_pages)
    parser.add_argument("--max-running", type=int, default=sched.max_running_requests)
    parser.add_argument("--max-queued", type=int, default=sched.max_queued_requests)
    parser.add_argument("--chunked-prefill-tokens", type=int, default=sched.chunked_prefill_tokens)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--no-prefix-cache", action="store_true", help="disable prefix reuse")
    parser.add_argument("--seed", type=int, default=0, help="seed of preset weights and sampling")
    parser.add_argument("--name", default="unified", help="this server's name in responses")
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="deadline of one request (s)"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])


def build_engine(args: argparse.Namespace):
    from pdcache.engine.engine import Engine

    return Engine.from_spec(
        args.model,
        cache=CacheConfig(
            page_size=args.page_size,
            num_device_pages=args.device_pages,
            enable_prefix_cache=not args.no_prefix_cache,
        ),
        scheduler=SchedulerConfig(
            max_running_requests=args.max_running,
            chunked_prefill_tokens=args.chunked_prefill_tokens,
            max_queued_requests=args.max_queued,
        ),
        dtype=args.dtype,
        seed=args.seed,
    )


class _AnnouncingServer(uvicorn.Server):
    """Prints the URL once the listening socket is up, so scripts can wait for that line."""

    def __init__(self, config: uvicorn.Config, url: str) -> None:
        super().__init__(config)
        self._url = url

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(f"{READY_PREFIX}{self._url}", flush=True)


def run(args: argparse.Namespace) -> int:
    from pdcache.server.app import ServerConfig, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        print(f"pdcache serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    try:
        engine = build_engine(args)
    except (OSError, ValueError) as exc:  # unknown preset, missing files, bad config
        sock.close()
        print(f"pdcache serve: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        return 2
    config = ServerConfig(name=args.name, request_timeout_s=args.request_timeout)
    app = create_app(engine, config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    uv_config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
    server = _AnnouncingServer(uv_config, f"http://{host}:{port}")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
