"""`pdcache prefill`: a prefill node (HiCache + KV bootstrap endpoint + HTTP).

With `--config TOPOLOGY --node NAME` every setting comes from the topology (the launcher's
node command contract); otherwise the flags describe a one-node topology. Either way the node
is set up by `pdcache.config.setup_for`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdcache.config import add_node_flags, add_topology_arguments

    add_topology_arguments(parser)
    add_node_flags(parser, "prefill")


def run(args: argparse.Namespace) -> int:
    return run_node(args, "prefill")


def run_node(args: argparse.Namespace, role: str) -> int:
    """Shared by `pdcache prefill` and `pdcache decode`."""
    from pdcache.config import TopologyError, process_environment, setup_for, topology_for
    from pdcache.engine.loader import load_model
    from pdcache.server.cli import listen, serve_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        topology, name = topology_for(args, role)
    except TopologyError as exc:
        print(f"pdcache {role}: {exc}", file=sys.stderr)
        return 2
    node = topology.node(name)
    sock = listen(node.host, node.port, role)
    if sock is None:
        return 1
    try:
        spec = topology.model
        model, tokenizer = load_model(spec.ref, dtype=spec.dtype, seed=spec.seed)
        setup = setup_for(topology, name, model.config)
        # Once, before any transfer engine loads: settings its library reads only from the
        # environment (Mooncake's bind address, timeouts; UCX), computed from the config.
        os.environ.update(process_environment(setup, os.environ))
        app = _build(setup, model, tokenizer)
    except (OSError, ValueError) as exc:  # TopologyError included
        sock.close()
        print(f"pdcache {role}: cannot start: {exc}", file=sys.stderr)
        return 2
    return serve_app(app, sock, node.host, args.log_level, role)


def _build(setup, model, tokenizer):
    if setup.role == "prefill":
        from pdcache.prefill_node.node import build_prefill_app

        app, server = build_prefill_app(setup, model, tokenizer)
        print(f"pdcache prefill: KV bootstrap at {server.sender.bootstrap_addr}", flush=True)
        return app
    from pdcache.decode_node.node import build_decode_app

    app, _ = build_decode_app(setup, model, tokenizer)
    return app
