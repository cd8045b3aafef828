"""The chaos soak's storage and network faults take effect for real, and heal undoes them.

Each storage fault is applied to a storage directory opened through our own backends (file,
hf3fs): a full tmpfs gives ENOSPC (a counted failed write, reads still served), a read-only
remount gives EROFS, flipped bytes are refused pages (counted by reason) that the next write
replaces, the delay file slows every call. The network faults run between two namespaces of a
`NetLab`: netem adds round-trip time, a partition makes connections fail. Skipped, with the
reason the fault itself gives (`unavailable`), where this machine lacks the capability.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from pdcache.chaos.faults import Fault, FaultContext
from pdcache.chaos.os_tools import storage_root
from pdcache.chaos.storage_faults import (
    STORAGE_FAULTS,
    StorageCorrupt,
    StorageFull,
    StorageMount,
    StorageReadonly,
    StorageSlow,
)
from pdcache.config import load_topology
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import StorageConfig

if TYPE_CHECKING:  # imported lazily by the launched tests (they start real stacks)
    from tests.launch.test_supervise import Run
    from tests.pd_harness import UnifiedReference

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "local-1p1d.toml"
PAGE_BYTES = 8192


def make_ctx(tmp_path: Path, backend: str, seed: int = 0) -> FaultContext:
    topology = load_topology(
        CONFIG,
        [
            f'storage.backend="{backend}"',
            'storage.capacity="16MiB"',
            'storage.metadata="inproc"',
            "node.d0.offload=false",
            f'storage.path="{tmp_path / "plain-storage"}"',
        ],
    )
    return FaultContext(
        topology=topology,
        state_dir=tmp_path / "state",
        work_dir=tmp_path / "work",
        rng=random.Random(seed),
        say=lambda line: None,
    )


def prepared(fault: Fault, ctx: FaultContext) -> FaultContext:
    """`fault.prepare`, with its overrides applied the way the harness applies them."""
    reason = fault.unavailable(ctx)
    if reason:
        pytest.skip(f"{fault.kind} unavailable here: {reason}")
    ctx.overrides.update(fault.prepare(ctx))
    return ctx


def open_backend(ctx: FaultContext, backend: str, **over: object) -> StorageBackend:
    values: dict[str, object] = dict(
        backend=backend,
        path=str(storage_root(ctx)),
        page_bytes=PAGE_BYTES,
        capacity_pages=256,
        fingerprint="fp",
        num_data_files=2,
    )
    values.update(over)
    return create_backend(StorageConfig(**values))  # type: ignore[arg-type]


def keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def pages(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PAGE_BYTES), dtype=torch.uint8, generator=gen)


def read_back(backend: StorageBackend, ks: list[bytes]) -> tuple[list[bool], torch.Tensor]:
    out = torch.zeros(len(ks), PAGE_BYTES, dtype=torch.uint8)
    return backend.get_into(ks, list(out)), out


@pytest.fixture()
def cleanups() -> Iterator[list[tuple[Fault, FaultContext]]]:
    """Faults whose `cleanup` must run whatever the test did (unmounts)."""
    todo: list[tuple[Fault, FaultContext]] = []
    yield todo
    for fault, ctx in reversed(todo):
        fault.cleanup(ctx)


def test_registry_names_every_storage_fault() -> None:
    assert set(STORAGE_FAULTS) == {
        "storage-full",
        "storage-readonly",
        "storage-corrupt",
        "storage-slow",
    }
    assert all(cls.kind == kind for kind, cls in STORAGE_FAULTS.items())


# --------------------------------------------------------------------------- storage-full


@pytest.mark.parametrize("backend_name", ["file", "hf3fs"])
def test_storage_full_fails_writes_with_enospc_and_heal_restores(
    tmp_path: Path, backend_name: str, cleanups: list
) -> None:
    fault = StorageFull()
    ctx = prepared(fault, make_ctx(tmp_path, backend_name))
    cleanups.append((fault, ctx))
    root = storage_root(ctx)
    assert root == (ctx.work_dir / "storage").resolve() and os.path.ismount(root)
    backend = open_backend(ctx, backend_name)
    try:
        before = pages(3, seed=1)
        assert backend.put_from(keys(3, 1), list(before)) == [True] * 3
        injection = fault.inject(ctx)
        assert injection.kind == "storage-full" and injection.target == "storage"
        with pytest.raises(OSError) as full:  # the disk is really full
            (root / "probe").write_bytes(b"x" * 65536)
        assert full.value.errno == errno.ENOSPC
        stats0 = backend.stats()
        assert backend.put_from(keys(4, 2), list(pages(4, seed=2))) == [False] * 4
        stats1 = backend.stats()
        assert stats1["write_errors"] - stats0["write_errors"] == 4
        assert stats1["pages_written"] == stats0["pages_written"]
        ok, got = read_back(backend, keys(3, 1))  # what was stored stays readable
        assert ok == [True] * 3 and torch.equal(got, before)
        fault.heal(ctx)
        (root / "probe").write_bytes(b"x" * 65536)  # room again
        again = pages(4, seed=2)
        assert backend.put_from(keys(4, 2), list(again)) == [True] * 4
        ok, got = read_back(backend, keys(4, 2))
        assert ok == [True] * 4 and torch.equal(got, again)
    finally:
        backend.close()
    fault.cleanup(ctx)
    assert not os.path.ismount(root)


# --------------------------------------------------------------------------- storage-readonly


def test_storage_readonly_fails_writes_with_erofs_and_heal_restores(
    tmp_path: Path, cleanups: list
) -> None:
    fault = StorageReadonly()
    ctx = prepared(fault, make_ctx(tmp_path, "file"))
    cleanups.append((fault, ctx))
    root = storage_root(ctx)
    backend = open_backend(ctx, "file")
    try:
        before = pages(2, seed=3)
        assert backend.put_from(keys(2, 3), list(before)) == [True] * 2
        fault.inject(ctx)
        with pytest.raises(OSError) as ro:
            (root / "probe").write_bytes(b"x")
        assert ro.value.errno == errno.EROFS
        assert backend.put_from(keys(2, 4), list(pages(2, seed=4))) == [False, False]
        assert backend.stats()["write_errors"] == 2
        ok, got = read_back(backend, keys(2, 3))
        assert ok == [True, True] and torch.equal(got, before)
        fault.heal(ctx)
        assert backend.put_from(keys(2, 4), list(pages(2, seed=4))) == [True, True]
        assert backend.stats()["pages_written"] == 4
    finally:
        backend.close()


def test_storage_readonly_is_unavailable_for_hf3fs_because_linux_says_ebusy(
    tmp_path: Path, cleanups: list
) -> None:
    """The reason hf3fs is refused is true: with its data files open, the remount fails."""
    ctx = make_ctx(tmp_path, "hf3fs")
    reason = StorageReadonly().unavailable(ctx)
    assert reason is not None and "EBUSY" in reason
    full = StorageFull()  # the same mount, to try the remount under an open hf3fs store
    prepared(full, ctx)
    cleanups.append((full, ctx))
    backend = open_backend(ctx, "hf3fs")
    try:
        mount = StorageMount(ctx.work_dir, 1)
        with pytest.raises(RuntimeError, match="busy"):
            mount.remount("ro")
    finally:
        backend.close()
    StorageMount(ctx.work_dir, 1).remount("ro")  # closed: now it can
    StorageMount(ctx.work_dir, 1).remount("rw")


def test_mount_faults_say_why_without_root(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ctx = make_ctx(tmp_path, "file")
    assert "root" in (StorageFull().unavailable(ctx) or "")
    assert "root" in (StorageReadonly().unavailable(ctx) or "")


def test_file_faults_are_unavailable_on_mooncake_store(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, "file")
    ctx.overrides["storage.backend"] = '"mooncake"'
    for fault in (StorageFull(), StorageReadonly(), StorageCorrupt()):
        assert "Mooncake" in (fault.unavailable(ctx) or ""), fault.kind
    assert StorageSlow().unavailable(ctx) is None


# --------------------------------------------------------------------------- storage-corrupt


@pytest.mark.parametrize("backend_name", ["file", "hf3fs"])
@pytest.mark.parametrize("mac", [False, True], ids=["checksum", "mac"])
def test_storage_corrupt_pages_are_rejected_counted_and_replaced(
    tmp_path: Path, backend_name: str, mac: bool
) -> None:
    fault = StorageCorrupt()
    fault.pages_per_injection = 6
    ctx = prepared(fault, make_ctx(tmp_path, backend_name, seed=7))
    mac_key = bytes(range(32)) if mac else None
    backend = open_backend(ctx, backend_name, page_mac_key=mac_key)
    try:
        ks, data = keys(6, 5), pages(6, seed=5)
        assert backend.put_from(ks, list(data)) == [True] * 6
        injection = fault.inject(ctx)
        assert "header byte of 3 and a payload byte of 3 of 6" in injection.detail
        ok, got = read_back(backend, ks)
        assert ok == [False] * 6  # never served, never wrong bytes
        stats = backend.stats()
        assert stats["rejected_header_pages"] == 3
        assert stats["rejected_checksum_pages"] == 3  # a flipped payload fails the checksum
        assert stats["corrupt_pages"] == 6 and stats["misses"] == 6
        fault.heal(ctx)  # a no-op: the next genuine write replaces them
        assert backend.put_from(ks, list(data)) == [True] * 6
        assert backend.stats()["replaced_rejected_pages"] == 6
        ok, got = read_back(backend, ks)
        assert ok == [True] * 6 and torch.equal(got, data)
    finally:
        backend.close()


@pytest.mark.parametrize("backend_name", ["file", "hf3fs"])
def test_storage_corrupt_hits_state_objects_too(tmp_path: Path, backend_name: str) -> None:
    """Recurrent-state checkpoints (hybrid models) are stored objects of their own (`.state`
    files, the hf3fs state pool): among many pages and few states, half the picks are states,
    which readers then refuse (counted) and the next genuine write replaces."""
    from pdcache.engine.state_geometry import LinearAttentionConfig, RecurrentStateGeometry

    linear = LinearAttentionConfig(conv_kernel=4, key_head_dim=8, value_head_dim=8,
                                   num_key_heads=2, num_value_heads=4)
    geometry = RecurrentStateGeometry((0, 2), linear, "float32")
    fault = StorageCorrupt()
    ctx = prepared(fault, make_ctx(tmp_path, backend_name, seed=11))
    backend = open_backend(ctx, backend_name, state_geometry=geometry.key(),
                           state_bytes=geometry.state_bytes(), state_capacity=8)
    nbytes = geometry.state_bytes()
    try:
        page_keys, state_keys = keys(40, 9), keys(2, 10)
        assert backend.put_from(page_keys, list(pages(40, seed=9))) == [True] * 40
        states = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(i)) for i in range(2)]
        for key, state in zip(state_keys, states):
            assert backend.put_state(key, state, tokens=16)
        detail = fault.inject(ctx).detail
        assert "of 40 stored pages and 2 stored states (2 of them states)" in detail, detail
        out = torch.zeros(nbytes, dtype=torch.uint8)
        assert [backend.get_state_into(key, out) for key in state_keys] == [None, None]
        stats = backend.stats()
        rejected = sum(v for k, v in stats.items() if k.startswith("rejected_")
                       and k.endswith("_states"))
        assert rejected == 2 and stats["state_misses"] == 2, stats
        for key, state in zip(state_keys, states):  # a genuine write replaces them
            assert backend.put_state(key, state, tokens=16)
        assert backend.stats()["replaced_rejected_states"] == 2
        for key, state in zip(state_keys, states):
            assert backend.get_state_into(key, out) is not None and torch.equal(out, state)
    finally:
        backend.close()


def test_storage_corrupt_without_pages_injects_nothing(tmp_path: Path) -> None:
    fault = StorageCorrupt()
    ctx = prepared(fault, make_ctx(tmp_path, "file"))
    assert "of 0 stored pages" in fault.inject(ctx).detail


# --------------------------------------------------------------------------- storage-slow


def timed_read(backend: StorageBackend, ks: list[bytes]) -> float:
    started = time.monotonic()
    ok, _ = read_back(backend, ks)
    assert ok == [True] * len(ks)
    return time.monotonic() - started


@pytest.mark.parametrize("backend_name", ["file", "hf3fs"])
def test_storage_slow_delays_every_call_until_healed(tmp_path: Path, backend_name: str) -> None:
    from pdcache.offload_manager.storage.fault_injection import REREAD_S

    fault = StorageSlow()
    fault.delay_range_s = (0.4, 0.4)
    ctx = prepared(fault, make_ctx(tmp_path, backend_name))
    control = ctx.overrides["storage.fault_injection"].strip('"')
    backend = open_backend(ctx, backend_name, fault_injection=control)
    try:
        ks = keys(2, 6)
        backend.put_from(ks, list(pages(2, seed=6)))
        baseline = timed_read(backend, ks)
        assert baseline < 0.4, baseline
        assert "0.400s" in fault.inject(ctx).detail
        deadline = time.monotonic() + 10 * REREAD_S
        while backend.current_delay_s() == 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(REREAD_S / 4)
        slow = timed_read(backend, ks)
        assert slow >= 0.4, slow
        started = time.monotonic()
        backend.put_from(keys(1, 7), list(pages(1, seed=7)))
        assert time.monotonic() - started >= 0.4
        assert backend.stats()["injected_delays"] >= 2
        fault.heal(ctx)
        deadline = time.monotonic() + 10 * REREAD_S
        while backend.current_delay_s() > 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(REREAD_S / 4)
        assert timed_read(backend, ks) < 0.4
    finally:
        backend.close()
    fault.cleanup(ctx)
    assert not Path(control).exists()


def test_storage_fault_counts_are_exact(tmp_path: Path) -> None:
    """ceil/floor split of header vs payload flips for an odd number of pages."""
    fault = StorageCorrupt()
    fault.pages_per_injection = 5
    ctx = prepared(fault, make_ctx(tmp_path, "file", seed=3))
    backend = open_backend(ctx, "file")
    try:
        ks = keys(5, 8)
        backend.put_from(ks, list(pages(5, seed=8)))
        fault.inject(ctx)
        read_back(backend, ks)
        stats = backend.stats()
        assert stats["rejected_header_pages"] == math.ceil(5 / 2)
        assert stats["rejected_checksum_pages"] == 5 // 2
    finally:
        backend.close()


# --------------------------------------------------------------------------- network faults

# An echo server (prints "ready" once listening) and a client that prints JSON: whether it
# connected, and the median round trip of a few one-line exchanges.
ECHO_SERVER = """
import socket, sys, threading
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
def serve(conn):
    with conn, conn.makefile("rwb") as f:
        for line in f:
            f.write(line); f.flush()
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""
RTT_CLIENT = """
import json, socket, statistics, sys, time
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
        f, rtts = s.makefile("rwb"), []
        for _ in range(5):
            t = time.monotonic(); f.write(b"x\\n"); f.flush(); f.readline()
            rtts.append(time.monotonic() - t)
    print(json.dumps({"ok": True, "rtt_ms": statistics.median(rtts) * 1000}))
except OSError as exc:
    print(json.dumps({"ok": False, "error": repr(exc)}))
"""
ECHO_PORT = 7100  # inside fresh namespaces every port is free


