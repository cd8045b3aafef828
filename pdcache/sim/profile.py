"""The simulator's cost profile: how long compute and I/O take on some hardware.

A profile is a TOML file with five required tables and an optional sixth, `[serving]`; every
key of a table is required but `[serving]`'s later ones — `token_s`, `relay_token_s` (absent:
0, not modelled) and `prefill_warmup_s` (absent: `warmup_s`) — and a missing or unknown key is
a `ProfileError` naming it, so no number is ever made up by the simulator (without `[serving]`, the serving path's own costs
are not modelled: zero). pdcache ships no
profile: measure one on your hardware (docs/simulator.md says how each field is read) and
write it down. Units are seconds and bytes per second.

```toml
[prefill]                     # one prefill step (a chunked-prefill batch) takes
base_s = 0.004                #   base_s
per_token_s = 2e-5            # + per_token_s * tokens computed in the step
per_token_context_s = 1e-10   # + per_token_context_s * sum(chunk tokens * context after chunk)

[decode]                      # one decode step (one token for each running request) takes
base_s = 0.006                #   base_s
per_request_s = 1e-4          # + per_request_s * requests in the batch
per_context_token_s = 1e-8    # + per_context_token_s * sum of the requests' context tokens

[transfer]                    # prefill -> decode KV push of one request (one "room")
bandwidth_Bps = 1.0e10        # bytes per second out of one prefill node
per_room_s = 0.001            # fixed cost per request (handshake, completion notice)

[host]                        # host <-> device copies on one node
h2d_bandwidth_Bps = 2.0e10    # host pages loaded to device before the prefill uses them
d2h_bandwidth_Bps = 2.0e10    # device pages copied to host (backup, decode write-back)

[storage]                     # the storage tier every node shares
read_bandwidth_Bps = 5.0e9    # the whole store's read bandwidth, shared by every node
write_bandwidth_Bps = 3.0e9   # the whole store's write bandwidth, shared by every node
node_nic_Bps = 1.25e9         # one node's link to the store (each direction)
op_latency_s = 0.0005         # per read or write operation (one batch of pages)
metadata_op_s = 0.0002        # per metadata operation (an existence lookup, an index update)

[serving]                     # optional: the serving path around the steps (all seconds)
request_s = 0.004             # per request: client HTTP, router hop, node HTTP, tokenisation,
                              #   queueing into the engine, streaming the first token back
step_s = 0.001                # per engine step: the step loop (scheduling, sampling, output)
handoff_s = 0.005             # per PD request: from the decode node's page reservation to
                              #   the prefill node computing (decode asks for the K/V)
warmup_s = 0.03               # once per unified node (and prefill node, unless below): its
                              #   first step (warm-up)
decode_warmup_s = 0.3         # once per decode node: its first step (first receive + forward)
token_s = 0.0004              # optional (0): per token a step streams, added to that step
                              #   (the node's output path shares the engine's process)
relay_token_s = 0.0005        # optional (0): CPU per streamed token outside the nodes (the
                              #   router's relay, the client): work on a shared host's cores
prefill_warmup_s = 0.03       # optional (= warmup_s): a prefill node's first step (warm-up)

[source]                      # optional, not a cost: where the numbers come from (strings)
machine = "..."               # `pdcache sim calibrate` writes machine, preset, date, command
```
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as `tomli`
    import tomli as tomllib


class ProfileError(ValueError):
    """A profile file is missing, unreadable, or has a missing, unknown or bad key."""


NO_PROFILE = (
    "pdcache sim needs --profile FILE: the measured costs of compute and I/O on the hardware "
    "to simulate. pdcache ships no profile (its numbers would be invented); write one from "
    "your own measurements (docs/simulator.md, 'The profile', lists every field)."
)


@dataclass(frozen=True)
class PrefillCost:
    """`[prefill]`: seconds of one prefill step."""

    base_s: float
    per_token_s: float
    per_token_context_s: float

    def step_s(self, tokens: int, token_context: int) -> float:
        """A step computing `tokens` tokens whose chunk-tokens x context sum is
        `token_context` (attention reads every earlier token of its request)."""
        return self.base_s + self.per_token_s * tokens + self.per_token_context_s * token_context


@dataclass(frozen=True)
class DecodeCost:
    """`[decode]`: seconds of one decode step."""

    base_s: float
    per_request_s: float
    per_context_token_s: float

    def step_s(self, requests: int, context_tokens: int) -> float:
        return (self.base_s + self.per_request_s * requests
                + self.per_context_token_s * context_tokens)


@dataclass(frozen=True)
class TransferCost:
    """`[transfer]`: the prefill -> decode KV push."""

    bandwidth_Bps: float  # noqa: N815 - the unit in the name, as in the file
    per_room_s: float


@dataclass(frozen=True)
class HostCost:
    """`[host]`: copies between a node's device and host memory."""

    h2d_bandwidth_Bps: float  # noqa: N815
    d2h_bandwidth_Bps: float  # noqa: N815


