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

log = logging.getLogger(__name__)

READY_PREFIX = "pdcache serve: ready at "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdcache.config import add_node_flags, add_topology_arguments

    add_node_flags(parser, "unified")
    add_topology_arguments(parser)


def build_engine(setup, model, tokenizer):
    """The engine of a unified node (with HiCache tiers when `setup.tiers`) and what closes
    the tiers at exit (None without them)."""
    from pdcache.engine.engine import Engine
    from pdcache.offload_manager.builder import build_tiered_engine

    if setup.tiers is None:
        return Engine(setup.engine, model, tokenizer), None
    tiered = build_tiered_engine(setup.engine, model, tokenizer, setup.tiers)

    def close_tiers() -> None:
        tiered.hicache.close()
        if tiered.storage is not None:
            tiered.storage.close()

    return tiered.engine, close_tiers


class _AnnouncingServer(uvicorn.Server):
    """Prints the URL once the listening socket is up, so scripts can wait for that line."""

    def __init__(self, config: uvicorn.Config, url: str, prefix: str = READY_PREFIX) -> None:
        super().__init__(config)
        self._url = url
        self._prefix = prefix

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(f"{self._prefix}{self._url}", flush=True)


def listen(host: str, port: int, command: str) -> socket.socket | None:
    """Bind the HTTP socket first, so a busy port fails before the model loads."""
    try:
        return socket.create_server((host, port))
    except OSError as exc:
        print(f"pdcache {command}: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return None


def serve_app(app, sock: socket.socket, host: str, log_level: str, command: str = "serve") -> int:
    """Run `app` on the bound `sock` until SIGINT/SIGTERM; prints the ready line."""
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    uv_config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    server = _AnnouncingServer(uv_config, f"http://{shown}:{port}",
                               f"pdcache {command}: ready at ")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1


def run(args: argparse.Namespace) -> int:
    from pdcache.config import TopologyError, setup_for, topology_for
    from pdcache.engine.loader import load_model
    from pdcache.server.app import ServerConfig, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        topology, name = topology_for(args, "unified")
    except TopologyError as exc:
        print(f"pdcache serve: {exc}", file=sys.stderr)
        return 2
    node = topology.node(name)
    sock = listen(node.host, node.port, "serve")
    if sock is None:
        return 1
    spec = topology.model
    try:
        model, tokenizer = load_model(spec.ref, dtype=spec.dtype, seed=spec.seed)
        setup = setup_for(topology, name, model.config)
        engine, closer = build_engine(setup, model, tokenizer)
    except (OSError, ValueError) as exc:  # unknown preset, missing files, bad config
        sock.close()
        print(f"pdcache serve: cannot load model {spec.ref!r}: {exc}", file=sys.stderr)
        return 2
    config = ServerConfig(name=setup.name, request_timeout_s=setup.server.request_timeout_s)
    app = create_app(engine, config, on_shutdown=closer)
    return serve_app(app, sock, node.host, args.log_level)