def in_namespace(lab, node: str, *argv: str) -> list[str]:
    return [*lab.launch_prefix(node), sys.executable, *argv]


def rtt_from(lab, node: str, host: str, timeout_s: float = 2.0) -> dict:
    """Connect from `node`'s namespace to an echo server (None node: from this process's)."""
    argv = [sys.executable, "-c", RTT_CLIENT, host, str(ECHO_PORT), str(timeout_s)]
    if node is not None:
        argv = in_namespace(lab, node, *argv[1:])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 20)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture()
def net_lab(tmp_path: Path) -> Iterator[tuple]:
    """A lab (NetPartition.prepare) with an echo server in the prefill and the decode
    namespace; the lab is removed afterwards (cleanup) whatever happened."""
    from pdcache.chaos.net_faults import NetLab, NetPartition

    fault = NetPartition()
    ctx = FaultContext(
        topology=load_topology(CONFIG, ['model.preset="tiny"']),
        state_dir=tmp_path / "state",
        work_dir=tmp_path / "work",
        rng=random.Random(0),
        say=lambda line: None,
    )
    reason = fault.unavailable(ctx)
    if reason:
        pytest.skip(f"net faults unavailable here: {reason}")
    servers: list[subprocess.Popen] = []
    try:
        overrides = fault.prepare(ctx)
        lab = NetLab.for_context(ctx)
        for node in (lab.prefill, lab.decode):
            proc = subprocess.Popen(
                in_namespace(lab, node, "-c", ECHO_SERVER, lab.address(node), str(ECHO_PORT)),
                stdout=subprocess.PIPE,
                text=True,
            )
            servers.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield fault, ctx, lab, overrides
    finally:
        for proc in servers:
            proc.kill()
            proc.wait(10)
        fault.cleanup(ctx)


