"""`pdcache router`: the OpenAI-compatible front door of a deployment.

From a topology (the node command contract of `pdcache.config.args`):

    pdcache router --config TOPOLOGY --node ROUTER_NAME [--set KEY=VALUE ...]

or ad hoc, naming the nodes (names p0, p1, ... d0, ... u0, ... in the order given):

    pdcache router --prefill http://127.0.0.1:30001@127.0.0.1:8998 --decode http://127.0.0.1:30002
    pdcache router --unified http://127.0.0.1:30000 --unified http://127.0.0.1:30001

Explicit flags override the topology's `[router]` settings. Prints
`pdcache router: ready at http://HOST:PORT` (flushed) once it accepts connections; `--port 0`
picks a free port.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields, replace
from typing import Any, get_args

from pdcache.config import (
    RouterSpec,
    SecuritySpec,
    Topology,
    add_topology_arguments,
    router_from_args,
)
from pdcache.config.schema import (
    ReasoningParser,
    RouterSettings,
    TenantLimits,
    ToolCallParser,
    field_values,
)
from pdcache.config.security import security_for, tenant_api_key
from pdcache.engine.cache_settings import PageGeometry
from pdcache.router.config import RouterConfig
from pdcache.router.nodes import NodeEndpoint
from pdcache.router.policy import DECODE_POLICIES, PREFILL_POLICIES
from pdcache.router.tenants import Tenant, parse_tenant_flag
from pdcache.utils.ports import port_number

log = logging.getLogger(__name__)

READY_PREFIX = "pdcache router: ready at "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_topology_arguments(parser)
    parser.add_argument("--prefill", action="append", default=[], metavar="URL[@BOOTSTRAP]",
                        help="a prefill node (repeatable); BOOTSTRAP is its KV host:port")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode node (repeatable)")
    parser.add_argument("--unified", action="append", default=[], metavar="URL",
                        help="a unified node (repeatable)")
    parser.add_argument("--model", default=None,
                        help="tokenizer: preset (tiny, small, tiny-mla, small-mla) or HF model dir (default tiny)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the preset's weights (part of its model name; default 0)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--tool-call-parser", default=None, choices=list(get_args(ToolCallParser)),
                        help="how model output becomes OpenAI tool_calls, as SGLang's flag "
                             "(default hermes: <tool_call>{json}</tool_call>)")
    parser.add_argument("--reasoning-parser", default=None,
                        choices=list(get_args(ReasoningParser)),
                        help="split a thinking model's <think>...</think> off as OpenAI "
                             "reasoning_content, as SGLang's flag (default: off)")
    parser.add_argument("--page-size", type=int, default=None,
                        help="the nodes' page size, for cache-aware routing (default 16)")
    parser.add_argument("--host", default=None, help="default 127.0.0.1")
    parser.add_argument("--port", type=port_number, default=None, help="default 8000; 0 picks one")
    parser.add_argument("--prefill-policy", choices=PREFILL_POLICIES, default=None)
    parser.add_argument("--decode-policy", choices=DECODE_POLICIES, default=None)
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY "
                        "(one tenant, named 'default')")
    parser.add_argument("--tenant", action="append", default=[], metavar="NAME=KEY",
                        help="a tenant and its API key (repeatable; adds to [[router.tenant]]): "
                             "its key names it, and its caches and sessions are its own")
    parser.add_argument("--secret-file", default=None, metavar="PATH",
                        help="the cluster secret ([security] secret_file): the router sends "
                             "the node credential derived from it")
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help="serve HTTPS with this certificate chain (with --tls-key)")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    # a flag that sets a RouterSettings field stores under the field's name (_flags_given)
    parser.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=None,
                        help="deadline of one request in seconds (default 600)")
    parser.add_argument("--drain", dest="drain_s", type=float, default=None, metavar="S",
                        help="on SIGTERM, how long requests in flight may finish (default 30)")
    parser.add_argument("--connect-timeout", dest="connect_timeout_s", type=float, default=None)
    parser.add_argument("--health-interval", dest="health_interval_s", type=float, default=None)
    parser.add_argument("--max-inflight-per-node", type=int, default=None, metavar="N",
                        help="requests the router has in flight per node; more wait in its "
                             "queue (default 0: no limit)")
    parser.add_argument("--max-queue", type=int, default=None, metavar="N",
                        help="requests that may wait for a free node; more get 503 with "
                             "Retry-After (default 1024; 0: refuse at once)")
    parser.add_argument("--max-attempts", type=int, default=None, metavar="N",
                        help="tries of a request whose node was unreachable or answered 503 "
                             "(default 3)")
    parser.add_argument("--incremental-streaming-output", action="store_const", const=True,
                        default=None, help="/generate streams deltas, not SGLang's default "
                        "cumulative chunks (SGLang's flag)")
    parser.add_argument("--no-first-token-from-prefill", dest="first_token_from_prefill",
                        action="store_const", const=False, default=None,
                        help="PD streams: the client's first token comes from decode once the "
                             "K/V is in ([router] first_token_from_prefill = false), not from "
                             "prefill as soon as it is sampled")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])


def parse_node_flags(args: argparse.Namespace) -> list[NodeEndpoint]:
    """The nodes named by --prefill/--decode/--unified."""
    nodes: list[NodeEndpoint] = []
    for i, item in enumerate(args.prefill):
        url, _, bootstrap = item.partition("@")
        nodes.append(NodeEndpoint(f"p{i}", "prefill", _url(url), bootstrap or None))
    nodes += [NodeEndpoint(f"d{i}", "decode", _url(u)) for i, u in enumerate(args.decode)]
    nodes += [NodeEndpoint(f"u{i}", "unified", _url(u)) for i, u in enumerate(args.unified)]
    return nodes


def _url(text: str) -> str:
    text = text.rstrip("/")
    return text if "://" in text else f"http://{text}"


def topology_nodes(topology: Topology) -> list[NodeEndpoint]:
    endpoints = topology.endpoints()
    return [NodeEndpoint(n.name, n.role, endpoints[n.name].url, n.bootstrap_address)
            for n in topology.nodes]


def build_config(args: argparse.Namespace) -> tuple[RouterConfig, str, int]:
    """(RouterConfig, host, port) from the topology and/or the flags. Raises TopologyError
    or ValueError."""
    loaded = router_from_args(args)
    topology = loaded[0] if loaded else None
    spec = loaded[1] if loaded else RouterSpec()
    nodes = topology_nodes(topology) if topology is not None else []
    nodes += parse_node_flags(args)
    if not nodes:
        raise ValueError("no nodes: give --config/--node or --prefill/--decode/--unified URLs")
    model = topology.model if topology is not None else None
    config = RouterConfig(
        nodes=tuple(nodes),
        model=_pick(args.model, model.ref if model else None, "tiny"),
        model_seed=_pick(args.seed, model.seed if model else None, 0),
        served_model_name=_pick(args.served_model_name, model.served_name if model else None),
        **_settings(args, topology, spec),
        **_security_settings(args, topology, spec),
    )
    return config, _pick(args.host, spec.host), _pick(args.port, spec.port)


def _settings(args: argparse.Namespace, topology: Topology | None,
              spec: RouterSpec) -> dict[str, Any]:
    """RouterConfig's `RouterSettings` (the topology's `[router]`) and page size (its
    `[cache]`), each overridden by its flag when given; without a topology, the flags over
    RouterConfig's defaults."""
    settings = field_values(spec, RouterSettings)
    if topology is not None:
        settings.update(field_values(topology.cache, PageGeometry))
    return {**settings, **_flags_given(args, RouterSettings, PageGeometry)}