@dataclass(frozen=True)
class StorageCost:
    """`[storage]`: the shared store and each node's link to it."""

    read_bandwidth_Bps: float  # noqa: N815
    write_bandwidth_Bps: float  # noqa: N815
    node_nic_Bps: float  # noqa: N815
    op_latency_s: float
    metadata_op_s: float


@dataclass(frozen=True)
class ServingCost:
    """`[serving]` (optional; zero when absent): the real serving path's costs around the
    model's steps, which the compute tables do not hold."""

    request_s: float = 0.0  # per request, before its first token (HTTP, router, tokeniser)
    step_s: float = 0.0  # per engine step, prefill or decode (the step loop itself)
    handoff_s: float = 0.0  # per PD request: decode's K/V ask reaching the prefill node
    warmup_s: float = 0.0  # once per unified node (prefill too, unless prefill_warmup_s)
    decode_warmup_s: float = 0.0  # once per decode node, on its first step
    # optional keys (older profiles lack them: 0, not modelled)
    token_s: float = 0.0  # per token a step streams, added to that step
    relay_token_s: float = 0.0  # shared host: the router's and the client's CPU per token
    prefill_warmup_s: float | None = None  # a prefill node's first step; None: warmup_s

    OPTIONAL_KEYS: ClassVar[tuple[str, ...]] = ("token_s", "relay_token_s",
                                                "prefill_warmup_s")

    @property
    def prefill_warmup(self) -> float:
        """A prefill node's warm-up: `prefill_warmup_s`, else `warmup_s`."""
        return self.warmup_s if self.prefill_warmup_s is None else self.prefill_warmup_s


@dataclass(frozen=True)
class Profile:
    """Every cost the simulator charges; plain data, read once per run."""

    prefill: PrefillCost
    decode: DecodeCost
    transfer: TransferCost
    host: HostCost
    storage: StorageCost
    serving: ServingCost = ServingCost()


_SECTIONS: dict[str, type] = {"prefill": PrefillCost, "decode": DecodeCost,
                              "transfer": TransferCost, "host": HostCost, "storage": StorageCost}
OPTIONAL_SECTIONS: dict[str, type] = {"serving": ServingCost}


def _section(name: str, cls: type, table: Any, source: str) -> Any:
    if not isinstance(table, dict):
        raise ProfileError(f"{source}: [{name}] is missing (every table is required)")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ProfileError(f"{source}: {name}.{unknown[0]}: unknown key; keys: {', '.join(names)}")
    values = {}
    optional = getattr(cls, "OPTIONAL_KEYS", ())
    for key in names:
        if key not in table and key in optional:
            continue
        if key not in table:
            raise ProfileError(f"{source}: {name}.{key} is missing (every key is required)")
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ProfileError(f"{source}: {name}.{key}: expected a number >= 0, got {value!r}")
        if key.endswith("Bps") and value <= 0:
            raise ProfileError(f"{source}: {name}.{key}: a bandwidth must be > 0")
        values[key] = float(value)
    return cls(**values)


SOURCE_TABLE = "source"  # optional provenance table (strings), never a cost


def profile_from_dict(raw: dict[str, Any], source: str = "<profile>") -> Profile:
    """A `Profile` from a parsed TOML tree; ProfileError names the first bad key. The
    optional `[source]` table (provenance) must hold strings and is not part of the costs."""
    provenance = raw.get(SOURCE_TABLE, {})
    if not isinstance(provenance, dict) or not all(isinstance(v, str)
                                                   for v in provenance.values()):
        raise ProfileError(f"{source}: [{SOURCE_TABLE}] must be a table of strings")
    unknown = sorted(set(raw) - set(_SECTIONS) - set(OPTIONAL_SECTIONS) - {SOURCE_TABLE})
    if unknown:
        raise ProfileError(f"{source}: [{unknown[0]}]: unknown table; tables: "
                           f"{', '.join([*_SECTIONS, *OPTIONAL_SECTIONS])}")
    parts = {name: _section(name, cls, raw.get(name), source) for name, cls in _SECTIONS.items()}
    parts.update({name: _section(name, cls, raw[name], source)
                  for name, cls in OPTIONAL_SECTIONS.items() if name in raw})
    return Profile(**parts)


def load_profile(path: str | Path | None) -> Profile:
    """The profile in `path`; ProfileError (with `NO_PROFILE` when `path` is None)."""
    if path is None:
        raise ProfileError(NO_PROFILE)
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read the profile ({exc.strerror or exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML ({exc})") from exc
    return profile_from_dict(raw, str(path))