def test_net_lab_overrides_put_nodes_in_namespaces(net_lab) -> None:
    fault, ctx, lab, overrides = net_lab
    assert lab.prefill == "p0" and lab.decode == "d0"
    assert json.loads(overrides["node.p0.host"]) == lab.address("p0")
    assert json.loads(overrides["node.d0.launch_prefix"]) == [
        "nsenter",
        f"--net=/run/netns/{lab.namespace('d0')}",
        "--",
    ]
    assert json.loads(overrides["storage.metadata"]) == f"tcp://{lab.host_address}:18000"
    secret = Path(json.loads(overrides["security.secret_file"]))
    assert secret.parent == ctx.work_dir.resolve() and secret.stat().st_mode & 0o077 == 0
    topology = load_topology(CONFIG, [f"{k}={v}" for k, v in overrides.items()])
    assert {n.host for n in topology.nodes} == {lab.address("p0"), lab.address("d0")}
    assert fault.prepare(ctx) == overrides  # a second prepare (the other net fault) reuses it


def test_net_partition_cuts_only_the_pair_and_heal_restores(net_lab) -> None:
    fault, ctx, lab, _ = net_lab
    decode, prefill = lab.address(lab.decode), lab.address(lab.prefill)
    assert rtt_from(lab, lab.prefill, decode)["ok"]
    assert rtt_from(lab, lab.decode, prefill)["ok"]
    injection = fault.inject(ctx)
    assert injection.target == "net:p0-d0"
    for node, peer in ((lab.prefill, decode), (lab.decode, prefill)):
        cut = rtt_from(lab, node, peer, timeout_s=1.0)
        assert not cut["ok"] and "timed out" in cut["error"], cut  # silent drops, no refusal
    assert rtt_from(lab, None, prefill)["ok"] and rtt_from(lab, None, decode)["ok"]  # router's path
    fault.heal(ctx)
    deadline = time.monotonic() + 10
    while not rtt_from(lab, lab.prefill, decode)["ok"] and time.monotonic() < deadline:
        pass
    assert rtt_from(lab, lab.prefill, decode)["ok"] and rtt_from(lab, lab.decode, prefill)["ok"]
    fault.cleanup(ctx)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lab.namespace("p0") not in listed and lab.namespace("d0") not in listed
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert lab.main_bridge not in links and lab.pair_bridge not in links


