"""`pdcache decode`: a decode node (KV receiver, continuous-batching decode, offload).

With `--config TOPOLOGY --node NAME` every setting comes from the topology; otherwise from
the flags (`--storage-backend` enables the DecodeOffloadManager unless `--no-offload`).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdcache.launch.node_config import add_node_flags
    from pdcache.launch.topology import add_topology_arguments

    add_topology_arguments(parser)
    add_node_flags(parser, "decode")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--offload-stride-pages", type=int, default=1,
                        help="offload every this many completed pages of a request")
    parser.add_argument("--offload-staging-pages", type=int, default=256,
                        help="host staging pages between device and storage (full: dropped)")


def run(args: argparse.Namespace) -> int:
    from pdcache.decode_node.runtime import DecodeRuntime
    from pdcache.server.cli import run_node

    return run_node(args, "decode", DecodeRuntime)
