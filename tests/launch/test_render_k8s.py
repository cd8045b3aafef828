"""`pdcache launch --render k8s`: every shipped topology renders in both layouts, validates
offline (Kubernetes' schemas strictly, RBG's CRD schema strictly, probes and secrets), mutants
fail, output is deterministic, and every setting a process needs reaches its container."""

from __future__ import annotations

import copy
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdcache.cli import main as pdcache_main
from pdcache.config import TopologyError, load_topology
from pdcache.launch.render_k8s import (
    CONFIG_DIR,
    DATA_DIR,
    NODE_CLOSE_S,
    ROUTER_CLOSE_S,
    SECRET_DIR,
    SECRET_OVERRIDE,
    render_k8s,
    to_yaml,
    write_manifests,
)
from tests.launch.k8s_support import ManifestError, validate_all, validate_builtin, validate_rbg

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
VOLUMES = ['kubernetes.storage_volume="pvc:pdcache-kv"', 'kubernetes.model_volume="pvc:model"']


def _render(config: Path, mode: str, *overrides: str) -> list[dict[str, Any]]:
    return render_k8s(load_topology(config, [*VOLUMES, *overrides]), mode)


def _kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _pods(docs: list[dict[str, Any]]) -> dict[str, tuple[int, dict[str, Any]]]:
    """role -> (replicas, pod spec), from either layout."""
    out = {}
    for rbg in _kind(docs, "RoleBasedGroup"):
        for role in rbg["spec"]["roles"]:
            out[role["name"]] = (role["replicas"], role["standalonePattern"]["template"]["spec"])
    for sts in _kind(docs, "StatefulSet"):
        role = sts["metadata"]["labels"]["app.kubernetes.io/component"]
        out[role] = (sts["spec"]["replicas"], sts["spec"]["template"]["spec"])
    return out


