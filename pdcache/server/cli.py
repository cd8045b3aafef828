"""`pdcache serve`: one process doing prefill and decode behind the HTTP contract.

Prints `pdcache serve: ready at http://HOST:PORT` (flushed) once the engine is up and the
socket accepts connections; `--port 0` picks a free port, and the printed URL names it.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from pdcache.engine.config import DTYPES, CacheConfig, SchedulerConfig
from pdcache.server.runtime import READY_PREFIX, listen, serve

log = logging.getLogger(__name__)

__all__ = ["READY_PREFIX", "add_arguments", "listen", "run", "run_node", "serve_app"]


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
    from pdcache.launch.node_config import add_cache_flags
    from pdcache.launch.topology import add_topology_arguments

    add_topology_arguments(parser)
    add_cache_flags(parser)


def build_engine(args: argparse.Namespace):
    """The engine (with HiCache tiers when configured) and what closes them at exit."""
    from pdcache.engine.config import EngineConfig
    from pdcache.engine.engine import Engine
    from pdcache.engine.loader import load_model
    from pdcache.launch.node_config import setup_from_topology, tiers_from_flags
    from pdcache.offload_manager.builder import build_tiered_engine, fingerprint_for, model_identity

    model, tokenizer = load_model(args.model, dtype=args.dtype, seed=args.seed)
    cache = CacheConfig(page_size=args.page_size, num_device_pages=args.device_pages,
                        enable_prefix_cache=not args.no_prefix_cache)
    scheduler = SchedulerConfig(max_running_requests=args.max_running,
                                chunked_prefill_tokens=args.chunked_prefill_tokens,
                                max_queued_requests=args.max_queued)
    config = EngineConfig(model.config, cache, scheduler, seed=args.seed)
    if getattr(args, "topology", None) is not None:
        tiers = setup_from_topology(args.topology, args.topology_node, model.config).tiers
    else:
        fp = fingerprint_for(model.config, model_identity(args.model, args.seed), args.page_size)
        tiers, _ = tiers_from_flags(args, model.config, args.page_size, args.device_pages, fp)
    if tiers is None or args.no_prefix_cache:
        return Engine(config, model, tokenizer), None
    tiered = build_tiered_engine(config, model, tokenizer, tiers)

    def close_tiers() -> None:
        tiered.hicache.close()
        if tiered.storage is not None:
            tiered.storage.close()

    return tiered.engine, close_tiers


class _AppRuntime:
    """An app built elsewhere, served as a runtime (the nodes, until they are runtimes)."""

    def __init__(self, app) -> None:
        self._app = app

    def app(self):
        return self._app

    def ready_lines(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


def serve_app(app, sock: socket.socket, host: str, log_level: str, command: str = "serve") -> int:
    """Run `app` on the bound `sock` until SIGINT/SIGTERM; prints the ready line."""
    return serve(_AppRuntime(app), sock, host, log_level, command)


def run(args: argparse.Namespace) -> int:
    from pdcache.server.app import ServerConfig, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        args = _apply_topology(args)
    except ValueError as exc:  # TopologyError included
        print(f"pdcache serve: {exc}", file=sys.stderr)
        return 2
    sock = listen(args.host, args.port, "serve")
    if sock is None:
        return 1
    try:
        engine, closer = build_engine(args)
    except (OSError, ValueError) as exc:  # unknown preset, missing files, bad config
        sock.close()
        print(f"pdcache serve: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        return 2
    config = ServerConfig(name=args.name, request_timeout_s=args.request_timeout)
    app = create_app(engine, config, on_shutdown=closer)
    return serve_app(app, sock, args.host, args.log_level)


def _apply_topology(args: argparse.Namespace) -> argparse.Namespace:
    """With --config/--node, the topology's settings replace the flags' defaults."""
    from pdcache.launch.topology import node_from_args

    found = node_from_args(args, ("unified",))
    if found is None:
        return args
    topology, node = found
    storage = topology.storage
    values = dict(
        model=topology.model.ref, dtype=topology.model.dtype, seed=topology.model.seed,
        name=node.name, host=node.host, port=node.port, page_size=node.cache.page_size,
        device_pages=node.cache.device_pages, topology=topology, topology_node=node,
        storage_backend=storage.backend,
    )
    return argparse.Namespace(**{**vars(args), **values})


def run_node(args: argparse.Namespace, role: str, runtime_cls: type) -> int:
    """`pdcache prefill|decode`: the node's `NodeSetup` (from `--config/--node`, else from
    the flags), its `runtime_cls(setup, model, tokenizer)` served on the bound socket."""
    from pdcache.engine.loader import load_model
    from pdcache.launch.node_config import setup_from_flags, setup_from_topology
    from pdcache.launch.topology import TopologyError, node_from_args

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        found = node_from_args(args, (role,))
    except TopologyError as exc:
        print(f"pdcache {role}: {exc}", file=sys.stderr)
        return 2
    model_ref = found[0].model.ref if found else args.model
    dtype, seed = (found[0].model.dtype, found[0].model.seed) if found else (args.dtype, args.seed)
    host, port = (found[1].host, found[1].port) if found else (args.host, args.port)
    sock = listen(host, port, role)
    if sock is None:
        return 1
    try:
        model, tokenizer = load_model(model_ref, dtype=dtype, seed=seed)
        setup = (setup_from_topology(*found, model.config) if found
                 else setup_from_flags(args, role, model.config))
        runtime = runtime_cls(setup, model, tokenizer)
    except (OSError, ValueError) as exc:
        sock.close()
        print(f"pdcache {role}: cannot start: {exc}", file=sys.stderr)
        return 2
    return serve(runtime, sock, host, args.log_level, role)
