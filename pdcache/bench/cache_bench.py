"""`pdcache bench cache`: TTFT of a prompt of N cached tokens + 64 new ones, by the tier that
holds the N tokens, in one run, in-process (engines, no HTTP, so only the cache differs):

- recompute: nothing cached, all N + 64 tokens prefilled (the cold request that seeds the
  tiers, plus `--recompute-repeats` runs on an engine without prefix cache);
- device: the prefix already in the device pool (the ideal);
- host: the prefix demoted to the host pool (`flush_cache`), loaded back layer by layer;
- hf3fs: a fresh engine (empty device and host tiers) over the same hf3fs directory;
- file: a fresh engine over a `file` backend directory holding the prefix's pages;
- mooncake: a fresh engine over a Mooncake Store (a real `mooncake_master` started here) that
  holds the prefix's pages.

`--layerwise` (default both): hf3fs and file run with the layer-streamed prefetch
(`HiCacheConfig.layerwise_prefetch`: the forward starts while layer l+1 is still being read)
and, as `hf3fs-serial` / `file-serial`, with it off (every page read before admission), in the
same rounds.

Tiers are interleaved round by round with a device hit before every other sample (d, host,
d, hf3fs, d, file, ..., d), so a change of machine load hits them alike; each point is the
median of its `--repeats` runs (5). `vs_device` of a tier is the median of its samples'
paired ratios, each sample's TTFT over the mean of the device hits just before and just after
it, with `vs_device_min` / `vs_device_max` beside it: a ratio of two medians swung 1.01-1.32x
from run to run under the shared machine's load, a paired one compares at one load level.
`recompute` (not interleaved) is a ratio of medians. The device row's own min-max (each
device hit over their median) is the run's noise floor. `seeding`
says how each N's cold request got the prefix into the tiers (recomputed, or loaded from
`--keep-dir`) and how long it took; `elapsed_s` is the whole run's (model load excluded). `exact`: the device hits' first tokens equal a
no-prefix-cache run's, the other tiers' equal a device hit's of the same prompts. Where a
lower tier's time goes: `lookup_ms` (keys + exists_prefix), `read_ms` (storage reads),
`wait_ms` (prefetch start to admission), `h2d_ms` (host → device copies), `copy_wait_ms` (the
forward waiting for them when they run ahead of it on the copier thread, `copy_ahead`).
`--copy-ahead both` adds `-ahead` rows for the page-by-page storage tiers: the same reads
with the copies on the copier thread (`HiCacheConfig.copy_ahead`, off by default).
`hf3fs-warm` (in `--tiers`): a storage hit on the running seeding engine, whose device and host
tiers `drop_cache` emptied just before (a long-running node), where the other storage rows
build a fresh engine per sample. `--page-mac on` seals the stored pages (a page MAC, as under
a cluster secret). The hf3fs rows then read as nodes do by default (`--storage-pipeline
default`: each read in groups beside the next group's reads or page by page, whichever
measured faster lately); `off` reads them page by page (`pipeline_pages = 0`), and `both` adds a
`-pipelined` row for hf3fs-serial: the same reads verifying page groups beside the next group's
reads (`pipeline_pages = 4`, storage/page_pipeline.py) beside the page-by-page rows. A second
table gives storage read GB/s beside a plain memcpy and a plain file read of the same bytes (`pdcache
bench storage`'s method, pages of this model's size).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdcache.bench.table import emit
from pdcache.offload_manager.storage.config import PIPELINE_ON_PAGES

TIERS = ("recompute", "device", "host", "hf3fs", "hf3fs-serial", "hf3fs-serial-ahead",
         "hf3fs-serial-pipelined", "hf3fs-warm", "file", "file-serial", "file-serial-ahead",
         "mooncake-ahead", "mooncake")
# `hf3fs-warm`: a storage hit on the seeding engine itself, after `drop_cache` emptied its
# device and host tiers (a long-running node), where every other storage row builds a fresh
# engine per sample (page by page unless --layerwise on)
WARM = "hf3fs-warm"
DEFAULT_TIERS = ("recompute", "device", "host", "hf3fs", "file", "mooncake")
STREAMING = ("hf3fs", "file")  # backends with a layer-major read
# loads copied host → device on the engine thread, as nodes do by default; `-ahead` rows copy
# them ahead of the forward on the copier thread (HiCacheConfig.copy_ahead). Layer-streamed
# loads always copy on the engine thread.
COPIED_AHEAD = ("hf3fs-serial", "file-serial", "mooncake")
# `-pipelined` rows: sealed pages verified beside the next group's reads (pipeline_pages =
# PIPELINED_PAGES, page_pipeline.py); the other rows read as the store's default does (each
# batch the way that measured faster), or page by page (--storage-pipeline off/both)
PIPELINED = ("hf3fs-serial",)
PIPELINED_PAGES = PIPELINE_ON_PAGES  # the "+mac pipelined" / "-pipelined" rows ([storage] page_pipeline = "on")
BENCH_SECRET = b"pdcache bench cache: a fixed secret, never a deployment's" * 2


def backend_of(tier: str) -> str:
    """The storage backend behind a tier row ("hf3fs-serial-ahead" -> "hf3fs")."""
    return _read_mode(tier).removesuffix("-warm").removesuffix("-serial")


def _read_mode(tier: str) -> str:
    """A tier row without its copy and verify variants ("hf3fs-serial-pipelined" -> "hf3fs-serial")."""
    return tier.removesuffix("-pipelined").removesuffix("-ahead")
MB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", "--model", dest="model", default="small",
                        help="preset name or checkpoint directory (default: small)")
    parser.add_argument("--tokens", default="1024,4096,16384",
                        help="cached prefix lengths N, comma-separated (rounded to pages)")
    parser.add_argument("--new-tokens", type=int, default=64, help="uncached tokens after N")
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds: each runs every tier once, a device hit before each "
                             "(median; the ratios to device pair each sample with the device "
                             "hits around it)")
    parser.add_argument("--recompute-repeats", type=int, default=1,
                        help="extra no-cache runs besides the cold seeding one (slow at 16k)")
    parser.add_argument("--tiers", default=",".join(DEFAULT_TIERS),
                        help=f"comma-separated subset of {', '.join(TIERS)}")
    parser.add_argument("--copy-ahead", default="off", choices=["on", "off", "both"],
                        help="page-by-page storage rows (hf3fs-serial, file-serial, mooncake) "
                             "with the host → device copy on the engine thread (off, the nodes' "
                             "default), ahead of the forward on the copier thread (on: their "
                             "-ahead rows), or both")
    parser.add_argument("--layerwise", default="both", choices=["on", "off", "both"],
                        help="hf3fs/file with the layer-streamed prefetch, without it (the "
                             "-serial rows), or both (default)")
    parser.add_argument("--page-mac", default="off", choices=["on", "off"],
                        help="stored pages sealed with a page MAC (as under a cluster secret; "
                             "a fixed bench key) or not; a --keep-dir holds one kind")
    parser.add_argument("--storage-pipeline", default="default",
                        choices=["default", "on", "off", "both"],
                        help="hf3fs reads of sealed pages (--page-mac on) as the store's default "
                             "does (default: in groups beside the next group's reads or page by "
                             "page, whichever measured faster), page by page (off: "
                             "pipeline_pages 0), in groups (on: the hf3fs-serial-pipelined "
                             "rows, pipeline_pages "
                             f"{PIPELINED_PAGES}), or page by page and in groups (both)")
    parser.add_argument("--layers-per-read", type=int, default=None,
                        help="layers per read step of the layer-streamed prefetch "
                             "(default: HiCacheConfig's)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="chunked prefill tokens")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--io-threads", type=int, default=1, help="hf3fs IO threads")
    parser.add_argument("--io-batch-pages", type=int, default=64,
                        help="pages per storage read task of the prefetch")
    parser.add_argument("--dir", default=None, help="directory for storage (default: temp dir)")
    parser.add_argument("--keep-dir", default=None,
                        help="persistent storage directory: kept after the run, and a prefix "
                             "already stored there is not recomputed (its cold run is then a "
                             "storage hit, so recompute is measured only by "
                             "--recompute-repeats); seeding 32k tokens of `small` takes minutes")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the GB/s table")
    parser.add_argument("--seed", type=int, default=0)


# ---- one engine and its measurements ---------------------------------------------------


@dataclass
class Sample:
    ttft_s: float
    first_token: int
    cached: dict[str, int]
    breakdown_ms: dict[str, float] = field(default_factory=dict)


BREAKDOWN = {  # column -> HiCacheStats counter (microseconds)
    "lookup_ms": "prefetch_lookup_us",
    "read_ms": "prefetch_read_us",
    "wait_ms": "prefetch_wait_us",
    "h2d_ms": "load_copy_us",
    "copy_wait_ms": "load_copy_wait_us",  # copy_ahead: the forward waiting for the copier
    "layer_wait_ms": "load_stream_wait_us",  # layer-streamed: the forward waiting for a layer
    "verify_wait_ms": "load_verify_wait_us",  # ... and for page verification after it
}


@dataclass
class Point:
    """Samples of one (N, tier)."""

    samples: list[Sample] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return statistics.median(s.ttft_s for s in self.samples)


@dataclass
class Setup:
    """What every engine of the run shares."""

    model: Any
    tokenizer: Any
    args: argparse.Namespace
    base: Path
    max_tokens: int
    master: Any = None  # LocalMooncakeMaster

    @property
    def page_size(self) -> int:
        return self.args.page_size

    def engine_config(self, prefix_cache: bool = True):
        from pdcache.engine.config import CacheConfig, EngineConfig
        from pdcache.engine.scheduler_config import SchedulerConfig

        pages = 2 * (self.max_tokens // self.page_size) + 256
        return EngineConfig(
            model=self.model.config,
            cache=CacheConfig(page_size=self.page_size, num_device_pages=pages,
                              enable_prefix_cache=prefix_cache),
            scheduler=SchedulerConfig(chunked_prefill_tokens=self.args.chunk),
            seed=self.args.seed,
        )

    def storage(self, backend: str, n_tokens: int, **settings: Any):
        from pdcache.offload_manager.builder import (
            fingerprint_for,
            model_identity,
            storage_config_for,
        )

        fp = fingerprint_for(self.model.config, model_identity(self.args.model, self.args.seed),
                             self.page_size)
        capacity = 4 * (n_tokens // self.page_size) + 64 * (self.args.repeats + 4)
        if self.args.page_mac == "on":  # sealed pages, as under a cluster secret
            from pdcache.utils.secret import derive_key

            settings.setdefault("page_mac_key", derive_key(BENCH_SECRET, "page-mac"))
        return storage_config_for(self.model.config, self.page_size, fp, backend=backend,
                                  capacity_pages=capacity, io_threads=self.args.io_threads,
                                  **settings)

    def tiered(self, storage, write_policy: str = "write_through", layerwise: bool = True,
               copy_ahead: bool = False):
        """A started engine with host and storage tiers. Its pools are touched once (as in a
        server that has been up a while), so no run pays first-touch page faults."""
        from pdcache.offload_manager.builder import TierConfig, build_tiered_engine
        from pdcache.offload_manager.hicache import HiCacheConfig

        extra = {}
        if self.args.layers_per_read is not None:
            extra["layerwise_read_layers"] = self.args.layers_per_read
        hicache = HiCacheConfig(write_policy=write_policy, prefetch_policy="wait_complete",
                                io_batch_pages=self.args.io_batch_pages,
                                layerwise_prefetch=layerwise, copy_ahead=copy_ahead, **extra)
        host_pages = 2 * (self.max_tokens // self.page_size) + 256
        built = build_tiered_engine(self.engine_config(), self.model, self.tokenizer,
                                    TierConfig(host_pages, hicache, storage))
        built.hicache.host_pool.host_kv.zero_()
        built.hicache.device_kv.zero_()
        built.engine.start()
        _warm_up(built.engine)
        return built

    def mooncake_settings(self, segment_bytes: int) -> dict[str, Any]:
        return {"mooncake_master": self.master.address, "mooncake_segment_bytes": segment_bytes,
                "mooncake_local_buffer_bytes": 16 * MB}


def _warm_up(engine) -> None:
    """One short unrelated request, so the measured one finds a running, warmed engine."""
    prompt = [random.Random(uuid.uuid4().int).randrange(256) for _ in range(40)]
    _ttft(engine, prompt)


def _ttft(engine, prompt: list[int]) -> Sample:
    from pdcache.engine.api import GenerateRequest, SamplingParams

    req = GenerateRequest(f"bench-{uuid.uuid4().hex[:12]}", prompt,
                          SamplingParams(max_new_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    outputs = engine.generate(req, timeout=3600)
    wall = time.perf_counter() - start
    last = outputs[-1]
    if last.error:
        raise RuntimeError(f"bench request failed: {last.error}")
    tokens = [t for o in outputs for t in o.new_token_ids]
    return Sample(last.ttft_s if last.ttft_s is not None else wall, tokens[0],
                  last.cached.as_dict())


# ---- one prefix length -----------------------------------------------------------------


class PrefixRun:
    """All tiers for one N: a random prefix, and per tier `repeats` random suffixes of its own
    (a suffix served once is cached too, so no two runs share one).

    Exactness: the device tier's first tokens are compared with a no-prefix-cache engine's
    on the same prompts; every other tier's with a device hit of its prompts, run last on the
    seeding engine (so it writes nothing that the storage runs could hit)."""

    def __init__(self, setup: Setup, n_tokens: int, tiers: list[str]) -> None:
        self.setup = setup
        self.n = n_tokens
        self.tiers = tiers
        self.rng = random.Random(setup.args.seed * 1000 + n_tokens)
        self.vocab = min(setup.model.config.vocab_size, 256)
        self.prefix = self._random(n_tokens)
        reps = setup.args.repeats
        # a device hit before every other tier's sample of a round, and one after the last
        others = [t for t in tiers if t not in ("recompute", "device")]
        counts = dict.fromkeys(TIERS, reps) | {"device": reps * max(1, len(others)) + 1}
        self.suffixes = {t: [self._random(setup.args.new_tokens) for _ in range(counts[t])]
                         for t in TIERS}
        self.seed_suffix = self._random(setup.args.new_tokens)
        self.points: dict[str, Point] = {t: Point() for t in TIERS}
        self.reference: dict[str, list[int | None]] = {t: [None] * counts[t] for t in TIERS}
        self.sequence: list[tuple[str, float]] = []  # (tier, TTFT s) of every sample, in order
        self.dir = setup.base / f"n{n_tokens}"
        self.seeding = ""  # how the cold request got the prefix into the tiers, and its time

    def _random(self, length: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(length)]

    def prompt(self, tier: str, i: int) -> list[int]:
        return self.prefix + self.suffixes[tier][i]

    def measure(self) -> None:
        """Tiers interleaved round by round, a device hit before each other tier's sample
        (d, host, d, s1, d, s2, ...; the storage tiers in reverse order every other round) and
        one after the last, so a change of machine load hits them alike and every sample has
        a device hit on either side."""
        hf3fs = self.setup.storage("hf3fs", self.n, path=str(self.dir / "hf3fs"))
        with ExitStack() as stack:
            if self.setup.args.storage_pipeline in ("off", "both"):  # the rows page by page
                hf3fs = hf3fs.replace(pipeline_pages=0)
            # the warm row reads with the seeding engine: as the store does unless --layerwise on
            seeded = self.setup.tiered(hf3fs, layerwise=self.setup.args.layerwise == "on")
            stack.callback(seeded.close)
            self._seed(seeded)
            readers: dict[str, Any] = {}
            file_copy = mooncake = None
            for tier in [t for t in self.tiers if t != WARM]:
                backend = backend_of(tier)
                pipelined = {"pipeline_pages": PIPELINED_PAGES} if tier.endswith(
                    "-pipelined") else {}
                if backend == "hf3fs":
                    readers[tier] = hf3fs.replace(**pipelined)
                elif backend == "file":
                    file_copy = file_copy or self._file_copy(hf3fs)
                    readers[tier] = file_copy
                elif backend == "mooncake" and self.setup.master is not None:
                    mooncake = mooncake or self._mooncake(hf3fs, stack)
                    readers[tier] = mooncake
            device = "device" in self.tiers
            for i in range(self.setup.args.repeats):
                if "host" in self.tiers:
                    self._device_hit(seeded, device)
                    seeded.engine.flush_cache()  # device pages demoted to their host copies
                    self._sample(seeded, "host", i)
                if WARM in self.tiers:
                    self._device_hit(seeded, device)
                    self._warm_storage_hit(seeded, i)
                # odd rounds in reverse: no storage tier always runs first (or right after
                # another fresh engine's close), which measurably shifts its read times
                items = list(readers.items())
                for tier, storage in items if i % 2 == 0 else items[::-1]:
                    self._device_hit(seeded, device)
                    self._fresh_engine(tier, storage, i)
                if not readers and "host" not in self.tiers and WARM not in self.tiers:
                    self._device_hit(seeded, device)
            self._device_hit(seeded, device)  # the last sample's device hit after it
            self._device_references(seeded)
        self._recompute()

    def _warm_storage_hit(self, built, i: int) -> None:
        """A storage hit on the running seeding engine: its device and host tiers dropped
        first (storage untouched), so the prefix can only come from storage."""
        if not built.hicache.wait_idle(600):
            raise RuntimeError("storage I/O did not finish")
        dropped = built.engine.drop_cache()
        if not dropped.flushed:
            raise RuntimeError(f"drop_cache refused: {dropped.reason}")
        self._sample(built, WARM, i)

    def _device_hit(self, built, wanted: bool) -> None:
        """The next device sample (on device: seeded, or restored by the last host hit)."""
        if wanted:
            self._sample(built, "device", len(self.points["device"].samples))

    def _sample(self, built, tier: str, i: int) -> None:
        """One timed request, with no storage I/O of earlier requests still running."""
        if not built.hicache.wait_idle(600):
            raise RuntimeError("storage I/O did not finish")
        before = dict(vars(built.hicache.stats))
        sample = _ttft(built.engine, self.prompt(tier, i))
        after = dict(vars(built.hicache.stats))
        sample.breakdown_ms = {col: (after[key] - before[key]) / 1e3
                               for col, key in BREAKDOWN.items()}
        self.points[tier].samples.append(sample)
        self.sequence.append((tier, sample.ttft_s))

    def _seed(self, built) -> None:
        """The cold request seeds every tier (and is a recompute sample, unless `--keep-dir`
        already holds the prefix: then it loads it from storage)."""
        keys = self._prefix_keys(built.storage.config)
        stored = built.storage.exists_prefix(keys) == len(keys)
        if stored:
            self._forget_suffixes(built.storage)
        start = time.perf_counter()
        sample = _ttft(built.engine, self.prefix + self.seed_suffix)
        if not stored:
            self.points["recompute"].samples.append(sample)
        if not built.hicache.wait_idle(600):
            raise RuntimeError("storage writes did not finish")
        how = "loaded from --keep-dir" if stored else "recomputed and written"
        self.seeding = f"{how} in {time.perf_counter() - start:.1f} s"

    def _device_references(self, built) -> None:
        for tier in [t for t in TIERS if t not in ("recompute", "device")]:
            for i, _ in enumerate(self.points[tier].samples):
                sample = _ttft(built.engine, self.prompt(tier, i))
                if sample.cached.get("device", 0) >= self.n:
                    self.reference[tier][i] = sample.first_token

    def _recompute(self) -> None:
        """`--recompute-repeats` no-cache runs of the device tier's prompts (their first
        tokens are the device tier's reference)."""
        from pdcache.engine.engine import Engine

        setup = self.setup
        count = min(setup.args.recompute_repeats, len(self.points["device"].samples))
        if count == 0:
            return
        with Engine(setup.engine_config(prefix_cache=False), setup.model,
                    setup.tokenizer) as engine:
            _warm_up(engine)
            for i in range(count):
                sample = _ttft(engine, self.prompt("device", i))
                self.reference["device"][i] = sample.first_token
                self.points["recompute"].samples.append(sample)

    def _fresh_engine(self, tier: str, storage: Any, i: int) -> None:
        """A run on a new engine (empty device and host tiers) over the same storage. It only
        reads (write_back never writes before an eviction): the seeding engine's in-process
        hf3fs index stays the only writer of those files."""
        built = self.setup.tiered(storage, write_policy="write_back",
                                  layerwise=not _read_mode(tier).endswith("-serial"),
                                  copy_ahead=tier.endswith("-ahead"))
        try:
            self._sample(built, tier, i)
        finally:
            built.close()
            # the engine's object graph has reference cycles, so its pools (1.1 GB at 32k)
            # would wait for a full collection: dozens of fresh engines exhausted 24 GB
            gc.collect()

    def _mooncake(self, hf3fs, stack: ExitStack):
        """Copy the prefix's pages from hf3fs into the store through a client that stays up
        (its segment holds them); returns the readers' config."""
        from pdcache.offload_manager.storage import create_backend

        pages = self.n // self.setup.page_size
        segment = max(64 * MB, int(1.5 * pages * (hf3fs.page_bytes + 4096)))
        cfg = hf3fs.replace(backend="mooncake", namespace=f"n{self.n}",
                            **self.setup.mooncake_settings(segment))
        holder = create_backend(cfg)
        stack.callback(holder.close)
        _copy_pages(create_backend(hf3fs), holder, self._prefix_keys(hf3fs), hf3fs.page_bytes)
        return cfg.replace(mooncake_segment_bytes=64 * MB)

    def _file_copy(self, hf3fs):
        """A `file` backend directory holding the prefix's pages (copied from hf3fs once)."""
        from pdcache.offload_manager.storage import create_backend

        cfg = hf3fs.replace(backend="file", path=str(self.dir / "file"))
        if not (self.dir / "file").exists():
            writer = create_backend(cfg)
            try:
                _copy_pages(create_backend(hf3fs), writer, self._prefix_keys(hf3fs),
                            hf3fs.page_bytes)
            finally:
                writer.close()
        return cfg

    def _forget_suffixes(self, backend) -> None:
        """`--keep-dir`: drop the stored pages past the prefix that an earlier run's prompts
        wrote (the seeding engine writes through), so every sample finds only the prefix
        stored, as in a first run."""
        from pdcache.engine.page_keys import chain_page_keys, make_salt

        salt = make_salt(backend.config.fingerprint, "")
        prompts = [self.prefix + self.seed_suffix] + [
            self.prompt(tier, i) for tier in TIERS for i in range(len(self.suffixes[tier]))]
        first = self.n // self.setup.page_size
        for prompt in prompts:
            backend.delete(chain_page_keys(prompt, self.setup.page_size, salt)[first:])

    def _prefix_keys(self, storage) -> list[bytes]:
        from pdcache.engine.page_keys import chain_page_keys, make_salt

        salt = make_salt(storage.fingerprint, "")
        return chain_page_keys(self.prefix, self.setup.page_size, salt)

    def rows(self) -> list[dict[str, Any]]:
        device = self.points["device"].ttft_s if self.points["device"].samples else None
        recompute = self.points["recompute"].ttft_s if self.points["recompute"].samples else None
        out = []
        for tier in TIERS:
            point = self.points[tier]
            if point.samples:
                out.append(self._row(tier, point, device, recompute))
        return out

    def _row(self, tier: str, point: Point, device: float | None,
             recompute: float | None) -> dict[str, Any]:
        ttft = point.ttft_s
        if tier == "recompute":
            ratios = []
        elif tier == "device":  # the noise floor: each device hit over their median
            ratios = [s.ttft_s / ttft for s in point.samples]
        else:
            ratios = paired_ratios(self.sequence, tier)
        vs_device = statistics.median(ratios) if ratios else (ttft / device if device else "")
        reused = [sum(v for k, v in s.cached.items() if k != "storage_from_decode")
                  for s in point.samples]
        where = _tier_of(point.samples[-1].cached)
        refs = self.reference[tier]
        checked = [s.first_token == refs[i] for i, s in enumerate(point.samples)
                   if i < len(refs) and refs[i] is not None]
        return {
            "N": self.n, "tier": tier, "ttft_ms": ttft * 1e3,
            "vs_device": vs_device,
            "vs_device_min": min(ratios) if ratios else "",
            "vs_device_max": max(ratios) if ratios else "",
            "vs_recompute": ttft / recompute if recompute else "",
            "reused_tokens": min(reused), "hit_tier": where,
            "exact": ("yes" if all(checked) else "NO") if checked else "",
            "runs": len(point.samples),
            **{col: statistics.median(s.breakdown_ms.get(col, 0.0) for s in point.samples)
               for col in BREAKDOWN},
        }


