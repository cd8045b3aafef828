"""`[security]` and `[[router.tenant]]` in the topology: parsing, the refusals (multi-host without
a secret, wildcard binds without one, bad tenants), the secret loaded once into the node's
frozen setup with its derived keys, and `pdcache secret create`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pdcache.cli import main as pdcache_main
from pdcache.config import TopologyError, parse_topology, setup_for
from pdcache.config.security import (
    SecuritySettings,
    security_for,
    tenant_api_key,
    tenant_quotas,
)
from pdcache.engine.loader import load_model_config
from pdcache.utils.secret import create_secret, derive_key, load_secret

PD = """
[model]
preset = "tiny"

[router]
host = "{router_host}"

[[node]]
name = "p0"
role = "prefill"
host = "{p_host}"
port = 30001
bootstrap_port = 8998

[[node]]
name = "d0"
role = "decode"
host = "{d_host}"
port = 30002
"""


def pd(p_host: str = "127.0.0.1", d_host: str = "127.0.0.1", router_host: str = "127.0.0.1",
       extra: str = "") -> str:
    return extra + PD.format(p_host=p_host, d_host=d_host, router_host=router_host)


def secret_file(tmp_path: Path) -> Path:
    return create_secret(tmp_path / "cluster.secret")


def test_security_table_parses_and_defaults_off() -> None:
    assert not parse_topology(pd()).security.enabled
    topology = parse_topology(pd(extra='[security]\nsecret_file = "/s"\nmetrics_auth = true\n'))
    assert topology.security.secret_file == "/s" and topology.security.metrics_auth
    with pytest.raises(TopologyError, match=r"security\.secret: unknown key; did you mean 'secret_file'"):
        parse_topology(pd(extra='[security]\nsecret = "/s"\n'))


@pytest.mark.parametrize("with_secret", [False, True], ids=["refused", "with-secret"])
def test_multi_host_topology_needs_a_secret(with_secret: bool) -> None:
    extra = '[security]\nsecret_file = "/etc/pdcache/cluster.secret"\n' if with_secret else ""
    text = pd(p_host="10.0.0.1", d_host="10.0.0.2", router_host="10.0.0.1", extra=extra)
    if with_secret:
        assert parse_topology(text).security.enabled
        return
    with pytest.raises(TopologyError) as err:
        parse_topology(text)
    message = str(err.value)
    assert "security.secret_file: missing: this topology spans 2 hosts (10.0.0.1, 10.0.0.2)" in message
    assert "pdcache secret create PATH" in message and "secret_file" in message


def test_one_machine_is_not_multi_host() -> None:
    # loopback addresses are all this machine: no secret needed
    parse_topology(pd(p_host="127.0.0.1", d_host="127.0.0.2", router_host="localhost"))


@pytest.mark.parametrize("with_secret", [False, True], ids=["refused", "with-secret"])
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_wildcard_bind_needs_a_secret(host: str, with_secret: bool) -> None:
    extra = '[security]\nsecret_file = "/s"\n' if with_secret else ""
    text = pd(p_host=host, extra=extra)
    if with_secret:
        assert parse_topology(text).node("p0").host == host
        return
    with pytest.raises(TopologyError, match=r"node\.p0\.host: binds the wildcard address .* "
                                            r"without a cluster secret: anyone who can reach"):
        parse_topology(text)


@pytest.mark.parametrize("case", ["refused", "with-secret", "no-client-keys", "loopback"])
def test_client_keys_need_a_secret_when_nodes_bind_a_network_address(case: str) -> None:
    """A router that authenticates clients in front of nodes that take anyone on a network
    address: a tenant could call a node directly with another's cache salt. One machine
    (both nodes on its LAN address), so no multi-host rule applies."""
    host = "127.0.0.1" if case == "loopback" else "10.9.8.7"
    text = pd(p_host=host, d_host=host, router_host=host,
              extra='[security]\nsecret_file = "/s"\n' if case == "with-secret" else "")
    if case != "no-client-keys":
        text = text.replace("[router]\n", '[router]\napi_key = "k"\n')
    if case != "refused":
        parse_topology(text)
        return
    with pytest.raises(TopologyError, match=r"node\.p0\.host: binds '10\.9\.8\.7' while the "
                                            r"router authenticates clients"):
        parse_topology(text)


def test_wildcard_bind_is_refused_for_flag_nodes(capsys) -> None:
    assert pdcache_main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "binds the wildcard address '0.0.0.0'" in capsys.readouterr().err


@pytest.mark.parametrize("with_secret", [False, True], ids=["refused", "with-secret"])
def test_wildcard_metadata_service_bind_needs_a_secret(with_secret: bool) -> None:
    storage = ('[storage]\nbackend = "hf3fs"\nmetadata = "tcp://127.0.0.1:18000"\n'
               '[storage.metadata_service]\nbind_host = "0.0.0.0"\n')
    extra = storage + ('[security]\nsecret_file = "/s"\n' if with_secret else "")
    if with_secret:
        parse_topology(pd(extra=extra))
        return
    with pytest.raises(TopologyError, match=r"storage\.metadata_service\.bind_host: binds the "
                                            r"wildcard address '0\.0\.0\.0'"):
        parse_topology(pd(extra=extra))


TENANTS = """
[[router.tenant]]
name = "alice"
api_key = "k-alice"
max_inflight = 4
storage_quota = "1MiB"