@pytest.mark.parametrize("mode", ["rbg", "plain"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_topology_renders_and_validates(config: Path, mode: str) -> None:
    docs = _render(config, mode)
    validate_all(docs)
    topology = load_topology(config, VOLUMES)
    replicas = {role: n for role, (n, _) in _pods(docs).items()}
    for role in ("prefill", "decode", "unified"):
        assert replicas.get(role, 0) == len(topology.nodes_with_role(role))  # the P:D ratio


def test_output_is_deterministic(tmp_path: Path) -> None:
    config = ROOT / "configs" / "local-2p2d.toml"
    first, second = to_yaml(_render(config, "rbg")), to_yaml(_render(config, "rbg"))
    assert first == second and "&id" not in first  # no YAML aliases either
    paths = write_manifests(_render(config, "plain"), tmp_path / "a")
    again = write_manifests(_render(config, "plain"), tmp_path / "b")
    assert [p.name for p in paths] == [p.name for p in again]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(paths, again))
    assert paths[0].name == "00-configmap-pdcache-topology.yaml"


# ---- mutants ----------------------------------------------------------------------------------

def _rbg(config: str = "local-1p1d.toml") -> dict[str, Any]:
    return _kind(_render(ROOT / "configs" / config, "rbg"), "RoleBasedGroup")[0]


def test_rbg_mutants_fail_the_crd_schema() -> None:
    good = _rbg()
    validate_rbg(good)
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["roles"][1]["replicas"] = "two"
    with pytest.raises(ManifestError, match="replicas"):
        validate_rbg(wrong_type)
    unknown = copy.deepcopy(good)
    unknown["spec"]["roles"][1]["replica"] = 2  # a typo the API server would drop silently
    with pytest.raises(ManifestError, match="replica"):
        validate_rbg(unknown)
    bad_pod = copy.deepcopy(good)
    bad_pod["spec"]["roles"][1]["standalonePattern"]["template"]["spec"]["containerz"] = []
    with pytest.raises(ManifestError, match="containerz"):
        validate_rbg(bad_pod)


def test_builtin_mutants_fail_kubernetes_schemas() -> None:
    sts = _kind(_render(ROOT / "configs" / "local-1p1d.toml", "plain"), "StatefulSet")[0]
    validate_builtin(sts)
    unknown = copy.deepcopy(sts)
    unknown["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(ManifestError, match="imagePullPolicyy"):
        validate_builtin(unknown)
    wrong_type = copy.deepcopy(sts)
    wrong_type["spec"]["replicas"] = "one"
    with pytest.raises(ManifestError):
        validate_builtin(wrong_type)


def test_a_missing_probe_or_a_writable_secret_fails_the_policy() -> None:
    docs = _render(ROOT / "configs" / "local-1p1d.toml", "plain")
    validate_all(docs)
    no_probe = copy.deepcopy(docs)
    del _kind(no_probe, "StatefulSet")[1]["spec"]["template"]["spec"]["containers"][0][
        "livenessProbe"]
    with pytest.raises(ManifestError, match="no livenessProbe"):
        validate_all(no_probe)
    writable = copy.deepcopy(docs)
    pod = _kind(writable, "StatefulSet")[1]["spec"]["template"]["spec"]
    for mount in pod["containers"][0]["volumeMounts"]:
        mount.pop("readOnly", None)
    with pytest.raises(ManifestError, match="writable"):
        validate_all(writable)


# ---- round trip -------------------------------------------------------------------------------

def _command(container: dict[str, Any]) -> list[str]:
    argv = container["command"]
    return argv[argv.index("pdcache-node") + 1:] if argv[:2] == ["sh", "-c"] else argv


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]


def _env(container: dict[str, Any], name: str) -> str:
    return next(e["value"] for e in container["env"] if e["name"] == name)


@pytest.mark.parametrize("mode", ["rbg", "plain"])
def test_every_node_gets_its_settings_through_command_config_and_mounts(mode: str,
                                                                         tmp_path: Path) -> None:
    """Parse the manifests back: the ConfigMap's topology with each container's --set flags
    is the original topology but for where things live in the cluster; each pod i of a role
    runs that role's i-th node; every path a process opens is under one of its mounts."""
    config = ROOT / "configs" / "local-2p2d.toml"
    original = load_topology(config, VOLUMES)
    docs = _render(config, mode)
    config_map = _kind(docs, "ConfigMap")[0]
    mounted_config = tmp_path / "topology.toml"
    mounted_config.write_text(config_map["data"]["topology.toml"])
    for role, (replicas, pod) in _pods(docs).items():
        container = pod["containers"][0]
        argv = _command(container)
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        if "--config" not in argv:  # a service (the metadata service): its flags
            for flag in ("--state-dir", "--secret-file"):
                path = argv[argv.index(flag) + 1]
                assert any(path.startswith(m) for m in mounts), (role, flag, path)
            assert argv[argv.index("--host") + 1] == "0.0.0.0"
            continue
        assert argv[argv.index("--config") + 1] == f"{CONFIG_DIR}/topology.toml"
        seen = load_topology(mounted_config, _sets(argv))
        assert seen.security.secret_file.startswith(SECRET_DIR)
        assert any(seen.security.secret_file.startswith(m) for m in mounts)
        if role not in ("prefill", "decode", "unified"):
            continue
        names = _env(container, "PDCACHE_NODES").split()
        assert len(names) == replicas
        assert names == [n.name for n in original.nodes_with_role(role)]
        assert seen.storage.path.startswith(DATA_DIR) and DATA_DIR in mounts
        for index, name in enumerate(names):
            node, before = seen.node(name), original.node(name)
            assert node.host == f"pdcache-{role}-{index}.s-pdcache-{role}"
            assert node.bind_host == "0.0.0.0"
            placement = ("host", "port", "bootstrap_port", "bind_host")
            assert {f: getattr(node, f) for f in vars(node) if f not in placement} == {
                f: getattr(before, f) for f in vars(before) if f not in placement}
            assert node.port in [p["containerPort"] for p in container["ports"]]
        for key in ("cache", "scheduler", "transfer", "model"):
            if key != "model":
                assert getattr(seen, key) == getattr(original, key)
        assert seen.storage.metadata.startswith("tcp://pdcache-metadata-0.s-pdcache-metadata:")


def test_tenant_keys_come_from_the_secret_and_inline_keys_are_refused(tmp_path: Path) -> None:
    base = (ROOT / "configs" / "local-1p1d.toml").read_text()
    config = tmp_path / "tenants.toml"
    config.write_text(base + '\n[[router.tenant]]\nname = "team-a"\napi_key_env = "TEAM_A_KEY"\n')
    docs = render_k8s(load_topology(config, VOLUMES), "rbg")
    router = next(r for r in _kind(docs, "RoleBasedGroup")[0]["spec"]["roles"]
                  if r["name"] == "router")
    env = router["standalonePattern"]["template"]["spec"]["containers"][0]["env"]
    ref = next(e for e in env if e["name"] == "TEAM_A_KEY")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "pdcache-cluster-secret", "key": "tenant-team-a"}
    config.write_text(base + '\n[[router.tenant]]\nname = "team-a"\napi_key = "sk-1"\n')
    with pytest.raises(TopologyError, match="readable in the ConfigMap"):
        render_k8s(load_topology(config, VOLUMES), "rbg")


