"""`pdcache prefill`: a prefill node (HiCache + KV bootstrap endpoint + HTTP).

With `--config TOPOLOGY --node NAME` every setting comes from the topology (the launcher's
node command contract); otherwise the flags describe a one-node topology. Either way the node
is set up by `pdcache.config.setup_for`. Prints `pdcache prefill: KV bootstrap at
tcp://HOST:PORT`, then the ready line.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdcache.config import add_node_flags, add_topology_arguments

    add_topology_arguments(parser)
    add_node_flags(parser, "prefill")


def run(args: argparse.Namespace) -> int:
    from pdcache.prefill_node.runtime import PrefillRuntime
    from pdcache.server.cli import run_node

    return run_node(args, "prefill", PrefillRuntime)
