"""`pdcache storage stats|clear|verify --config TOPOLOGY`: inspect, empty or check the storage
tier of a deployment.

`--config` is a topology file, the same schema every other command reads; its `[storage]`
table and `[model]` (for the page geometry and the KV fingerprint, read without loading any
weights) name the storage the nodes open. `--set KEY=VALUE` overrides topology keys as for
`pdcache launch` (`storage.path="/tmp/s"`); `--node NAME` picks whose view of the storage
(page size) to open, by default the first node that uses storage. The metadata service or
Mooncake master of the topology must be running (`pdcache launch` starts them).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdcache.config.parse import load_topology
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig

VERIFY_BATCH = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["stats", "clear", "verify"])
    parser.add_argument("--config", required=True, metavar="TOPOLOGY",
                        help="topology TOML file (see configs/)")
    parser.add_argument("--node", metavar="NAME",
                        help="open the storage as this node does (default: the first storage user)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="topology override: storage.path=/tmp/s, model.preset=tiny (repeatable)")


def load_config(path: str, overrides: list[str], node: str | None = None) -> StorageConfig:
    """The StorageConfig of topology `path` (with `overrides`) as node `node` opens it.
    Raises TopologyError (a ValueError) or OSError."""
    from pdcache.config.node_setup import storage_for
    from pdcache.engine.loader import load_model_config

    topology = load_topology(path, overrides)
    spec = topology.model
    model = load_model_config(spec.ref, dtype=spec.dtype, seed=spec.seed)
    try:
        return storage_for(topology, model, node)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def verify(backend: Any) -> dict[str, int]:
    """Read every known page and check it; counts of good and bad pages."""
    import torch

    keys = backend.keys()
    page_bytes = backend.spec.payload_bytes
    scratch = torch.empty(VERIFY_BATCH, page_bytes, dtype=torch.uint8)
    good = 0
    for start in range(0, len(keys), VERIFY_BATCH):
        batch = keys[start : start + VERIFY_BATCH]
        good += sum(backend.get_into(batch, list(scratch[: len(batch)])))
    rejected = int(backend.stats().get("rejected_slots", 0))  # hf3fs: bad headers at open
    return {"pages": len(keys) + rejected, "good": good, "bad": len(keys) - good + rejected}


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.overrides, args.node)
    except (OSError, ValueError, TypeError) as exc:  # TopologyError included
        print(f"pdcache storage: bad config: {exc}", file=sys.stderr)
        return 2
    if args.action == "verify" and config.backend == "mooncake":
        print("pdcache storage verify: Mooncake Store cannot list objects", file=sys.stderr)
        return 2
    try:
        backend = create_backend(config)
    except Exception as exc:  # unreachable metadata service / master, missing package, ...
        print(f"pdcache storage: cannot open {config.backend} storage: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    try:
        unreachable = _unreachable_metadata(backend)
        if unreachable:  # hf3fs connects lazily: stats printed zeros, clear a traceback
            print(f"pdcache storage: {unreachable}", file=sys.stderr)
            return 1
        result = _act(args.action, backend)
    except Exception as exc:  # noqa: BLE001 - a failing store is a one-line error, not a trace
        print(f"pdcache storage {args.action}: failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    finally:
        backend.close()
    print(json.dumps(result, indent=2, sort_keys=True))
    return 1 if result.get("bad") else 0


def _unreachable_metadata(backend: Any) -> str:
    """Why the backend's metadata service cannot be used ('' when it can, or has none)."""
    ping = getattr(getattr(backend, "metadata", None), "ping", None)
    if ping is None or ping():
        return ""
    address = getattr(backend.metadata, "address", "?")
    return (f"the metadata service {address} does not answer: is `pdcache metadata-server` "
            "running (pdcache launch starts it)?")


def _act(action: str, backend: Any) -> dict[str, Any]:
    if action == "stats":
        return dict(backend.stats())
    if action == "clear":
        before = len(backend.keys())
        removed = backend.clear()
        return {"cleared": removed if isinstance(removed, int) else before}
    return verify(backend)
