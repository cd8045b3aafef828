"""`pdcache secret create PATH`: write a new cluster secret (mode 0600; never overwrites).
`pdcache secret node-token PATH`: print the node HTTP credential derived from it, for an
operator's `curl -H "Authorization: Bearer $(pdcache secret node-token PATH)"` or a Prometheus
scrape of nodes with `metrics_auth` (`authorization: {credentials_file: ...}`).

Copy the file to the same path on every host of the deployment and set
`[security] secret_file = "PATH"` in the topology (docs/design.md §8, docs/usage.md "Security model").
"""

from __future__ import annotations

import argparse
import sys

from pdcache.config.security import SecuritySettings
from pdcache.utils.secret import SecretError, create_secret, load_secret


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="write a new random secret (mode 0600)")
    create.add_argument("path", metavar="PATH", help="file to create; an existing one is kept")
    token = sub.add_parser("node-token", help="print the node HTTP credential of a secret")
    token.add_argument("path", metavar="PATH", help="the cluster secret file")


def run(args: argparse.Namespace) -> int:
    if args.action == "node-token":
        return _node_token(args.path)
    try:
        path = create_secret(args.path)
    except FileExistsError:
        print(f"pdcache secret: {args.path} exists; not overwritten (rotate: create a new file, "
              "point [security] secret_file at it, restart)", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pdcache secret: cannot create {args.path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"pdcache secret: wrote {path} (mode 0600); set [security] secret_file = \"{path}\"")
    return 0


def _node_token(path: str) -> int:
    try:
        secret = load_secret(path)
    except SecretError as exc:
        print(f"pdcache secret: {exc}", file=sys.stderr)
        return 2
    print(SecuritySettings.from_secret(secret).node_http_token)
    return 0
