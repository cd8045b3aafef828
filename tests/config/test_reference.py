"""docs/configuration.md is `pdcache config-reference`'s output: every topology key with its
type, default and meaning, generated from the schema, never stale."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

from pdcache.config import schema
from pdcache.config.reference import TABLES, field_comments, render_reference

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "configuration.md"


def test_the_committed_reference_is_current() -> None:
    assert COMMITTED.read_text() == render_reference(), (
        "docs/configuration.md is stale: regenerate it with "
        "`pdcache config-reference --out docs/configuration.md`")


def test_every_key_of_every_table_is_documented() -> None:
    text = render_reference()
    for path, cls in TABLES:
        comments = field_comments(cls)
        for field in dataclasses.fields(cls):
            if dataclasses.is_dataclass(field.default_factory()  # type: ignore[misc]
                                        if field.default_factory is not dataclasses.MISSING
                                        else None) or field.name == "tenant":
                continue  # a sub-table, documented as its own table
            key = f"node.NAME.{field.name}" if path == "node" else f"{path}.{field.name}"
            assert f"| `{key}` |" in text, key
            assert comments.get(field.name), f"{key} has no comment in config/schema.py"


def test_every_schema_table_is_in_the_reference() -> None:
    """Every `*Spec` section of the schema, and each section the topology embeds from the
    package that runs with it (the engine's `SchedulerConfig` as `[scheduler]`), is a table."""
    specs = {obj for name, obj in vars(schema).items()
             if name.endswith("Spec") and dataclasses.is_dataclass(obj)}
    hints = typing.get_type_hints(schema.Topology)
    embedded = {hints[f.name] for f in dataclasses.fields(schema.Topology)
                if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])}
    assert specs | embedded == {cls for _, cls in TABLES}


def test_the_command_prints_it() -> None:
    proc = subprocess.run([sys.executable, "-m", "pdcache", "config-reference"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == render_reference()