def paired_ratios(sequence: list[tuple[str, float]], tier: str) -> list[float]:
    """Per sample of `tier` in `sequence` ((tier, TTFT) in run order): its TTFT over the mean
    of the device hits next to it (the last one before it and the first one after it; one of
    them at the ends). Samples with no device hit on either side are left out."""
    device_at = [i for i, (t, _) in enumerate(sequence) if t == "device"]
    ratios = []
    for i, (t, value) in enumerate(sequence):
        if t != tier:
            continue
        before = [sequence[j][1] for j in device_at if j < i][-1:]
        after = [sequence[j][1] for j in device_at if j > i][:1]
        if before or after:
            ratios.append(value / statistics.fmean(before + after))
    return ratios


def _tier_of(cached: dict[str, int]) -> str:
    tiers = [k for k in ("device", "host", "storage") if cached.get(k)]
    return "+".join(tiers) or "none"


def _copy_pages(source, dest, keys: list[bytes], page_bytes: int, batch: int = 64) -> None:
    try:
        buf = torch.zeros(min(batch, len(keys)), page_bytes, dtype=torch.uint8)
        if hasattr(dest, "register_host_memory"):
            dest.register_host_memory(buf)
        for start in range(0, len(keys), batch):
            chunk = keys[start : start + batch]
            pages = list(buf[: len(chunk)])
            if not all(source.get_into(chunk, pages)) or not all(dest.put_from(chunk, pages)):
                raise RuntimeError("copying the prefix into the Mooncake Store failed")
    finally:
        source.close()


