"""The metadata service with a cluster secret (docs/security.md): every request must carry
the secret-derived credential. A client with another secret, without one, or replaying a
captured request is refused (a clear MetadataAuthError on the client, counted on the service)
and changes nothing; with the secret off the same intruder is served."""

from __future__ import annotations

import threading
import uuid

import msgpack
import pytest
import torch
import zmq

from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig
from pdcache.offload_manager.storage.metadata import (
    NEW,
    MetadataAuthError,
    RemoteMetadata,
    client_auth,
)
from pdcache.offload_manager.storage.metadata_service import (
    MAX_REQUEST_BYTES,
    LocalMetadataService,
    metadata_key,
)
from pdcache.utils.secret import create_secret

KEY_A = bytes(range(32))


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("secrets")
    return create_secret(root / "a"), create_secret(root / "b")


@pytest.fixture(scope="module")
def secured(secrets, tmp_path_factory: pytest.TempPathFactory):
    service = LocalMetadataService(tmp_path_factory.mktemp("md-auth"), secret_file=secrets[0])
    with service:
        yield service


@pytest.fixture(scope="module")
def open_service(tmp_path_factory: pytest.TempPathFactory):
    with LocalMetadataService(tmp_path_factory.mktemp("md-open")) as service:
        yield service


def _client(address: str, key: bytes | None, ns: str | None = None) -> RemoteMetadata:
    return RemoteMetadata(
        address, ns or f"p{uuid.uuid4().hex[:8]}", 8, 4096, timeout_s=3.0, auth_key=key
    )


def _raw_request(address: str, frame: bytes) -> dict:
    raw = _raw_reply(address, frame)
    try:
        return msgpack.unpackb(raw, raw=False)
    except ValueError:
        return {"sealed": raw}


def _rejected(service: LocalMetadataService, key: bytes) -> dict[str, int]:
    client = _client(service.address, key)
    try:
        return client.health()["rejected"]
    finally:
        client.close()


def test_right_secret_works_and_wrong_or_missing_secret_is_refused(secured, secrets) -> None:
    good_key = metadata_key(secrets[0])
    before = _rejected(secured, good_key).get("unauthenticated", 0)
    client = _client(secured.address, good_key, ns="shared")
    try:
        key = b"k" * 32
        status, slot = client.reserve([key])[0]
        assert status == NEW and client.commit([key], [slot]) == [True]
        assert client.lookup([key]) == [slot]
    finally:
        client.close()
    for wrong in (metadata_key(secrets[1]), None):
        with pytest.raises(MetadataAuthError, match="refused this client"):
            _client(secured.address, wrong, ns="shared")
    assert _rejected(secured, good_key)["unauthenticated"] == before + 2
    intruder = _raw_request(
        secured.address,
        msgpack.packb({"op": "delete", "ns": "shared.slot4096", "keys": [b"k" * 32]}),
    )
    assert intruder["ok"] is False and intruder["error_kind"] == "unauthenticated"
    client = _client(secured.address, good_key, ns="shared")
    try:
        assert client.lookup([b"k" * 32]) == [slot]  # nothing was deleted
    finally:
        client.close()


