"""The settings of one `pdcache bench replay` run: `ReplayConfig`, built from the replay's
command-line options (`pdcache.bench.replay.add_replay_options`), and the run id that
prefixes the `session_id`s a run sends. Plain values, no I/O; read by the run loop
(`pdcache.bench.replay_run`).
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass

MODES = ("afap", "poisson", "poisson-sessions", "trace")


@dataclass(frozen=True)
class ReplayConfig:
    url: str
    mode: str = "afap"
    concurrency: int = 4
    rate: float | None = None
    speedup: float = 1.0
    round_barrier: bool = False
    max_duration_s: float = 1800.0
    drain_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    page_size: int = 16
    max_tokens_cap: int | None = None
    temperature: float = 0.0
    stream: bool = True
    send_session_id: bool = True
    cache_salt: str | None = None
    seed: int = 0
    progress: bool = True
    session_prefix: str = ""  # "" sends the trace's session ids as they are
    # stop the run (cancel what is in flight, send nothing more) once this many requests
    # had a TTFT over slow_ttft_s: `bench goodput` ends a point whose verdict is settled
    stop_after_slow: int | None = None
    slow_ttft_s: float | None = None

    def session_id_for(self, trace_session_id: str) -> str:
        """The `session_id` sent for a trace session: `PREFIX-SID`, or SID without a prefix."""
        prefix = self.session_prefix
        return f"{prefix}-{trace_session_id}" if prefix else trace_session_id

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplayConfig:
        mode = args.mode or ("poisson" if args.rate else "afap")
        if mode in ("poisson", "poisson-sessions") and not args.rate:
            raise ValueError(f"--mode {mode} needs --rate R (requests per second)")
        if args.concurrency < 1 or args.speedup <= 0:
            raise ValueError("--concurrency must be >= 1 and --speedup > 0")
        return cls(
            url=args.url.rstrip("/"), mode=mode, concurrency=args.concurrency, rate=args.rate,
            speedup=args.speedup, round_barrier=args.round_barrier,
            max_duration_s=args.max_duration, drain_timeout_s=args.drain_timeout,
            request_timeout_s=args.request_timeout, page_size=args.page_size,
            max_tokens_cap=args.max_tokens_cap, temperature=args.temperature,
            stream=args.stream, send_session_id=args.session_id, cache_salt=args.cache_salt,
            seed=args.seed,
            progress=args.progress,
            session_prefix=new_run_id() if args.session_prefix is None else args.session_prefix,
            stop_after_slow=getattr(args, "stop_after_slow", None),
            slow_ttft_s=getattr(args, "slow_ttft", None),
        )


def new_run_id() -> str:
    """A fresh run id, `r` + 8 hex digits: the default session-id prefix of one replay."""
    return f"r{secrets.token_hex(4)}"
