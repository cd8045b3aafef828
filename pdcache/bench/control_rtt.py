"""Control-plane round trips with and without authentication (part of `pdcache bench transfer`).

Two measurements, same run, same message (a msgpack `Ping`):
- `node`: a DEALER in this process pings a real KVSender's bootstrap ROUTER (its control thread
  parses, answers `Pong`), without a control key and with one (the per-message keyed BLAKE3
  MAC + timestamp + nonce of `pdcache.utils.message_auth`, sealed and opened on both ends);
- `mechanism`: a bare ROUTER echo in a child process (no GIL shared with the client)
  answering the same frames in plain ZMQ, with that HMAC scheme, and with CurveZMQ (keys
  derived from the secret, a ZAP handler admitting only the derived client key): the
  standard ZMQ alternative, at equal footing. `first_reply_us` is connect + first round
  trip (Curve's handshake and ZAP check included).
Each round is one send + one receive, timed individually; rows give the median and p99 µs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import zmq

BENCH_LINK_ID = b"dbench-link-id00"  # 16 bytes, not starting with 0 (ZMQ reserves those)


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "rtt_p50_us": round(statistics.median(ordered) * 1e6, 1),
        "rtt_p99_us": round(p99 * 1e6, 1),
    }


def _rounds(
    sock: zmq.Socket, make: Callable[[int], bytes], check: Callable[[bytes], None], rounds: int
) -> list[float]:
    samples = []
    for i in range(rounds + rounds // 10):  # the first tenth warms up
        frame = make(i)
        start = time.perf_counter()
        sock.send(frame)
        if not sock.poll(5000):
            raise TimeoutError("control round trip: no answer in 5 s")
        reply = sock.recv()
        elapsed = time.perf_counter() - start
        check(reply)
        if i >= rounds // 10:
            samples.append(elapsed)
    return samples


def node_rows(rounds: int, key: bytes) -> list[dict[str, Any]]:
    """Ping → Pong through a real KVSender, unauthenticated and with `key`."""
    import torch

    from pdcache.transfer.config import TransferConfig
    from pdcache.transfer.control import control_auth, parse, seal
    from pdcache.transfer.messages import Ping
    from pdcache.transfer.sender import KVSender

    rows = []
    for label, control_key in (("none", None), ("hmac (blake3 MAC + nonce)", key)):
        sender = KVSender(
            TransferConfig(engine="zmq"),
            torch.zeros(2, 2, 4, 64, dtype=torch.uint8),
            control_key=control_key,
        ).start()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # as a KVReceiver does: a routing id of its own, which prefill's replies are MAC'd for
        sock.setsockopt(zmq.ROUTING_ID, BENCH_LINK_ID)
        sock.connect(sender.bootstrap_addr)
        auth = control_auth(control_key, "decode")
        bound = BENCH_LINK_ID + sender.boot_id  # as a decode seals after RegisterAck
        try:
            samples = _rounds(
                sock,
                lambda i, a=auth, b=bound: seal(Ping(i), a, b),
                lambda reply, a=auth: _check_pong(reply, a, parse),
                rounds,
            )
            assert not sender.stats()["rejected"], sender.stats()["rejected"]
        finally:
            sock.close(linger=0)
            sender.close()
        rows.append({"path": "KVSender ping", "auth": label, **_stats(samples)})
    return rows


def _check_pong(reply: bytes, auth: Any, parse: Callable[..., Any]) -> None:
    from pdcache.transfer.control import RejectCounter
    from pdcache.transfer.messages import Pong

    msg = parse(reply, 1 << 20, RejectCounter("bench"), "prefill", auth, BENCH_LINK_ID)
    assert isinstance(msg, Pong), f"unexpected reply {msg!r}"


class _OnlyKey:
    """ZAP credentials: admit exactly the client public key derived from the secret."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def _curve_secrets(key: bytes) -> tuple[bytes, bytes]:
    """(server, client) Curve secret keys, z85, derived from the secret: X25519 takes any 32
    bytes as a secret key and `zmq.curve_public` gives its public key."""
    from zmq.utils import z85

    from pdcache.utils.secret import derive_key

    return z85.encode(derive_key(key, "curve-server")), z85.encode(derive_key(key, "curve-client"))