def test_an_oversized_frame_is_dropped_before_it_is_hashed(secured, secrets) -> None:
    """Anyone who reaches the port could queue frames of any size, each hashed whole
    before its MAC refused it (two of 256 MiB cost the service 800 MB and 3.8 s). A frame
    past MAX_REQUEST_BYTES is dropped by the socket, never answered nor counted; a small
    unauthenticated one still is."""
    good_key = metadata_key(secrets[0])
    before = _rejected(secured, good_key).get("unauthenticated", 0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(secured.address)
        sock.send_multipart([b"", bytes(MAX_REQUEST_BYTES + 1)])
    finally:
        sock.close(linger=2000)
    small = _raw_request(secured.address, b"not a request")
    assert small["ok"] is False and small["error_kind"] == "unauthenticated"
    assert _rejected(secured, good_key)["unauthenticated"] == before + 1


def test_replayed_request_is_refused_and_counted(secured, secrets) -> None:
    good_key = metadata_key(secrets[0])
    before = _rejected(secured, good_key).get("replayed", 0)
    captured = client_auth(good_key).seal(msgpack.packb({"op": "ping"}, use_bin_type=True))
    assert "sealed" in _raw_request(secured.address, captured)  # the genuine one: a sealed reply
    replay = _raw_request(secured.address, captured)
    assert replay["ok"] is False and "replayed" in replay["error"]
    assert _rejected(secured, good_key)["replayed"] == before + 1


def test_keyed_client_refuses_an_unauthenticated_service(open_service) -> None:
    with pytest.raises(MetadataAuthError, match="without a valid credential"):
        _client(open_service.address, KEY_A)


@pytest.mark.parametrize("secret", [True, False], ids=["secret_on", "secret_off"])
def test_an_intruder_is_served_only_without_the_secret(secret, secured, open_service) -> None:
    service = secured if secret else open_service
    reply = _raw_request(service.address, msgpack.packb({"op": "ping"}))
    assert reply["ok"] is not secret


def test_hf3fs_backend_with_the_wrong_secret_fails_at_open(secured, secrets, tmp_path) -> None:
    config = StorageConfig(
        backend="hf3fs",
        path=str(tmp_path),
        page_bytes=4096,
        capacity_pages=8,
        fingerprint="fp",
        metadata=secured.address,
        timeout_s=3.0,
    )
    with pytest.raises(MetadataAuthError, match="another cluster secret"):
        create_backend(config.replace(metadata_key=metadata_key(secrets[1])))
    backend = create_backend(config.replace(metadata_key=metadata_key(secrets[0])))
    try:
        page = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
        assert backend.put_from([b"p" * 32], [page]) == [True]
        out = torch.zeros(4096, dtype=torch.uint8)
        assert backend.get_into([b"p" * 32], [out]) == [True] and torch.equal(out, page)
    finally:
        backend.close()


class _Relay:
    """A man in the middle between a client and the service: "forward" relays each request
    and its genuine reply; "replay" answers every request with `captured`, a genuine sealed
    reply the service made for another request."""

    def __init__(self, service_address: str, mode: str, captured: bytes = b"") -> None:
        self._ctx = zmq.Context.instance()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._service_address = service_address
        self._mode = mode
        self._captured = captured
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-relay", daemon=True)

    def __enter__(self) -> _Relay:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._front.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._front.poll(50):
                continue
            identity, empty, body = self._front.recv_multipart()
            if self._mode == "forward":
                reply = _raw_reply(self._service_address, body)
            else:
                reply = self._captured
            self._front.send_multipart([identity, empty, reply])


def _raw_reply(address: str, frame: bytes) -> bytes:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    try:
        sock.connect(address)
        sock.send(frame)
        return sock.recv()
    finally:
        sock.close(linger=0)


@pytest.mark.parametrize("mode", ["forward", "replay"])
def test_a_reply_answers_only_its_own_request(mode, secured, secrets) -> None:
    """A genuine sealed reply captured for one request (a lookup that found a page) and fed
    to a fresh client's requests is refused: the reply's MAC covers the request's nonce.
    Relayed genuine replies (the "forward" case, the same path) are accepted."""
    good_key = metadata_key(secrets[0])
    ns = f"r{uuid.uuid4().hex[:8]}"
    owner = _client(secured.address, good_key, ns=ns)
    try:
        key = b"r" * 32
        status, slot = owner.reserve([key])[0]
        assert status == NEW and owner.commit([key], [slot]) == [True]
    finally:
        owner.close()
    request = {"op": "ping"}
    captured = _raw_reply(
        secured.address, client_auth(good_key).seal(msgpack.packb(request, use_bin_type=True))
    )
    with _Relay(secured.address, mode, captured) as relay:
        if mode == "replay":
            with pytest.raises(MetadataAuthError, match="another request"):
                _client(relay.address, good_key, ns=ns)
            return
        client = _client(relay.address, good_key, ns=ns)
        try:
            assert client.lookup([key]) == [slot]
        finally:
            client.close()