# ---- storage bandwidth -----------------------------------------------------------------


def bandwidth_rows(setup: Setup, tiers: list[str]) -> list[dict[str, Any]]:
    """`pdcache bench storage`'s measurement with this model's page size and the largest N."""
    from pdcache.bench import storage_bench as sb

    page_bytes = setup.page_size * setup.model.config.kv_bytes_per_token
    pages = setup.max_tokens // setup.page_size
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, generator=gen)
    dst = torch.zeros_like(src)
    nbytes, repeat = src.numel(), max(3, setup.args.repeats)
    base = setup.base / "bandwidth"
    base.mkdir(parents=True, exist_ok=True)
    plain = sb.PlainFile(base / "plain.bin", src, dst)
    rows = []
    try:
        plain.write()
        plain_s = sb._best(plain.read, repeat)
        memcpy_s = sb._best(lambda: dst.copy_(src), repeat)
        rows.append(sb._row("memcpy (torch copy_)", nbytes, {"read_s": memcpy_s}, plain_s))
        rows.append(sb._row("plain file preadv", nbytes, {"read_s": plain_s}, plain_s))
        backends = {backend_of(t) for t in tiers}
        for name in [t for t in ("hf3fs", "mooncake") if t in backends]:
            with sb._open_backend(name, base, page_bytes, pages, setup.args.io_threads) as be:
                times = sb._run_backend(be, plain, src, dst, repeat)
            rows.append(sb._row(f"storage {name}", nbytes, times, times["plain_read_s"]))
    finally:
        plain.close()
    return rows