def test_net_delay_adds_round_trip_time_and_heal_removes_it(net_lab) -> None:
    from pdcache.chaos.net_faults import NetDelay

    _, ctx, lab, _ = net_lab
    fault = NetDelay()
    reason = fault.unavailable(ctx)
    if reason:
        pytest.skip(f"net-delay unavailable here: {reason}")
    fault.delay_range_ms = (50.0, 50.0)
    decode = lab.address(lab.decode)
    before = rtt_from(lab, lab.prefill, decode)["rtt_ms"]
    assert "50.0ms" in fault.inject(ctx).detail
    delayed = rtt_from(lab, lab.prefill, decode)["rtt_ms"]
    assert delayed >= before + 2 * 50.0 * 0.9, (before, delayed)
    assert rtt_from(lab, None, decode)["rtt_ms"] < 50.0  # only the pair path is slow
    fault.heal(ctx)
    assert rtt_from(lab, lab.prefill, decode)["rtt_ms"] < 50.0


def test_net_delay_says_why_without_netem(tmp_path: Path) -> None:
    """Where the kernel lacks sch_netem the reason names it (here or on CI)."""
    from pdcache.chaos.net_faults import NetDelay, probe_namespaces

    if probe_namespaces(netem=False):
        pytest.skip(f"no namespaces here: {probe_namespaces(netem=False)}")
    reason = NetDelay().unavailable(make_ctx(tmp_path, "file"))
    if reason is None:
        pytest.skip("this kernel has netem: the delay test runs instead")
    assert "netem" in reason