[[router.tenant]]
name = "bob"
api_key_env = "PDCACHE_TEST_BOB_KEY"
"""


@pytest.mark.parametrize("backend", ["hf3fs", "mooncake"])
def test_a_storage_quota_on_a_backend_that_cannot_enforce_it_is_refused(backend: str) -> None:
    storage = f'[storage]\nbackend = "{backend}"\npath = "/tmp/s"\n'
    if backend == "hf3fs":  # its metadata service, shared by the two nodes
        storage += 'metadata = "tcp://127.0.0.1:18000"\n'
    with pytest.raises(TopologyError, match=rf"router\.tenant\.alice\.storage_quota: the "
                                            rf"{backend} backend does not enforce tenant "
                                            r"storage quotas"):
        parse_topology(pd(extra=storage) + TENANTS)
    # the same tenants without the quota, or the quota on the file backend, are accepted
    parse_topology(pd(extra=storage) + TENANTS.replace('storage_quota = "1MiB"\n', ""))
    file_storage = '[storage]\nbackend = "file"\npath = "/tmp/s"\n'
    assert tenant_quotas(parse_topology(pd(extra=file_storage) + TENANTS)) == {
        "tenant/alice": 2**20}


def test_router_tenants_parse_and_the_router_reads_api_key_env() -> None:
    topology = parse_topology(pd() + TENANTS)
    router = topology.router
    assert router is not None
    alice, bob = router.tenant
    assert (alice.name, alice.api_key, alice.max_inflight, alice.storage_quota) == (
        "alice", "k-alice", 4, 2**20)
    assert (bob.name, bob.api_key, bob.api_key_env) == ("bob", None, "PDCACHE_TEST_BOB_KEY")
    # nodes parse the same file without the tenants' keys; the router process reads them
    assert tenant_api_key(bob, environ={"PDCACHE_TEST_BOB_KEY": "k-bob"}) == "k-bob"
    assert tenant_api_key(alice, environ={}) == "k-alice"
    with pytest.raises(TopologyError, match=r"router\.tenant\.bob\.api_key_env: environment "
                                            r"variable PDCACHE_TEST_BOB_KEY is not set"):
        tenant_api_key(bob, environ={})
    assert tenant_quotas(topology) == {"tenant/alice": 2**20}  # what every node enforces


@pytest.mark.parametrize(("edit", "error"), [
    (lambda t: t.replace('api_key_env = "PDCACHE_TEST_BOB_KEY"', ""),
     r"router\.tenant\.bob: expected exactly one of api_key or api_key_env"),
    (lambda t: t.replace('"bob"', '"alice"').replace('api_key_env = "PDCACHE_TEST_BOB_KEY"',
                                                     'api_key = "k2"'),
     r"router\.tenant\.alice\.name: duplicate tenant name"),
    (lambda t: t.replace('api_key_env = "PDCACHE_TEST_BOB_KEY"', 'api_key = "k-alice"'),
     r"router\.tenant: two tenants .* share an API key"),
    (lambda t: t.replace('"bob"', '"b/ob"').replace('api_key_env = "PDCACHE_TEST_BOB_KEY"',
                                                    'api_key = "k2"'),
     r"router\.tenant\.b/ob\.name: expected letters"),
])
def test_bad_tenants_are_refused(edit, error: str) -> None:
    with pytest.raises(TopologyError, match=error):
        parse_topology(pd() + edit(TENANTS))


def test_router_tls_needs_both_files() -> None:
    router = "[router]\nhost = \"127.0.0.1\"\n"
    with pytest.raises(TopologyError, match=r"router\.tls_key: give both tls_cert and tls_key"):
        parse_topology(pd().replace(router, router + 'tls_cert = "c.pem"\n'))
    topology = parse_topology(pd().replace(router, router + 'tls_cert = "c.pem"\ntls_key = "k.pem"\n'))
    assert topology.router is not None and topology.router.url.startswith("https://")


def test_setup_loads_the_secret_once_with_derived_keys(tmp_path) -> None:
    path = secret_file(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    topology = parse_topology(pd(extra=f'[security]\nsecret_file = "{path}"\n'))
    setup = setup_for(topology, "p0", load_model_config("tiny"))
    secret = load_secret(path)
    security = setup.security
    assert security.secret == secret
    assert security.node_http_token == derive_key(secret, "node-http").hex()
    assert (security.page_mac_key, security.zmq_control_key, security.metadata_key) == (
        derive_key(secret, "page-mac"), derive_key(secret, "zmq-control"),
        derive_key(secret, "metadata"))
    assert len({security.page_mac_key, security.zmq_control_key, security.metadata_key}) == 3
    assert secret.hex() not in repr(security) and str(secret) not in repr(setup)
    assert setup_for(parse_topology(pd()), "p0", load_model_config("tiny")).security == \
        SecuritySettings()


def test_a_secret_others_can_read_is_refused_naming_the_key(tmp_path) -> None:
    path = secret_file(tmp_path)
    os.chmod(path, 0o644)
    topology = parse_topology(pd(extra=f'[security]\nsecret_file = "{path}"\n'))
    with pytest.raises(TopologyError, match=r"security\.secret_file: cluster secret .* is "
                                            r"accessible by other users \(mode 0644\)"):
        security_for(topology.security, topology.source)


def test_secret_create_cli(tmp_path, capsys) -> None:
    path = tmp_path / "sub" / "s.key"
    assert pdcache_main(["secret", "create", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(load_secret(path)) == 64
    before = path.read_bytes()
    assert pdcache_main(["secret", "create", str(path)]) == 1  # never overwritten
    assert "exists; not overwritten" in capsys.readouterr().err
    assert path.read_bytes() == before
    assert pdcache_main(["secret", "node-token", str(path)]) == 0
    assert capsys.readouterr().out.strip() == derive_key(load_secret(path), "node-http").hex()
    os.chmod(path, 0o644)
    assert pdcache_main(["secret", "node-token", str(path)]) == 2
    assert "chmod 600" in capsys.readouterr().err


def test_setup_hands_the_derived_keys_to_storage(tmp_path) -> None:
    path = secret_file(tmp_path)
    storage = ('[storage]\nbackend = "hf3fs"\nmetadata = "tcp://127.0.0.1:18000"\n'
               f'path = "{tmp_path}/storage"\n')
    topology = parse_topology(pd(extra=storage + f'[security]\nsecret_file = "{path}"\n'))
    secret = load_secret(path)
    for node in ("p0", "d0"):
        setup = setup_for(topology, node, load_model_config("tiny"))
        assert setup.storage is not None
        assert setup.storage.page_mac_key == derive_key(secret, "page-mac")
        assert setup.storage.metadata_key == derive_key(secret, "metadata")
    plain = setup_for(parse_topology(pd(extra=storage)), "p0", load_model_config("tiny"))
    assert plain.storage is not None and plain.storage.page_mac_key is None