# ---- the command -----------------------------------------------------------------------


@contextmanager
def _environment(args: argparse.Namespace, tiers: list[str]) -> Iterator[tuple[Path, Any]]:
    with ExitStack() as stack:
        if args.keep_dir:
            tmp = args.keep_dir
            Path(tmp).mkdir(parents=True, exist_ok=True)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(dir=args.dir,
                                                                  prefix="pdcache-cache-bench-"))
        master = None
        if "mooncake" in {backend_of(t) for t in tiers}:
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
            from pdcache.offload_manager.storage.mooncake_store import LocalMooncakeMaster

            master = stack.enter_context(LocalMooncakeMaster())
        yield Path(tmp), master


def _expand_tiers(tiers: list[str], layerwise: str, copy_ahead: str = "off",
                  pipeline: str = "default") -> list[str]:
    """`--layerwise`: off replaces hf3fs/file by their -serial rows, both adds them;
    `--copy-ahead`: on replaces the page-by-page rows by their -ahead rows, both adds them;
    `--storage-pipeline`: on replaces hf3fs-serial by its -pipelined row, both adds it."""
    serial = _with_variant(tiers, STREAMING, "-serial", keep=layerwise != "off",
                           add=layerwise != "on")
    ahead = _with_variant(serial, COPIED_AHEAD, "-ahead", keep=copy_ahead != "on",
                          add=copy_ahead != "off")
    return _with_variant(ahead, PIPELINED, "-pipelined", keep=pipeline != "on",
                         add=pipeline in ("on", "both"))


