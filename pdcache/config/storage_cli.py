"""`pdcache storage stats|clear|verify --config FILE`: inspect, empty or check a storage tier.

The config is a TOML file whose `[storage]` table (or whole content) is a StorageConfig;
`--set key=value` overrides single keys (values in TOML syntax: 4096, "file", true).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig, tomllib

VERIFY_BATCH = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["stats", "clear", "verify"])
    parser.add_argument("--config", required=True, help="TOML file with a [storage] table")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one storage key (TOML value)",
    )


def load_config(path: str, overrides: list[str]) -> StorageConfig:
    config = StorageConfig.from_toml(path)
    changes: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            changes[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            changes[key.strip()] = value  # a bare string
    return StorageConfig.from_mapping({**_fields(config), **changes})


def _fields(config: StorageConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


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
        config = load_config(args.config, args.overrides)
    except (OSError, ValueError, TypeError) as exc:
        print(f"pdcache storage: bad config: {exc}", file=sys.stderr)
        return 2
    backend = create_backend(config)
    try:
        if args.action == "stats":
            result: dict[str, Any] = dict(backend.stats())
        elif args.action == "clear":
            before = len(backend.keys())  # type: ignore[attr-defined]
            removed = backend.clear()  # type: ignore[attr-defined]
            result = {"cleared": removed if isinstance(removed, int) else before}
        else:
            if config.backend == "mooncake":
                print("pdcache storage verify: Mooncake Store cannot list objects", file=sys.stderr)
                return 2
            result = verify(backend)
    finally:
        backend.close()
    print(json.dumps(result, indent=2, sort_keys=True))
    return 1 if result.get("bad") else 0