STOP = b"stop"


def _echo_main(mode: str, key: bytes, conn: Any) -> None:
    """Child process: a ROUTER answering each Ping with a Pong in `mode` (none | hmac |
    curve) until it receives STOP. Its own process, so no GIL is shared with the client."""
    from pdcache.transfer.messages import Pong, decode, encode
    from pdcache.utils.message_auth import MessageAuth

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    auth = MessageAuth(key, b"prefill", b"decode") if mode == "hmac" else None
    authenticator = None
    if mode == "curve":
        from zmq.auth.thread import ThreadAuthenticator

        server_secret, client_secret = _curve_secrets(key)
        authenticator = ThreadAuthenticator(ctx)
        authenticator.start()
        authenticator.configure_curve_callback(
            "*", credentials_provider=_OnlyKey(zmq.curve_public(client_secret))
        )
        sock.curve_secretkey = server_secret
        sock.curve_publickey = zmq.curve_public(server_secret)
        sock.curve_server = True
    conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    pong = encode(Pong(1))
    try:
        while True:
            identity, frame = sock.recv_multipart()
            if frame == STOP:
                return
            decode(auth.open_(frame) if auth else frame, 1 << 20)
            sock.send_multipart([identity, auth.seal(pong) if auth else pong])
    finally:
        sock.close(linger=0)
        if authenticator is not None:
            authenticator.stop()
        ctx.term()


def mechanism_rows(rounds: int, key: bytes) -> list[dict[str, Any]]:
    """The same Ping/Pong frames against an echo in another process: plain, HMAC, Curve."""
    import multiprocessing as mp

    from pdcache.transfer.messages import Ping, decode, encode
    from pdcache.utils.message_auth import MessageAuth

    ctx = zmq.Context()
    mp_ctx = mp.get_context("spawn")
    client_auth = MessageAuth(key, b"decode", b"prefill")
    labels = {
        "none": "none",
        "hmac": "hmac (blake3 MAC + nonce)",
        "curve": "curve (CurveZMQ + ZAP)",
    }
    rows = []
    try:
        for mode, label in labels.items():
            parent, child = mp_ctx.Pipe()
            proc = mp_ctx.Process(target=_echo_main, args=(mode, key, child), daemon=True)
            proc.start()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                if not parent.poll(60):
                    raise TimeoutError("echo process did not start in 60 s")
                port = parent.recv()
                if mode == "curve":
                    server_secret, client_secret = _curve_secrets(key)
                    sock.curve_secretkey = client_secret
                    sock.curve_publickey = zmq.curve_public(client_secret)
                    sock.curve_serverkey = zmq.curve_public(server_secret)
                hmac = client_auth if mode == "hmac" else None
                start = time.perf_counter()
                sock.connect(f"tcp://127.0.0.1:{port}")
                sock.send(hmac.seal(encode(Ping(0))) if hmac else encode(Ping(0)))
                if not sock.poll(5000):
                    raise TimeoutError(f"{mode} echo: no first reply in 5 s")
                sock.recv()
                first_reply_us = round((time.perf_counter() - start) * 1e6, 1)
                samples = _rounds(
                    sock,
                    lambda i, a=hmac: a.seal(encode(Ping(i))) if a else encode(Ping(i)),
                    lambda r, a=hmac: decode(a.open_(r) if a else r, 1 << 20),
                    rounds,
                )
                sock.send(STOP)
            finally:
                sock.close(linger=0)
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
            rows.append(
                {
                    "path": "echo in another process",
                    "auth": label,
                    **_stats(samples),
                    "first_reply_us": first_reply_us,
                }
            )
    finally:
        ctx.term()
    return rows
