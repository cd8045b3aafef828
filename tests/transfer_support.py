"""Shared helpers of the transfer tests: engine availability, fast configs, pools, waits."""

from __future__ import annotations

import faulthandler
import importlib
import os
import sys
import time
from collections.abc import Callable

import pytest
import torch

# Before any engine library loads (also inherited by spawned processes).
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib*")

from pdcache.transfer.config import TransferConfig  # noqa: E402
from pdcache.transfer.engines.base import ENGINES  # noqa: E402

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


# A wait's own bound holds on a quiet machine; its failing limit is that many times it, more
# when the run queue is deeper than the cores: the 2-core CI machine under the whole suite has
# stalled a process past a 3 s wait that takes ~10 ms when quiet. The polls return as soon as
# their condition holds, so the slack costs a passing wait nothing (a wait expected to time
# out takes its bound unscaled). The same goes for a timeout handed to the code under test
# where the test expects success (`receiver.wait(room, scaled_limit(5.0))`): beside a CPU hog
# on both cores a Register went unanswered for 3 s. Capped below pytest-timeout's 300 s, so a
# wait that never ends fails with its own message, not a stack dump.
WAIT_SLACK = 3.0
WAIT_CAP_S = 250.0


def scaled_limit(timeout_s: float) -> float:
    """`timeout_s` scaled for this machine's load now (see WAIT_SLACK), at most WAIT_CAP_S."""
    cores = len(os.sched_getaffinity(0)) or 1  # the cores this process may run on
    load_per_core = os.getloadavg()[0] / cores
    return min(timeout_s * WAIT_SLACK * max(1.0, load_per_core), max(timeout_s, WAIT_CAP_S))


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `pred` until true; returns the seconds it took, fails the test once it has waited
    `scaled_limit(timeout_s)`."""
    start, limit_s = time.monotonic(), scaled_limit(timeout_s)
    while not pred():
        if time.monotonic() - start > limit_s:
            dump_threads()
            pytest.fail(f"timed out after {limit_s:.1f}s (bound {timeout_s}s) waiting for {what}")
        time.sleep(0.005)
    return time.monotonic() - start


def dump_threads() -> None:
    """Every thread's stack to stderr (the test's captured output), for a wait that failed:
    one CI run saw every control thread of the process stall at once on an idle machine, so
    the thread holding them up is what the report needs."""
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