def _flags_given(args: argparse.Namespace, *parts: type) -> dict[str, Any]:
    """Field name -> flag value of the fields of `parts` whose flag was given: such a flag
    stores under the field's name, and None when not given."""
    names = [f.name for part in parts for f in fields(part)]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _security_settings(args: argparse.Namespace, topology: Topology | None,
                       spec: RouterSpec) -> dict[str, Any]:
    """RouterConfig's tenants and node credential: flags over the topology."""
    source = topology.source if topology is not None else "<command line>"
    tenants = [Tenant(t.name, tenant_api_key(t, source), **field_values(t, TenantLimits))
               for t in spec.tenant]
    tenants += [Tenant(*parse_tenant_flag(item)) for item in args.tenant]
    security = topology.security if topology is not None else SecuritySpec()
    if args.secret_file is not None:
        security = replace(security, secret_file=args.secret_file)
    return {"tenants": tuple(tenants),
            "node_token": security_for(security, source).node_http_token}


def _pick(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def run(args: argparse.Namespace) -> int:
    from pdcache.router.app import create_app
    from pdcache.wire.serving import listen, serve_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        config, host, port = build_config(args)
        app = create_app(config)
    except (OSError, ValueError) as exc:  # TopologyError included
        print(f"pdcache router: {exc}", file=sys.stderr)
        return 2
    sock = listen(host, port, "router")
    if sock is None:
        return 1
    return serve_app(app, sock, host, args.log_level, "router",
                     tls=(config.tls_cert, config.tls_key) if config.tls_cert else None,
                     drain_s=config.drain_s)