def _with_variant(tiers: list[str], names: tuple[str, ...], suffix: str, keep: bool,
                  add: bool) -> list[str]:
    """Each tier of `names` kept or not, and followed by tier+suffix or not."""
    out: list[str] = []
    for tier in tiers:
        if tier in names:
            out += [tier] if keep else []
            out += [f"{tier}{suffix}"] if add else []
        else:
            out.append(tier)
    return list(dict.fromkeys(out))


def _parse_tokens(text: str, page_size: int) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    rounded = [max(page_size, v // page_size * page_size) for v in values]
    return sorted(set(rounded))


def run(args: argparse.Namespace) -> int:
    from pdcache.engine.loader import load_model

    tiers = _expand_tiers([t.strip() for t in args.tiers.split(",") if t.strip()],
                          args.layerwise, args.copy_ahead, args.storage_pipeline)
    if args.copy_ahead == "on" and args.storage_pipeline in ("on", "both"):
        raise SystemExit("--storage-pipeline on/both varies the hf3fs-serial rows, which "
                         "--copy-ahead on replaces; use --copy-ahead off or both")
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        raise SystemExit(f"unknown tiers {unknown}; known: {', '.join(TIERS)}")
    sizes = _parse_tokens(args.tokens, args.page_size)
    model, tokenizer = load_model(args.model, dtype=args.dtype, seed=args.seed)
    rows: list[dict[str, Any]] = []
    seeding: dict[int, str] = {}
    started = time.perf_counter()
    with _environment(args, tiers) as (base, master):
        setup = Setup(model, tokenizer, args, base, max(sizes) + args.new_tokens + 64, master)
        for n in sizes:
            run_n = PrefixRun(setup, n, tiers)
            run_n.measure()
            rows.extend(run_n.rows())
            seeding[n] = run_n.seeding
        bandwidth = [] if args.no_bandwidth else bandwidth_rows(setup, tiers)
    extra = {
        "preset": args.model, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "page_size": args.page_size, "chunk": args.chunk, "threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "layers_per_read": args.layers_per_read or "default",
        "seeding": seeding, "elapsed_s": round(time.perf_counter() - started, 1),
    }
    emit("TTFT by the tier holding N cached tokens (+ new tokens), in-process", rows,
         extra=extra)
    if bandwidth:
        emit("storage read GB/s beside memcpy and a plain file read (same bytes)", bandwidth)
    if args.json_path:
        payload = {"title": "pdcache bench cache", "rows": rows, "bandwidth": bandwidth, **extra}
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {args.json_path}")
    return 0
