"""`pdcache serve` (a unified node), and `run_node`, which every node command runs.

Prints `pdcache ROLE: ready at http://HOST:PORT` (flushed) once the node is up and the socket
accepts connections; `--port 0` picks a free port, and the printed URL names it. With
`--config TOPOLOGY --node NAME` every setting comes from the topology; otherwise the flags
describe a one-node topology. Either way the node is set up by `pdcache.config.setup_for`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from pdcache.server.runtime import READY_PREFIX, NodeRuntime, serve
from pdcache.wire.serving import listen

log = logging.getLogger(__name__)

__all__ = ["READY_PREFIX", "add_arguments", "run", "run_node"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdcache.config import add_node_flags, add_topology_arguments

    add_node_flags(parser, "unified")
    add_topology_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pdcache.server.runtime import UnifiedRuntime

    return run_node(args, "unified", UnifiedRuntime)


def run_node(args: argparse.Namespace, role: str, runtime_cls: type[NodeRuntime]) -> int:
    """Set up the node `role` from its topology, bind its socket (a busy port fails before the
    model loads), build `runtime_cls(setup, model, tokenizer)` and serve it until SIGINT or
    SIGTERM. Exit codes: 0 served, 1 could not listen or start serving, 2 bad config/model."""
    from pdcache.config import TopologyError, process_environment, setup_for, topology_for
    from pdcache.engine.loader import load_model

    command = "serve" if role == "unified" else role
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        topology, name = topology_for(args, role)
    except TopologyError as exc:
        print(f"pdcache {command}: {exc}", file=sys.stderr)
        return 2
    node = topology.node(name)
    sock = listen(node.bind_host or node.host, node.port, command)
    if sock is None:
        return 1
    spec = topology.model
    # A pod's process is PID 1, for which the kernel ignores a signal with the default
    # action: without a handler a SIGTERM while the model loads (minutes) was ignored until
    # the grace period ran out. uvicorn installs its own once it serves.
    previous = signal.signal(signal.SIGTERM, _stop_while_loading)
    try:
        model, tokenizer = load_model(spec.ref, dtype=spec.dtype, seed=spec.seed)
        setup = setup_for(topology, name, model.config)
        # Once, before any transfer engine or store loads: settings their libraries read only
        # from the environment (Mooncake's bind address and timeouts; UCX), from the config.
        os.environ.update(process_environment(setup, os.environ))
        runtime = runtime_cls(setup, model, tokenizer)
    except (OSError, ValueError) as exc:  # unknown preset, missing files, bad config
        sock.close()
        print(f"pdcache {command}: cannot start {spec.ref!r}: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    return serve(runtime, sock, node.host, args.log_level, command, drain_s=node.drain_s)


def _stop_while_loading(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