def test_what_cannot_be_laid_out_is_refused_by_key() -> None:
    config = ROOT / "configs" / "local-1p1d.toml"
    with pytest.raises(TopologyError, match="kubernetes.storage_volume"):
        render_k8s(load_topology(config), "rbg")
    with pytest.raises(TopologyError, match="kubernetes.model_volume"):
        render_k8s(load_topology(config, [VOLUMES[0], 'model.path="/ckpt"']), "rbg")
    # a TLS router's certificate was never mounted and its probes stayed plain HTTP
    with pytest.raises(TopologyError, match="router.tls_cert"):
        render_k8s(load_topology(config, [*VOLUMES, 'router.tls_cert="/c.pem"',
                                          'router.tls_key="/k.pem"']), "rbg")


@pytest.mark.parametrize(("override", "key"), [
    ('kubernetes.name="PD_Cache"', "kubernetes.name"),
    (f'kubernetes.name="{"a" * 40}"', "kubernetes.name"),  # s-NAME-mooncake-master > 63
    ('kubernetes.namespace="Team A"', "kubernetes.namespace"),
    ('kubernetes.secret_name="Cluster_Secret"', "kubernetes.secret_name"),
    ('kubernetes.storage_volume="pvc:KV Claim"', "kubernetes.storage_volume"),
    ('kubernetes.memory="8 GB"', "kubernetes.memory"),
    ('kubernetes.cpu="two"', "kubernetes.cpu"),
    ('kubernetes.gpu_resource="nvidia com/gpu"', "kubernetes.gpu_resource"),
    ("kubernetes.gpus=-1", "kubernetes.gpus"),
    ("kubernetes.startup_probe_s=0", "kubernetes.startup_probe_s"),
])
def test_values_the_api_server_refuses_are_refused_by_key(
        override: str, key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline schema check passes every one of these (shown with the name check off):
    the cluster refused the objects one by one."""
    config = ROOT / "configs" / "local-mooncake-ha.toml"
    topology = load_topology(config, [*VOLUMES, override])
    with pytest.raises(TopologyError, match=key.replace(".", r"\.")):
        render_k8s(topology, "plain")
    monkeypatch.setattr("pdcache.launch.render_k8s.check_kubernetes_names",
                        lambda *args: None)
    validate_all(render_k8s(topology, "plain"))


def test_gpus_and_rdma_as_the_topology_says() -> None:
    docs = _render(ROOT / "configs" / "local-1p1d.toml", "rbg", "kubernetes.gpus=8",
                   'kubernetes.rdma="host-network"')
    validate_all(docs)
    pods = _pods(docs)
    prefill = pods["prefill"][1]
    assert prefill["hostNetwork"] is True
    assert prefill["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert {"name": "infiniband", "hostPath": {"path": "/dev/infiniband"}} in prefill["volumes"]
    assert "hostNetwork" not in pods["router"][1]
    plugin = _pods(_render(ROOT / "configs" / "local-1p1d.toml", "plain",
                           'kubernetes.rdma="device-plugin"'))["decode"][1]
    assert plugin["containers"][0]["resources"]["limits"] == {"rdma/hca": 1}


def test_cli_writes_the_manifests(tmp_path: Path) -> None:
    out = tmp_path / "manifests"
    proc = subprocess.run(
        [sys.executable, "-m", "pdcache", "launch", str(ROOT / "configs" / "local-1p1d.toml"),
         "--render", "k8s", "--k8s-mode", "plain", "--out", str(out), "--set", VOLUMES[0]],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    files = sorted(out.iterdir())
    assert [f.name for f in files] == proc.stdout.split() or len(files) == len(
        proc.stdout.split())
    kinds = [yaml.safe_load(f.read_text())["kind"] for f in files]
    assert kinds[0] == "ConfigMap" and "StatefulSet" in kinds
    refused = subprocess.run(
        [sys.executable, "-m", "pdcache", "launch", str(ROOT / "configs" / "local-1p1d.toml"),
         "--render", "k8s"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "kubernetes.storage_volume" in refused.stderr


@pytest.mark.parametrize("mode", ["rbg", "plain"])
def test_replicated_metadata_renders_its_etcd_members_and_replicas(mode: str) -> None:
    """configs/local-ha.toml: an etcd role of 3 members that find each other by pod name, a
    metadata role of 2 replicas each advertising its own pod name, on those members; every
    node's topology names both replicas and the members."""
    docs = _render(ROOT / "configs" / "local-ha.toml", mode)
    validate_all(docs)
    pods = _pods(docs)
    (etcd_n, etcd_pod), (meta_n, meta_pod) = pods["etcd"], pods["metadata"]
    assert (etcd_n, meta_n) == (3, 2)
    etcd = _command(etcd_pod["containers"][0])
    members = [f"pdcache-etcd-{i}.s-pdcache-etcd:2379" for i in range(3)]
    cluster = etcd[etcd.index("--initial-cluster") + 1].split(",")
    assert cluster == [f"pdcache-etcd-{i}=http://{m.replace(':2379', ':2380')}"
                       for i, m in enumerate(members)]
    assert etcd[etcd.index("--name") + 1] == "$(POD_NAME)"  # = the member name above
    assert etcd_pod["containers"][0]["image"].startswith("quay.io/coreos/etcd:")
    meta = _command(meta_pod["containers"][0])
    assert meta[meta.index("--etcd-endpoints") + 1].split(",") == members
    assert meta[meta.index("--advertise") + 1] == "tcp://$(POD_NAME).s-pdcache-metadata:18000"
    for pod in (etcd_pod, meta_pod):  # $(POD_NAME): the pod's own name, expanded by Kubernetes
        assert any(e["name"] == "POD_NAME" and e["valueFrom"]["fieldRef"]["fieldPath"]
                   == "metadata.name" for e in pod["containers"][0]["env"])
    prefill = _command(pods["prefill"][1]["containers"][0])
    seen = load_topology(ROOT / "configs" / "local-ha.toml", [*VOLUMES, *_sets(prefill)])
    assert seen.storage.metadata.split(",") == [
        f"tcp://pdcache-metadata-{i}.s-pdcache-metadata:18000" for i in range(2)]
    assert list(seen.storage.etcd.endpoints) == members


# ---- what an operator meets on a cluster ------------------------------------------------------

def test_a_checkpoint_reaches_the_router_too(tmp_path: Path) -> None:
    """The router loads the checkpoint's tokenizer and config from `model.path`: the model
    volume is mounted on its pod as on the nodes' (without it the rendered router exited 2
    and no checkpoint could be served)."""
    docs = _render(ROOT / "configs" / "local-1p1d.toml", "plain", 'model.path="/models/x"')
    pods = _pods(docs)
    for role in ("router", "prefill", "decode"):
        container = pods[role][1]["containers"][0]
        seen = load_topology(ROOT / "configs" / "local-1p1d.toml", _sets(_command(container)))
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        assert any(seen.model.path.startswith(m) for m in mounts), (role, seen.model.path)
    assert not any(v["name"] == "model" for v in pods["metadata"][1]["volumes"])


def test_the_router_is_restarted_only_when_it_does_not_answer() -> None:
    """A router's /health is 503 while no node can serve (nodes loading, a role down):
    readiness only; startup and liveness ask /liveness, or a router waiting for nodes that
    load for minutes was killed at 60 s into a crash loop. Nodes keep /health throughout."""
    pods = _pods(_render(ROOT / "configs" / "local-1p1d.toml", "rbg"))
    router = pods["router"][1]["containers"][0]
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert router["startupProbe"]["httpGet"]["path"] == "/liveness"
    assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"
    node = pods["prefill"][1]["containers"][0]
    assert {node[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe",
                                                 "readinessProbe")} == {"/health"}


def test_an_external_metadata_service_keeps_its_address() -> None:
    """`storage.metadata_service.start = false`: nothing renders it, so the nodes keep the
    topology's address (they were pointed at pods that do not exist: every write failed
    while /health said ok)."""
    address = "tcp://meta.example.internal:9400"
    external = ("storage.metadata_service.start=false", f'storage.metadata="{address}"',
                SECRET_OVERRIDE)  # two hosts now: a secret
    docs = _render(ROOT / "configs" / "local-1p1d.toml", "plain", *external)
    pods = _pods(docs)
    assert "metadata" not in pods
    seen = load_topology(ROOT / "configs" / "local-1p1d.toml",
                         [*external, *_sets(_command(pods["prefill"][1]["containers"][0]))])
    assert seen.storage.metadata == address


def test_a_changed_topology_rolls_the_pods(tmp_path: Path) -> None:
    """Every pod template carries the ConfigMap file's sha256: a change a process reads only
    at start (a router policy) changes every template, so `kubectl apply` rolls them."""
    config = tmp_path / "t.toml"
    base = (ROOT / "configs" / "local-1p1d.toml").read_text()
    digests = []
    for text in (base, base.replace('prefill_policy = "cache_aware"', 'prefill_policy = "round_robin"')):
        config.write_text(text)
        docs = render_k8s(load_topology(config, VOLUMES), "plain")
        templates = {s["metadata"]["name"]: s["spec"]["template"]["metadata"]
                     for s in _kind(docs, "StatefulSet")}
        notes = [t["annotations"] for n, t in templates.items() if not n.endswith("metadata")]
        assert len(notes) == 3  # prefill, decode, router: they read the file
        assert {n["checksum/topology"] for n in notes} == {hashlib.sha256(text.encode()).hexdigest()}
        assert "annotations" not in templates["pdcache-metadata"]  # flags only: no roll
        digests.append(notes[0]["checksum/topology"])
    assert base != config.read_text() and digests[0] != digests[1]


def test_a_multi_host_render_needs_no_secret_file_here(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The pods read the Secret mounted at SECRET_DIR whatever `secret_file` says: a render
    does not ask for one on the rendering machine (a launch of the same file still does)."""
    config = tmp_path / "multi.toml"
    text = (ROOT / "configs" / "multinode-example.toml").read_text()
    config.write_text("\n".join(line for line in text.splitlines()
                                if not line.startswith("secret_file")))
    args = ["launch", str(config), "--set", VOLUMES[0], "--set", VOLUMES[1]]
    assert pdcache_main([*args, "--dry-run"]) == 2
    assert "security.secret_file" in capsys.readouterr().err
    assert pdcache_main([*args, "--render", "k8s"]) == 0
    rendered = list(yaml.safe_load_all(capsys.readouterr().out))
    validate_all(rendered)


def test_a_pod_s_grace_period_covers_its_drain() -> None:
    """A node's and the router's grace period is their `drain_s` (requests in flight finish
    after SIGTERM) plus their close; Kubernetes' default 30 s cut a 30 s drain and a decode
    node's offload flush."""
    pods = _pods(_render(ROOT / "configs" / "local-1p1d.toml", "plain",
                         "node.d0.drain_s=100", "router.drain_s=7"))
    assert pods["decode"][1]["terminationGracePeriodSeconds"] == 100 + NODE_CLOSE_S
    assert pods["prefill"][1]["terminationGracePeriodSeconds"] == 30 + NODE_CLOSE_S
    assert pods["router"][1]["terminationGracePeriodSeconds"] == 7 + ROUTER_CLOSE_S
    assert "terminationGracePeriodSeconds" not in pods["metadata"][1]


def test_node_sizing_is_the_nodes_and_touches_no_etcd_member(tmp_path: Path) -> None:
    """`[kubernetes] cpu / memory` size the node pods (their host KV pools); the router,
    metadata and etcd pods have their own (`service_cpu / service_memory`), and an etcd
    member's template changes with neither a node's sizing nor the topology (a replaced
    member comes back on an empty volume and cannot rejoin)."""
    config = ROOT / "configs" / "local-ha.toml"

    def etcd_and_nodes(*sets: str) -> tuple[Any, dict[str, Any]]:
        pods = _pods(_render(config, "plain", *sets))
        return pods["etcd"][1], {role: pods[role][1]["containers"][0]["resources"]["requests"]
                                 for role in pods}

    etcd, requests = etcd_and_nodes('kubernetes.memory="200Gi"', 'kubernetes.service_memory="3Gi"')
    assert requests["prefill"]["memory"] == requests["decode"]["memory"] == "200Gi"
    assert {requests[r]["memory"] for r in ("etcd", "metadata", "router")} == {"3Gi"}
    assert etcd == etcd_and_nodes('kubernetes.memory="64Gi"', 'kubernetes.service_memory="3Gi"',
                                  'router.prefill_policy="round_robin"')[0]
    with pytest.raises(TopologyError, match="kubernetes.service_cpu"):
        _render(config, "plain", 'kubernetes.service_cpu="lots"')
