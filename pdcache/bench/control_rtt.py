"""Control-plane round trips with and without authentication (part of `pdcache bench transfer`).

Two measurements, same run, same message (a msgpack `Ping`):
- `node`: a DEALER in this process pings a real KVSender's bootstrap ROUTER (its control thread
  parses, answers `Pong`), without a control key and with one (the per-message keyed BLAKE3
  MAC + timestamp + nonce of `pdcache.utils.message_auth`, sealed and opened on both ends);
- `mechanism`: a bare ROUTER echo thread answering the same frames in plain ZMQ, with that
  HMAC scheme, and with CurveZMQ (keys derived from the secret, a ZAP handler admitting only
  the derived client key): the alternative the issue names, at equal footing. Curve's
  per-connection handshake is reported separately.
Each round is one send + one receive, timed individually; rows give the median and p99 µs.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq


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

    from pdcache.transfer import KVSender
    from pdcache.transfer.config import TransferConfig
    from pdcache.transfer.control import control_auth, parse, seal
    from pdcache.transfer.messages import Ping

    rows = []
    for label, control_key in (("none", None), ("hmac (blake3 MAC + nonce)", key)):
        sender = KVSender(
            TransferConfig(engine="zmq"),
            torch.zeros(2, 2, 4, 64, dtype=torch.uint8),
            control_key=control_key,
        ).start()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(sender.bootstrap_addr)
        auth = control_auth(control_key, "decode")
        try:
            samples = _rounds(
                sock,
                lambda i, a=auth: seal(Ping(i), a),
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

    msg = parse(reply, 1 << 20, RejectCounter("bench"), "prefill", auth)
    assert isinstance(msg, Pong), f"unexpected reply {msg!r}"


class _Echo:
    """A ROUTER answering each frame with `answer(frame)`, on its own thread (owned here:
    started in __init__, stopped in close())."""

    def __init__(
        self, ctx: zmq.Context, answer: Callable[[bytes], bytes], curve_secret: bytes | None = None
    ) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_secret is not None:
            self.sock.curve_secretkey = curve_secret
            self.sock.curve_publickey = zmq.curve_public(curve_secret)
            self.sock.curve_server = True
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{port}"
        self._answer = answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdcache-bench-echo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                identity, frame = self.sock.recv_multipart()
                self.sock.send_multipart([identity, self._answer(frame)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)


class _OnlyKey:
    """ZAP credentials: admit exactly the client public key derived from the secret."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def mechanism_rows(rounds: int, key: bytes) -> list[dict[str, Any]]:
    """The same Ping/Pong frames over a bare echo: plain, HMAC-sealed, CurveZMQ."""
    from zmq.auth.thread import ThreadAuthenticator
    from zmq.utils import z85

    from pdcache.transfer.messages import Ping, Pong, decode, encode
    from pdcache.utils.message_auth import MessageAuth

    ctx = zmq.Context()
    rows = []
    server_auth = MessageAuth(key, b"prefill", b"decode")
    client_auth = MessageAuth(key, b"decode", b"prefill")
    pong = encode(Pong(1))
    cases: dict[
        str, tuple[Callable[[bytes], bytes], Callable[[int], bytes], Callable[[bytes], Any]]
    ] = {
        "none": (
            lambda f: pong if decode(f, 1 << 20) else b"",
            lambda i: encode(Ping(i)),
            lambda r: decode(r, 1 << 20),
        ),
        "hmac (blake3 MAC + nonce)": (
            lambda f: server_auth.seal(pong) if decode(server_auth.open_(f), 1 << 20) else b"",
            lambda i: client_auth.seal(encode(Ping(i))),
            lambda r: decode(client_auth.open_(r), 1 << 20),
        ),
    }
    try:
        for label, (answer, make, check) in cases.items():
            echo = _Echo(ctx, answer)
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(echo.addr)
            try:
                samples = _rounds(sock, make, check, rounds)
            finally:
                sock.close(linger=0)
                echo.close()
            rows.append({"path": "bare echo", "auth": label, **_stats(samples)})
        rows.append(_curve_row(ctx, rounds, key, ThreadAuthenticator, z85))
    finally:
        ctx.term()
    return rows


def _curve_row(
    ctx: zmq.Context, rounds: int, key: bytes, authenticator: Any, z85: Any
) -> dict[str, Any]:
    from pdcache.transfer.messages import Ping, Pong, decode, encode
    from pdcache.utils.secret import derive_key

    server_secret = z85.encode(derive_key(key, "curve-server"))
    client_secret = z85.encode(derive_key(key, "curve-client"))
    auth = authenticator(ctx)
    auth.start()
    auth.configure_curve_callback(
        "*", credentials_provider=_OnlyKey(zmq.curve_public(client_secret))
    )
    pong = encode(Pong(1))
    echo = _Echo(ctx, lambda f: pong if decode(f, 1 << 20) else b"", curve_secret=server_secret)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_secretkey = client_secret
    sock.curve_publickey = zmq.curve_public(client_secret)
    sock.curve_serverkey = zmq.curve_public(server_secret)
    try:
        start = time.perf_counter()
        sock.connect(echo.addr)
        sock.send(encode(Ping(0)))
        if not sock.poll(5000):
            raise TimeoutError("curve handshake: no answer in 5 s")
        sock.recv()
        handshake_us = round((time.perf_counter() - start) * 1e6, 1)
        samples = _rounds(sock, lambda i: encode(Ping(i)), lambda r: decode(r, 1 << 20), rounds)
        assert isinstance(decode(pong, 1 << 20), Pong)
    finally:
        sock.close(linger=0)
        echo.close()
        auth.stop()
    return {
        "path": "bare echo",
        "auth": "curve (CurveZMQ + ZAP)",
        **_stats(samples),
        "first_reply_us": handshake_us,
    }
