"""The `pdcache` command. Each subcommand lives in its own module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdcache.server.cli", "run a unified (prefill + decode) server"),
    "prefill": ("pdcache.prefill_node.cli", "run a prefill node"),
    "decode": ("pdcache.decode_node.cli", "run a decode node"),
    "router": ("pdcache.router.cli", "run the OpenAI-compatible router"),
    "launch": ("pdcache.launch.cli", "start a topology from a TOML config"),
    "metadata-server": ("pdcache.offload_manager.storage.metadata_cli", "run the global KV manager"),
    "storage": ("pdcache.config.storage_cli", "inspect or clear a storage backend"),
    "secret": ("pdcache.config.secret_cli", "create the cluster secret file"),
    "config-reference": ("pdcache.config.reference",
                         "print every topology key: type, default, meaning"),
    "bench": ("pdcache.bench.cli", "benchmarks: engine, kernels, cache, transfer, replay, compare"),
    "chaos": ("pdcache.chaos.command",
              "soak under random faults; every answer checked against a no-cache oracle"),
    "export-model": ("pdcache.engine.export", "write a preset as a Hugging Face checkpoint"),
    "demo": ("pdcache.bench.demo", "launch the default topology and replay a multi-turn trace"),
    "sim": ("pdcache.sim.command", "simulate a topology on a trace (discrete-event, modelled costs)"),
}

# Old spellings kept working: argv prefix -> the command it now is.
ALIASES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("bench", "chaos"): ("chaos",),
}


def resolve_alias(argv: list[str]) -> list[str]:
    """`argv` with an old command spelling (ALIASES) replaced by the command it names now."""
    for old, new in ALIASES.items():
        if tuple(argv[: len(old)]) == old:
            return [*new, *argv[len(old):]]
    return argv


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only the chosen subcommand's module is imported, so `pdcache --help` stays light and a
    # missing optional dependency of one command never breaks the others.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if name == chosen:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.startswith(module):
                    parser.exit(2, f"pdcache: '{name}' is not available in this build\n")
                raise
            mod.add_arguments(sp)
            sp.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = resolve_alias(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    # Benchmarks parse their own options once the kind is known, so unknown options are kept.
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "_accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args._rest = rest
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
