"""`pdcache secret create PATH`: write a new cluster secret (mode 0600; never overwrites).

Copy the file to the same path on every host of the deployment and set
`[security] secret_file = "PATH"` in the topology (docs/design.md §8, README "Security model").
"""

from __future__ import annotations

import argparse
import sys

from pdcache.utils.secret import create_secret


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="write a new random secret (mode 0600)")
    create.add_argument("path", metavar="PATH", help="file to create; an existing one is kept")


def run(args: argparse.Namespace) -> int:
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
