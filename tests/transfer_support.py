"""Shared helpers of the transfer tests: engine availability, fast configs, pools, waits."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

# Before any engine library loads (also inherited by spawned processes).
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib*")

from pdcache.transfer.config import TransferConfig  # noqa: E402
from pdcache.transfer.engines.base import ENGINES  # noqa: E402
from tests.polling import dump_threads, scaled_limit, wait_until  # noqa: E402, F401 (re-exported)

_MODULES = {"zmq": "zmq", "mooncake": "mooncake.engine", "nixl": "nixl_cu12._api"}
_PACKAGES = {"mooncake": "mooncake-transfer-engine-non-cuda (+ libibverbs1)",
             "nixl": "nixl-cu12"}


def engine_missing(name: str) -> str:
    """Why engine `name` cannot run here ('' when it can)."""
    try:
        importlib.import_module(_MODULES[name])
    except Exception as exc:  # ImportError, or OSError from a missing system library
        return f"{name} engine needs {_PACKAGES.get(name, name)}: {exc}"
    return ""


def engine_params(names: tuple[str, ...] = ("zmq", "mooncake", "nixl")) -> list:
    return [pytest.param(n, marks=pytest.mark.skipif(bool(engine_missing(n)),
                                                     reason=engine_missing(n) or "-"))
            for n in names]


def fast_config(engine: str, **overrides) -> TransferConfig:
    # 4 s of silence before a peer is dead: a loaded 2-core CI machine can stall a process ~3 s.
    values = dict(engine=engine, heartbeat_interval_s=0.25, heartbeat_misses=16,
                  bootstrap_timeout_s=5.0, room_timeout_s=8.0, abort_ack_timeout_s=2.0,
                  max_message_bytes=4096)
    values.update(overrides)
    config = TransferConfig(**values)
    # what a node's entry point does once: the settings Mooncake / UCX read from the environment
    os.environ.update(ENGINES.get(engine).environment(config, os.environ))
    return config


def make_pool(num_pages: int, seed: int | None, layers: int = 4) -> torch.Tensor:
    """A [L, 2, P, S=4, H=2, D=16] float32 pool: 512-byte pages; random when seeded."""
    shape = (layers, 2, num_pages, 4, 2, 16)
    if seed is None:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen)


def spawn_child(target, *args):  # type: ignore[no-untyped-def]
    """Run `target(*args, conn)` in a child process; returns (process, the parent's end of
    its pipe). forkserver: a clean single-threaded server imports torch once, then forks each
    child, as safe as spawn (no threads or engine state inherited) without the import cost."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "zmq", "pdcache.transfer.sender",
                                "pdcache.transfer.receiver", "tests.transfer_support"])
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child_conn), daemon=True)
    proc.start()
    return proc, parent_conn

