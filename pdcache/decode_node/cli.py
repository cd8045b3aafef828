"""`pdcache decode`: a decode node (KV receiver, continuous-batching decode, offload).

With `--config TOPOLOGY --node NAME` every setting comes from the topology; otherwise the
flags describe a one-node topology (`--storage-backend` enables the DecodeOffloadManager
unless `--no-offload`).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdcache.config import add_node_flags, add_topology_arguments

    add_topology_arguments(parser)
    add_node_flags(parser, "decode")


def run(args: argparse.Namespace) -> int:
    from pdcache.decode_node.runtime import DecodeRuntime
    from pdcache.server.cli import run_node

    return run_node(args, "decode", DecodeRuntime)
