"""`pdcache config-reference`: the topology's configuration reference, generated from the schema.

Every key of every table (`pdcache.config.schema`, and the engine's `SchedulerConfig` that is
its `[scheduler]`): its TOML path, type, default and what the
schema's comments say of it (the comment on its line, or the comment lines right above it).
docs/configuration.md is this command's output; a test fails when the committed file is
stale, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from collections.abc import Iterator
from typing import Any

from pdcache.config import schema
from pdcache.engine.scheduler_config import SchedulerConfig

# (TOML path, schema class), in the order a topology file reads.
TABLES: tuple[tuple[str, type], ...] = (
    ("model", schema.ModelSpec),
    ("cache", schema.CacheSpec),
    ("scheduler", SchedulerConfig),
    ("storage", schema.StorageSpec),
    ("storage.metadata_service", schema.MetadataServiceSpec),
    ("storage.etcd", schema.EtcdSpec),
    ("storage.mooncake", schema.MooncakeStoreSpec),
    ("transfer", schema.TransferSpec),
    ("router", schema.RouterSpec),
    ("router.tenant", schema.TenantSpec),
    ("security", schema.SecuritySpec),
    ("launch", schema.LaunchSpec),
    ("kubernetes", schema.KubernetesSpec),
    ("node", schema.NodeSpec),
)
# fields that are sub-tables (documented as their own table) rather than keys
_SUBTABLES = {"metadata_service", "mooncake", "tenant", "cache", "scheduler"}
_FIELD_LINE = re.compile(r"^\s{4}(\w+): [^=]+?(?:=.*?)?(?:\s+#\s?(?P<comment>.*))?$")
_COMMENT_LINE = re.compile(r"^\s{4}#\s?(?P<comment>.*)$")

HEADER = """# Configuration reference

Generated from `pdcache/config/schema.py` by `pdcache config-reference` (do not edit: a test
fails when this file is stale). A topology is one TOML file; `--set KEY=VALUE` overrides any
key (`node.p0.port=31001`, `cache.page_size=32`). `[cache]` and `[scheduler]` keys can also
be set per node (`[node.cache]`, `[node.scheduler]`). Sizes take bytes or strings such as
`"4GiB"`. What each table is for: docs/design.md §4.6.
"""


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in the source of the class that declares it (same line,
    else the lines above): `cls` or a dataclass it inherits (`ApiSettings`, ...)."""
    comments: dict[str, str] = {}
    for owner in reversed(cls.__mro__):
        if dataclasses.is_dataclass(owner):
            comments.update(_own_field_comments(owner))
    return comments


def _own_field_comments(cls: type) -> dict[str, str]:
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        comment = _COMMENT_LINE.match(line)
        if comment:
            above.append(comment["comment"].strip())
            continue
        field = _FIELD_LINE.match(line)
        if field:
            text = (field["comment"] or "").strip() or " ".join(above)
            comments[field.group(1)] = text
        above = []
    return comments


def _type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    return (text.replace("typing.", "").replace("collections.abc.", "")
            .replace("pdcache.config.schema.", "").replace("NoneType", "None"))


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(table)"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return "`[" + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in value) + "]`"
    return f"`{value}`" if value != {} else "`{}`"


def reading_order(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` as a topology reads: the positional ones in declaration order
    (`CacheSpec`'s inherited `page_size` first), then the keyword-only ones, its own before
    those of each class it inherits (`NodeSpec`'s name, role, port before `ApiSettings`')."""
    depth: dict[str, int] = {}
    for level, owner in enumerate(cls.__mro__):
        for name in getattr(owner, "__annotations__", {}):
            depth.setdefault(name, level)
    return sorted(dataclasses.fields(cls),
                  key=lambda f: (f.kw_only, depth[f.name] if f.kw_only else 0))


def table_rows(path: str, cls: type) -> Iterator[str]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for field in reading_order(cls):
        if field.name in _SUBTABLES and dataclasses.is_dataclass(hints[field.name]):
            continue
        if path in ("node", "router") and field.name in _SUBTABLES:
            continue
        key = f"{path}.{field.name}" if path != "node" else f"node.NAME.{field.name}"
        doc = comments.get(field.name, "").replace("|", "\\|")
        kind = _type_name(hints[field.name]).replace("|", "\\|")
        yield f"| `{key}` | `{kind}` | {_default(field)} | {doc} |"


def render_reference() -> str:
    out = [HEADER]
    for path, cls in TABLES:
        title = "[[node]]" if path == "node" else f"[[{path}]]" if path == "router.tenant" \
            else f"[{path}]"
        summary = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
        out += [f"## `{title}`", "", summary, "",
                "| key | type | default | meaning |", "|---|---|---|---|",
                *table_rows(path, cls), ""]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="write here instead of stdout "
                                                    "(the committed copy: docs/configuration.md)")


def run(args: argparse.Namespace) -> int:
    text = render_reference()
    if args.out is None:
        sys.stdout.write(text)
    else:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0
