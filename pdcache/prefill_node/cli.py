"""`pdcache prefill`: a prefill node (HiCache + KV bootstrap endpoint + HTTP).

With `--config TOPOLOGY --node NAME` every setting comes from the topology (the launcher's
node command contract); otherwise from the flags.
"""

from __future__ import annotations

import argparse
import logging
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdcache.launch.node_config import add_node_flags
    from pdcache.launch.topology import add_topology_arguments

    add_topology_arguments(parser)
    add_node_flags(parser, "prefill")
    parser.add_argument("--request-timeout", type=float, default=600.0)


def run(args: argparse.Namespace) -> int:
    return run_node(args, "prefill")


def run_node(args: argparse.Namespace, role: str) -> int:
    """Shared by `pdcache prefill` and `pdcache decode`."""
    from pdcache.engine.loader import load_model
    from pdcache.launch.node_config import setup_from_flags, setup_from_topology
    from pdcache.launch.topology import TopologyError, node_from_args
    from pdcache.server.cli import listen, serve_app

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
        offload = {} if role == "prefill" else {
            "stride_pages": args.offload_stride_pages,
            "staging_pages": args.offload_staging_pages}
        app = _build(role, setup, model, tokenizer, args.request_timeout, **offload)
    except (OSError, ValueError) as exc:
        sock.close()
        print(f"pdcache {role}: cannot start: {exc}", file=sys.stderr)
        return 2
    return serve_app(app, sock, host, args.log_level, role)


def _build(role: str, setup, model, tokenizer, request_timeout_s: float, **offload_settings):
    if role == "prefill":
        from pdcache.prefill_node.node import build_prefill_app

        app, server = build_prefill_app(setup, model, tokenizer, request_timeout_s)
        print(f"pdcache prefill: KV bootstrap at {server.sender.bootstrap_addr}", flush=True)
        return app
    from pdcache.decode_node.node import build_decode_app

    app, _ = build_decode_app(setup, model, tokenizer, request_timeout_s=request_timeout_s,
                              **offload_settings)
    return app
