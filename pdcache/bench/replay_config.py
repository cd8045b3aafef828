"""The settings of one replay: `ReplayConfig`, the typed options of `pdcache.bench.replay.replay`
(built from the command line by `from_args`, or directly by the benches that launch stacks),
and the run id that prefixes the `session_id`s a run sends. Plain values, no I/O; read by the
run loop (`pdcache.bench.replay_run`).
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import asdict, dataclass, replace
from typing import Any

MODES = ("afap", "poisson", "poisson-sessions", "trace")


@dataclass(frozen=True)
class ReplayConfig:
    """Every setting of one replay: the target, the trace and how it is prepared, the run
    loop's pacing and limits, and the report. `from_args` reads the command line; the
    launching benches (`bench compare`, `bench goodput`, `pdcache demo`) build one and
    `dataclasses.replace` what differs per run. `resolved()` is what a run uses."""

    url: str = ""
    trace: str = ""  # FORMAT:PATH or synthetic:key=value,... (pdcache.bench.traces)
    mode: str | None = None  # None: poisson with a rate, else afap
    concurrency: int = 4
    rate: float | None = None
    speedup: float = 1.0
    round_barrier: bool = False
    max_requests: int | None = None  # keep the first N requests (whole sessions)
    max_duration_s: float = 1800.0
    drain_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    page_size: int = 16
    max_tokens_cap: int | None = None
    vocab_size: int = 256  # token ids are drawn from [vocab_low, vocab_size)
    vocab_low: int = 0
    token_seed: int = 0
    block_size: int | None = None  # of the trace's ids (None: the format's)
    scale_block_size: int | None = None
    temperature: float = 0.0
    stream: bool = True
    send_session_id: bool = True
    cache_salt: str | None = None
    seed: int = 0
    progress: bool = True
    plots: bool = True
    # None: a fresh run id per run (`resolved`); "" sends the trace's session ids as they are
    session_prefix: str | None = None
    # stop the run (cancel what is in flight, send nothing more) once this many requests
    # had a TTFT over slow_ttft_s: `bench goodput` ends a point whose verdict is settled
    stop_after_slow: int | None = None
    slow_ttft_s: float | None = None

    def session_id_for(self, trace_session_id: str) -> str:
        """The `session_id` sent for a trace session: `PREFIX-SID`, or SID without a prefix."""
        prefix = self.session_prefix
        return f"{prefix}-{trace_session_id}" if prefix else trace_session_id

    def resolved(self) -> ReplayConfig:
        """This config as one run uses it: the mode chosen, a fresh session prefix when none
        was given, the URL without a trailing slash. ValueError names a bad setting."""
        mode = self.mode or ("poisson" if self.rate else "afap")
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
        if mode in ("poisson", "poisson-sessions") and not self.rate:
            raise ValueError(f"--mode {mode} needs --rate R (requests per second)")
        if self.rate is not None and not self.rate > 0:  # a negative one crashed every session
            raise ValueError(f"--rate must be > 0 requests per second, not {self.rate}")
        if self.concurrency < 1 or self.speedup <= 0:
            raise ValueError("--concurrency must be >= 1 and --speedup > 0")
        prefix = new_run_id() if self.session_prefix is None else self.session_prefix
        return replace(self, url=self.url.rstrip("/"), mode=mode, session_prefix=prefix)

    def run_settings(self) -> dict[str, Any]:
        """The settings of the run loop, as `summary.json` names them under `config`."""
        return {k: v for k, v in asdict(self).items() if k not in TRACE_SETTINGS}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplayConfig:
        """The options of `add_replay_options` (and `--url` where the command has one)."""
        return cls(
            url=getattr(args, "url", ""), trace=args.trace, mode=args.mode,
            concurrency=args.concurrency, rate=args.rate, speedup=args.speedup,
            round_barrier=args.round_barrier, max_requests=args.max_requests,
            max_duration_s=args.max_duration, drain_timeout_s=args.drain_timeout,
            request_timeout_s=args.request_timeout, page_size=args.page_size,
            max_tokens_cap=args.max_tokens_cap, vocab_size=args.vocab_size,
            vocab_low=args.vocab_low, token_seed=args.token_seed, block_size=args.block_size,
            scale_block_size=args.scale_block_size, temperature=args.temperature,
            stream=args.stream, send_session_id=args.session_id, cache_salt=args.cache_salt,
            seed=args.seed, progress=args.progress, plots=args.plots,
            session_prefix=args.session_prefix, stop_after_slow=args.stop_after_slow,
            slow_ttft_s=args.slow_ttft,
        )


# How the trace is read and expanded, and the report: not the run loop's (`run_settings`).
TRACE_SETTINGS = frozenset({"trace", "max_requests", "vocab_size", "vocab_low", "token_seed",
                            "block_size", "scale_block_size", "plots"})


def new_run_id() -> str:
    """A fresh run id, `r` + 8 hex digits: the default session-id prefix of one replay."""
    return f"r{secrets.token_hex(4)}"