def pair_rx_bytes(lab, node: str) -> int:
    """Bytes `node`'s namespace received over the pair path (the kernel's counter)."""
    shown = subprocess.run(
        ["ip", "netns", "exec", lab.namespace(node), "ip", "-s", "-j", "link", "show", "pair0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(json.loads(shown.stdout)[0]["stats64"]["rx"]["bytes"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_launched_1p1d_in_the_net_lab_serves_over_the_pair_path_and_survives_a_partition(
    net_lab, tmp_path: Path
) -> None:
    """`pdcache launch` with the lab's overrides: the nodes run in their namespaces (the
    launcher starts them here, behind launch_prefix), KV crosses the pair path, exact tokens;
    a partition makes the request fail (an answer, not a hang), and heal brings it back."""
    pytest.importorskip("mooncake.engine", reason="mooncake wheel not installed")
    import httpx

    from pdcache.engine.loader import load_model
    from tests.launch.test_supervise import Run, free_ports
    from tests.pd_harness import UnifiedReference
    from tests.polling import wait_until

    fault, ctx, lab, overrides = net_lab
    router, meta = free_ports(2)
    sets = [f"{k}={v}" for k, v in overrides.items()]
    sets += [
        f"router.port={router}",
        f'storage.metadata="tcp://{lab.host_address}:{meta}"',
        f'storage.path="{tmp_path}/storage"',
        f'storage.metadata_service.state_dir="{tmp_path}/meta"',
        'storage.capacity="64MiB"',
        "model.preset=tiny",
        "launch.health_timeout_s=240",
        "cache.page_size=4",
        "cache.device_pages=256",
        # the partitioned request fails when prefill's wait for its decode ends: room timeout
        # (4 x this) + bootstrap (this) = 15 s; a healthy 40-token request meets in well under
        # 3 s even on a loaded 2-core machine (the first request below asserts it)
        "transfer.timeout_s=3",
        "router.max_attempts=1",
    ]
    run = Run(tmp_path, CONFIG.read_text(), *[x for s in sets for x in ("--set", s)])
    model, tokenizer = load_model("tiny", seed=0)
    reference = UnifiedReference(model, tokenizer, 4)
    try:
        wait_until(run.all_healthy, 240, "metadata, p0, d0 and router healthy")
        procs = run.procs()
        assert procs["p0"]["argv"][:2] == lab.launch_prefix("p0")[:2]
        assert all(p["role"] != "ssh" for p in procs.values())
        url = f"http://127.0.0.1:{router}/generate"
        prompt = [(7 * i) % 200 + 3 for i in range(40)]
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        rx_before = pair_rx_bytes(lab, lab.decode)
        reply = httpx.post(url, json={"input_ids": prompt, "sampling_params": params}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["output_ids"] == reference(prompt, 8)
        pushed = len(prompt) // 4 * 4 * model.config.kv_bytes_per_token
        assert pair_rx_bytes(lab, lab.decode) - rx_before >= pushed  # KV took the pair path
        fault.inject(ctx)
        started = time.monotonic()
        other = [t + 1 for t in prompt]
        cut = httpx.post(url, json={"input_ids": other, "sampling_params": params}, timeout=120)
        cut_s = time.monotonic() - started
        print(f"partitioned request: {cut.status_code} after {cut_s:.1f}s: {cut.text[:300]}")
        assert cut.status_code >= 500
        fault.heal(ctx)
        healed = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            healed = httpx.post(
                url, json={"input_ids": other, "sampling_params": params}, timeout=120
            )
            if healed.status_code == 200:
                break
        assert healed is not None and healed.status_code == 200, healed.text
        assert healed.json()["output_ids"] == reference(other, 8)
    except Exception:
        _print_logs(run, 30)
        raise
    finally:
        _stop(run, reference)


def _print_logs(run: Run, lines: int) -> None:
    """What a failed launched test shows: the launcher's output and each node's last lines."""
    print(run.output()[-4000:])
    for name in ("p0", "d0"):
        log = run.log_dir / f"{name}.log"
        if log.exists():
            print(f"---- {name} ----\n" + "\n".join(log.read_text().splitlines()[-lines:]))


def _stop(run: Run, reference: UnifiedReference) -> None:
    """Stop the launcher (SIGTERM, then whatever is left) and the reference engine."""
    run.proc.send_signal(signal.SIGTERM)
    try:
        run.proc.wait(timeout=60)
    finally:
        run.kill_all()
        reference.close()


# --------------------------------------------------------------------------- a launched stack


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text)."""
    from tests.hicache_support import parse_metrics

    return sum(
        value
        for (sample, have), value in parse_metrics(text).items()
        if sample == name and set(labels.items()) <= set(have)
    )


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("backend_name", ["file", "hf3fs"])
def test_launched_1p1d_answers_exactly_through_every_storage_fault(
    tmp_path: Path, backend_name: str, cleanups: list
) -> None:
    """The storage faults against running nodes: every answer is exact, the failures are
    counted (write errors, rejected pages), corrupt pages are replaced by genuine ones and
    served again, and no process crashed (the launcher restarted nothing)."""
    pytest.importorskip("mooncake.engine", reason="mooncake wheel not installed")
    import httpx

    from pdcache.engine.loader import load_model
    from pdcache.utils.secret import derive_key, load_secret
    from tests.launch.test_supervise import Run, free_ports
    from tests.pd_harness import UnifiedReference
    from tests.polling import wait_until

    router, p0, boot, d0, meta = free_ports(5)
    sets = [
        f"router.port={router}",
        f"node.p0.port={p0}",
        f"node.p0.bootstrap_port={boot}",
        f"node.d0.port={d0}",
        f'storage.backend="{backend_name}"',
        f'storage.metadata="{f"tcp://127.0.0.1:{meta}" if backend_name == "hf3fs" else "inproc"}"',
        f'storage.metadata_service.state_dir="{tmp_path}/meta"',
        'storage.capacity="32MiB"',
        "model.preset=tiny",
        "launch.health_timeout_s=240",
        "cache.page_size=4",
        "cache.device_pages=256",
    ]
    ctx = FaultContext(
        topology=load_topology(CONFIG, sets),
        state_dir=tmp_path / "logs",
        work_dir=tmp_path / "work",
        rng=random.Random(1),
        say=lambda line: None,
    )
    faults: dict[str, Fault] = {}
    for cls in (StorageFull, StorageReadonly, StorageCorrupt, StorageSlow):
        fault = cls()
        if fault.unavailable(ctx) is None:
            ctx.overrides.update(fault.prepare(ctx))
            cleanups.append((fault, ctx))
            faults[fault.kind] = fault
    if "storage-full" not in faults:
        pytest.skip(f"storage-full unavailable here: {StorageFull().unavailable(ctx)}")
    sets += [f"{k}={v}" for k, v in ctx.overrides.items()]
    run = Run(tmp_path, CONFIG.read_text(), *[x for s in sets for x in ("--set", s)])
    model, tokenizer = load_model("tiny", seed=0)
    reference = UnifiedReference(model, tokenizer, 4)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    def ask(prompt: list[int]) -> dict:
        reply = httpx.post(
            f"http://127.0.0.1:{router}/generate",
            timeout=120,
            json={"input_ids": prompt, "sampling_params": params},
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["output_ids"] == reference(prompt, 8)
        return reply.json()["meta_info"]

    def p0_metrics() -> str:
        return httpx.get(f"http://127.0.0.1:{p0}/metrics", timeout=30).text

    def flush_p0() -> None:
        token = derive_key(load_secret(run.log_dir / "cluster.secret"), "node-http").hex()
        done = httpx.post(
            f"http://127.0.0.1:{p0}/flush_cache?timeout=20",
            timeout=60,
            headers={"Authorization": f"Bearer {token}"},
        )
        assert done.status_code == 200, done.text

    def wait_metric(name: str, above: float, **labels: str) -> float:
        return float(
            wait_until(
                lambda: (v := metric_sum(p0_metrics(), name, **labels)) > above and v,
                30,
                f"{name}{labels} > {above}",
            )
        )

    prompts = [[(k * 31 + 7 * i) % 240 + 3 for i in range(40)] for k in range(6)]
    written = "pdcache_storage_written_bytes_total"
    try:
        wait_until(run.all_healthy, 240, "p0, d0 and router healthy")
        ask(prompts[0])
        stored = wait_metric(written, 0)
        for index, kind in ((1, "storage-full"), (2, "storage-readonly")):
            if kind not in faults:
                continue
            failed = metric_sum(p0_metrics(), "pdcache_storage_errors_total", kind="write")
            faults[kind].inject(ctx)
            ask(prompts[index])  # served by recompute; its backups fail
            wait_metric("pdcache_storage_errors_total", failed, kind="write")
            faults[kind].heal(ctx)
        backed = "pdcache_backup_pages_total"  # written, or found written by decode's offload
        before = metric_sum(p0_metrics(), backed, tier="storage")
        ask(prompts[3])  # healed: pages are stored again
        wait_metric(backed, before, tier="storage")
        injection = faults["storage-corrupt"]
        injection.pages_per_injection = 10_000  # every stored page
        print(injection.inject(ctx))
        flush_p0()
        ask(prompts[0])  # its stored pages are all corrupt now: refused, recomputed
        header = metric_sum(p0_metrics(), "pdcache_storage_rejected_pages_total", reason="header")
        payload = metric_sum(
            p0_metrics(), "pdcache_storage_rejected_pages_total", reason="checksum"
        )
        payload += metric_sum(p0_metrics(), "pdcache_storage_rejected_pages_total", reason="mac")
        assert header > 0 and payload > 0, (header, payload)
        wait_metric("pdcache_storage_replaced_pages_total", 0)  # the next write replaced them
        flush_p0()  # waits for the write-through still in flight (tier I/O) before dropping
        meta_info = ask(prompts[0])
        assert meta_info["cached_tokens_details"]["storage"] > 0, meta_info  # genuine again
        slow = faults["storage-slow"]
        slow.delay_range_s = (0.5, 0.5)
        slow.inject(ctx)
        # The wrapper re-reads its control file at most every REREAD_S, so the first lookup
        # may still see the old delay: a few tries, each from storage again (flush first).
        took = []
        for _ in range(5):
            flush_p0()
            started = time.monotonic()
            ask(prompts[0])
            took.append(time.monotonic() - started)
            if took[-1] >= 0.5:
                break
        assert took[-1] >= 0.5, took
        slow.heal(ctx)
        restarts = {name: p["restarts"] for name, p in run.procs().items()}
        assert restarts == dict.fromkeys(restarts, 0), restarts  # nothing crashed
        print(
            f"stored {stored:.0f} bytes before the faults; rejected header={header:.0f} "
            f"payload={payload:.0f}"
        )
    except Exception:
        print(
            "\n".join(
                line for line in p0_metrics().splitlines() if "storage" in line or "backup" in line
            )
        )
        _print_logs(run, 40)
        raise
    finally:
        _stop(run, reference)


@pytest.mark.parametrize("config", ["local-mooncake-store.toml", "local-2p2d.toml"])
def test_net_lab_overrides_give_a_valid_namespaced_topology(tmp_path: Path, config: str) -> None:
    """Every node gets its own address and namespace, the services move to the machine's
    bridge address, and the result validates (multi-host, with the lab's secret)."""
    from pdcache.chaos.net_faults import NetLab

    path = REPO / "configs" / config
    ctx = FaultContext(
        topology=load_topology(path),
        state_dir=tmp_path / "state",
        work_dir=tmp_path / "work",
        rng=random.Random(0),
        say=lambda line: None,
    )
    lab = NetLab.for_context(ctx)
    overrides = lab.overrides(ctx)
    topology = load_topology(path, [f"{k}={v}" for k, v in overrides.items()])
    names = [n.name for n in topology.nodes]
    assert [n.host for n in topology.nodes] == [f"{lab.subnet}.{i + 1}" for i in range(len(names))]
    assert all(n.launch_prefix == tuple(lab.launch_prefix(n.name)) for n in topology.nodes)
    assert (lab.prefill, lab.decode) == (
        names[0],
        next(n.name for n in topology.nodes if n.role == "decode"),
    )
    assert topology.router is not None and topology.router.host == "127.0.0.1"
    storage = topology.storage
    if storage.backend == "mooncake":
        assert storage.mooncake.master == f"{lab.host_address}:50051"
        assert storage.mooncake.metadata_server == f"http://{lab.host_address}:8080/metadata"
    else:
        assert storage.metadata == f"tcp://{lab.host_address}:18000"
    assert Path(topology.security.secret_file or "").parent == ctx.work_dir.resolve()
    assert max(len(lab.main_port(n)) for n in names) <= 15  # Linux device names
