"""`pdcache bench transfer`: P → D KV transfer GB/s per engine, beside the raw engine and memcpy.

Decode runs in a child process (its pool is truly remote memory). For each engine and page
layout, in the same run:
- `memcpy`: one in-process copy of the same number of bytes (the memory-bandwidth ceiling);
- `raw engine`: the engine alone, batched writes of exactly the page runs a room moves;
- `KVSender→KVReceiver`: the full protocol — decode requests the rooms, prefill sends them,
  timed from prefill's send() until decode's wait() returned for every room.
The target is transfer ≥ 70% of the raw engine. The last room's pages are checked byte for
byte (SHA-256 on both sides) so a fast wrong transfer cannot pass.

Then the control plane's round trip with and without authentication (`pdcache.bench.
control_rtt`: a real KVSender pinged unauthenticated vs with its control key, and the bare
mechanisms plain / per-message HMAC / CurveZMQ side by side), `--control-rounds` each.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from pdcache.bench.table import emit

# Before any engine library loads; inherited by the decode child.
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib*")

GIB = float(1 << 30)
RAW_WINDOW = 4  # batches in flight for the raw engine: as many as the sender's 2 workers × 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", default="zmq,mooncake,nixl",
                        help="comma-separated; engines that cannot load here are reported")
    parser.add_argument("--layouts", default="random,contiguous",
                        help="page placement: random (scattered pages) and/or contiguous")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--presets", default="",
                        help="comma-separated model presets whose KV geometry to move (e.g. "
                             "small,small-mla: GQA against an MLA latent at equal tokens); "
                             "empty: the raw shape of --layers/--kv-heads/--head-dim")
    parser.add_argument("--pages-per-room", type=int, default=256, help="256 × 16 = 4k tokens")
    parser.add_argument("--rooms", type=int, default=2, help="rooms per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="median of this many")
    parser.add_argument("--workers", type=int, default=2, help="sender transfer workers")
    parser.add_argument("--control-rounds", type=int, default=2000,
                        help="control-plane round trips per auth mode (0: skip that table)")


def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    load_before = os.getloadavg()[0]
    shapes = [x.strip() for x in args.presets.split(",") if x.strip()] or [""]
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        missing = _engine_missing(engine)
        if missing:
            skipped[engine] = missing
            continue
        layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
        for preset in shapes:
            print(f"transfer bench: {engine} {preset or 'raw shape'} ({', '.join(layouts)}) ...",
                  flush=True)
            rows.extend(_bench_engine(argparse.Namespace(**{**vars(args), "preset": preset}),
                                      engine, layouts))
    extra: dict[str, Any] = {"tokens_per_room": args.pages_per_room * args.page_tokens,
                             "room_bytes": {p or "raw": _geometry(args, p).page_bytes(
                                 args.page_tokens) * args.pages_per_room for p in shapes}}
    # Shared machines swing a lot: the load shows how much to trust absolute GiB/s (the
    # ratios are measured back to back, so they hold up better).
    extra["load_avg_1m"] = f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    if skipped:
        extra["skipped"] = skipped
    emit("P->D KV transfer (decode in another process)", rows, args.json_path, extra=extra)
    if args.control_rounds > 0:
        _control_table(args)
    return 0


def _control_table(args: argparse.Namespace) -> None:
    from pdcache.bench.control_rtt import mechanism_rows, node_rows

    key = os.urandom(32)
    rows = node_rows(args.control_rounds, key) + mechanism_rows(args.control_rounds, key)
    base = {r["path"]: r["rtt_p50_us"] for r in rows if r["auth"] == "none"}
    for row in rows:
        row["p50_vs_none"] = round(row["rtt_p50_us"] / base[row["path"]], 3)
    json_path = args.json_path and args.json_path.replace(".json", "") + ".control.json"
    emit("control-plane round trip (Ping -> Pong), authenticated vs not", rows, json_path,
         columns=["path", "auth", "rtt_p50_us", "rtt_p99_us", "p50_vs_none", "first_reply_us"],
         extra={"rounds": args.control_rounds, "load_avg_1m": round(os.getloadavg()[0], 2)})


# ---- one engine × layout -------------------------------------------------------------------
def _bench_engine(args: argparse.Namespace, engine: str,
                  layouts: list[str]) -> list[dict[str, Any]]:
    """One decode child and one sender per engine; every layout measured with them."""
    from pdcache.transfer.engines.base import create_engine
    from pdcache.transfer.sender import KVSender

    config = _config(args, engine)
    src = _pool(args, args.pages_per_room * args.rooms, seed=1)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(vars(args), engine, child_conn), daemon=True)
    proc.start()
    sender = KVSender(config, src).start()
    raw = create_engine(config)
    rows: list[dict[str, Any]] = []
    try:
        session, dst_fields = _ask(conn, ("info",))
        raw.register_source(src.data_ptr(), src.numel() * src.element_size())
        peer = raw.add_peer(session)
        for index, layout in enumerate(layouts):
            rows.extend(_bench_layout(args, layout, index, sender, raw, peer, src, dst_fields,
                                      conn))
        _ask(conn, ("stop",))
    finally:
        raw.close()
        sender.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    for row in rows:
        row["engine"] = engine
        row["kv"] = getattr(args, "preset", "") or "raw"
        row["room_MiB"] = round(_geometry(args).page_bytes(args.page_tokens)
                                * args.pages_per_room / 2**20, 2)
    return rows


def _bench_layout(args, layout: str, index: int, sender, raw, peer, src: torch.Tensor,
                  dst_fields: tuple, conn) -> list[dict[str, Any]]:
    """Repeats interleave memcpy, raw engine and protocol, so load swings hit all three."""
    mem, raw_gbs, proto, ratios, verified = [], [], [], [], True
    for seed in range(args.repeats):
        plan = _plan(args, layout, seed, first_room=(index * args.repeats + seed) * 1000 + 1)
        mem.append(_memcpy_once(src))
        raw_gbs.append(_raw_once(raw, peer, src, dst_fields, sender.config, plan))
        gbs, ok = _protocol_once(sender, src, conn, plan)
        proto.append(gbs)
        ratios.append(gbs / raw_gbs[-1])
        verified &= ok
    med = statistics.median
    return _rows(layout, med(mem), med(raw_gbs), med(proto), med(ratios), verified)


def _rows(layout: str, mem: float, raw: float, proto: float, paired: float,
          verified: bool) -> list[dict[str, Any]]:
    """GiB/s are medians over repeats; `vs_raw` divides those medians; `paired_vs_raw` is the
    median of per-repeat ratios (each protocol run next to its raw run: robust to load)."""
    def row(path: str, gbs: float, paired_ratio: float | str, check: str) -> dict[str, Any]:
        return {"engine": "", "layout": layout, "path": path, "GiB/s": round(gbs, 3),
                "vs_raw": round(gbs / raw, 3) if raw else 0.0,
                "paired_vs_raw": paired_ratio, "verified": check}

    return [row("memcpy", mem, "-", "-"), row("raw engine", raw, "-", "-"),
            row("KVSender->KVReceiver", proto, round(paired, 3), "yes" if verified else "NO")]


def _raw_once(raw, peer, src: torch.Tensor, dst_fields: tuple, config,
              plan: list[tuple[int, np.ndarray, np.ndarray]]) -> float:
    """The engine alone: the same page runs, the same batch split, RAW_WINDOW in flight."""
    from pdcache.transfer.layout import KVLayout, page_copy_batch

    src_layout, dst_layout = KVLayout.from_tensor(src), KVLayout(*dst_fields)
    parts = [part for _, src_pages, dst_pages in plan
             for part in page_copy_batch(src_layout, dst_layout, src_pages, dst_pages)
             .split(config.max_batch_entries, config.max_batch_bytes)]
    start = time.monotonic()
    pending: list[Any] = []
    for part in parts:
        pending.append(raw.submit(peer, part))
        if len(pending) >= RAW_WINDOW:
            raw.wait(pending.pop(0), 120.0)
    for ticket in pending:
        raw.wait(ticket, 120.0)
    elapsed = time.monotonic() - start
    return sum(p.nbytes for p in parts) / elapsed / GIB


def _protocol_once(sender, src: torch.Tensor, conn, rooms) -> tuple[float, bool]:
    from pdcache.transfer.messages import PrefillReport

    conn.send(("rooms", sender.bootstrap_addr,
               [(room, dst_pages.tolist()) for room, _, dst_pages in rooms]))
    _expect(conn, "requested")
    deadline = time.monotonic() + 60
    while any(sender.rooms.get(room) is None for room, _, _ in rooms):
        if time.monotonic() > deadline:
            raise RuntimeError("decode's room requests did not arrive")
        time.sleep(0.001)
    start = time.monotonic()
    for room, src_pages, _ in rooms:
        sender.send(room, src_pages, PrefillReport(first_token=1))
    _, done_at, nbytes, digest = _recv(conn)
    last_src = rooms[-1][1]
    ok = digest == _digest(src, last_src)
    return nbytes / (done_at - start) / GIB, ok


def _memcpy_once(src: torch.Tensor) -> float:
    flat = src.view(-1).numpy()
    dst = np.empty_like(flat)
    np.copyto(dst, flat)  # fault the pages in first
    start = time.monotonic()
    np.copyto(dst, flat)
    return flat.nbytes / (time.monotonic() - start) / GIB


# ---- decode child ------------------------------------------------------------------------
def _decode_main(arg_values: dict, engine: str, conn) -> None:
    from pdcache.transfer.receiver import KVReceiver

    args = argparse.Namespace(**arg_values)
    dst = _pool(args, args.pages_per_room * args.rooms, seed=None)
    receiver = KVReceiver(_config(args, engine), dst).start()
    try:
        _serve(receiver, dst, conn)
    except Exception as exc:  # report instead of leaving the parent waiting
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        receiver.close()


def _serve(receiver, dst: torch.Tensor, conn) -> None:
    while True:
        cmd = conn.recv()
        if cmd[0] == "info":
            lay = receiver.layout
            conn.send((receiver.engine.session(),
                       (lay.base_addr, lay.num_layers, lay.num_pages, lay.page_bytes,
                        lay.num_slabs)))
        elif cmd[0] == "rooms":
            _serve_rooms(receiver, dst, conn, cmd[1], cmd[2])
        else:
            conn.send("bye")
            return


def _serve_rooms(receiver, dst: torch.Tensor, conn, addr: str, rooms: list) -> None:
    for room, dst_pages in rooms:
        receiver.request(room, addr, dst_pages, num_tokens=len(dst_pages))
    conn.send("requested")
    nbytes = sum(receiver.wait(room, 120.0).nbytes for room, _ in rooms)
    done_at = time.monotonic()
    conn.send(("done", done_at, nbytes, _digest(dst, rooms[-1][1])))


# ---- helpers -------------------------------------------------------------------------------
def _config(args: argparse.Namespace, engine: str):
    """The benchmark's TransferConfig; as a node's entry point does, it sets (once, before the
    engine's library loads) what that library reads only from the environment."""
    from pdcache.transfer.config import TransferConfig
    from pdcache.transfer.engines.base import ENGINES

    config = TransferConfig(engine=engine, transfer_workers=args.workers, room_timeout_s=300.0,
                            heartbeat_interval_s=1.0, heartbeat_misses=10)
    os.environ.update(ENGINES.get(engine).environment(config, os.environ))
    return config


def _geometry(args: argparse.Namespace, preset: str | None = None) -> Any:
    """The KV geometry moved (a `KVGeometry`): a preset's (float32), or the raw shape."""
    from pdcache.engine.kv_geometry import KVGeometry
    from pdcache.engine.presets import preset_config

    name = getattr(args, "preset", "") if preset is None else preset
    if name:
        return preset_config(name).kv_geometry
    return KVGeometry.mha(args.layers, args.kv_heads, args.head_dim, "float32")


def _pool(args: argparse.Namespace, pages: int, seed: int | None) -> torch.Tensor:
    shape = _geometry(args).device_shape(pages, args.page_tokens)
    if seed is None:
        return torch.zeros(shape)
    return torch.empty(shape).uniform_(generator=torch.Generator().manual_seed(seed))


def _plan(args: argparse.Namespace, layout: str, seed: int, first_room: int):
    """Per room: (room id, source pages, destination pages), disjoint across rooms."""
    total = args.pages_per_room * args.rooms
    rng = np.random.default_rng(seed)
    if layout == "contiguous":
        src_all, dst_all = np.arange(total), np.roll(np.arange(total), args.pages_per_room)
    elif layout == "random":
        src_all, dst_all = rng.permutation(total), rng.permutation(total)
    else:
        raise SystemExit(f"unknown layout {layout!r}: use random or contiguous")
    n = args.pages_per_room
    return [(first_room + i, src_all[i * n:(i + 1) * n], dst_all[i * n:(i + 1) * n])
            for i in range(args.rooms)]


def _digest(pool: torch.Tensor, pages) -> str:
    return hashlib.sha256(pool[:, :, list(pages)].contiguous().numpy().tobytes()).hexdigest()


def _engine_missing(engine: str) -> str:
    from pdcache.transfer.engines.base import ENGINES
    from pdcache.utils.registry import MissingDependencyError

    try:
        ENGINES.get(engine)
        if engine == "mooncake":
            __import__("mooncake.engine")
        if engine == "nixl":
            __import__("nixl_cu12._api")
    except (MissingDependencyError, KeyError, ImportError, OSError) as exc:
        return str(exc)
    return ""


def _recv(conn, timeout_s: float = 300.0):
    if not conn.poll(timeout_s):
        raise RuntimeError("decode process did not answer")
    got = conn.recv()
    if isinstance(got, tuple) and got and got[0] == "error":
        raise RuntimeError(f"decode process failed: {got[1]}")
    return got


def _expect(conn, what: str) -> None:
    got = _recv(conn)
    if got != what:
        raise RuntimeError(f"decode process said {got!r}, expected {what!r}")


def _ask(conn, cmd: tuple):
    conn.send(cmd)
    return _recv(conn)


def room_push_seconds(engine: str, preset: str, page_tokens: int, room_pages: list[int],
                      repeats: int = 3) -> list[tuple[int, float]]:
    """(bytes, seconds) of single-room pushes through KVSender -> KVReceiver (the decode side
    in a child process, as in `run`), `repeats` per room size in `room_pages`: what `pdcache
    sim calibrate` fits the P->D bandwidth and per-room cost from."""
    from pdcache.transfer.sender import KVSender

    args = argparse.Namespace(preset=preset, page_tokens=page_tokens, layers=8, kv_heads=8,
                              head_dim=64, pages_per_room=max(room_pages), rooms=1, workers=2)
    config = _config(args, engine)
    src = _pool(args, args.pages_per_room, seed=1)
    page_bytes = _geometry(args).page_bytes(page_tokens)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(vars(args), engine, child_conn), daemon=True)
    proc.start()
    sender = KVSender(config, src).start()
    out: list[tuple[int, float]] = []
    try:
        _ask(conn, ("info",))
        pages = np.arange(args.pages_per_room)
        room = 1
        for n in room_pages:
            for _ in range(repeats):
                gbs, _ok = _protocol_once(sender, src, conn, [(room, pages[:n], pages[:n])])
                out.append((n * page_bytes, n * page_bytes / (gbs * GIB)))
                room += 1
        _ask(conn, ("stop",))
    finally:
        sender.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return out
