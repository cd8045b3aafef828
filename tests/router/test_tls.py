"""The router serves HTTPS with `--tls-cert/--tls-key` (uvicorn's TLS): a client that verifies
the (self-signed, made here with the `openssl` CLI) certificate is served, the ready line says
https, and plain HTTP to the same port gets no answer. A real `pdcache router` process in front
of a real unified node."""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from pdcache.launch.launcher import HealthCheck, check_health
from tests.router_support import GREEDY, ServeProcess, UnifiedNode, prompt

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    return cert, key


def test_router_serves_https(nodes: list[UnifiedNode], tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    router = ServeProcess(["router", "--unified", nodes[0].url, "--port", "0", "--tls-cert",
                           str(cert), "--tls-key", str(key), "--page-size", "16"],
                          "pdcache router: ready at ", timeout_s=120)
    try:
        assert router.url.startswith("https://127.0.0.1:")
        trusting = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=trusting, timeout=60, trust_env=False) as client:
            body = {"input_ids": prompt(20, 1500),
                    "sampling_params": {"max_new_tokens": 3, **GREEDY}}
            r = client.post(f"{router.url}/generate", json=body)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
        host, port = router.url.removeprefix("https://").split(":")
        # the launcher's health check of a TLS router (liveness: the certificate is ours)
        assert check_health(HealthCheck("http", host, int(port), tls=True), 10.0)
        assert not check_health(HealthCheck("http", host, int(port)), 10.0)
        with httpx.Client(timeout=10, trust_env=False) as client:  # not trusting it: refused
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                client.get(f"{router.url}/health")
            plain = router.url.replace("https://", "http://")
            with pytest.raises(httpx.HTTPError):  # TLS port: a plain request gets no answer
                client.get(f"{plain}/health")
    finally:
        assert router.terminate() in (0, -signal.SIGTERM)
