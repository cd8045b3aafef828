"""SGLang's service endpoints as both the servers and the router speak them (docs/design.md
§4.1): the table of paths and methods every app mounts (`service_handlers`), the
`/get_model_info` body, and the parsing of `/close_session` bodies and `/flush_cache`'s
`?timeout=`. A node answers them from its engine (`server.service.ServiceRoutes`), the router
from its core (`router.service.RouterService`). Pure functions; no state.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response

from pdcache.engine.config import ModelConfig
from pdcache.engine.presets import PRESETS
from pdcache.wire.protocol import bad_request
from pdcache.wire.responses import Handler

MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
TIER_IO_GRACE_S = 5.0  # an idle engine's flush waits this long for storage writes to end


class ServiceEndpoints(Protocol):
    """SGLang's service endpoints, as a node (`ServiceRoutes`) or the router answers them."""

    async def server_info(self, request: Request) -> Response: ...
    async def model_info(self, request: Request) -> Response: ...
    async def health_generate(self, request: Request) -> Response: ...
    async def flush_cache(self, request: Request) -> Response: ...
    async def close_session(self, request: Request) -> Response: ...


def service_handlers(service: ServiceEndpoints) -> list[tuple[str, str, Handler]]:
    """SGLang's service endpoints, with the methods SGLang accepts (and POST for health);
    the servers and the router mount the same table."""
    return [("GET", "/server_info", service.server_info),
            ("GET", "/get_server_info", service.server_info),
            ("GET", "/model_info", service.model_info),
            ("GET", "/get_model_info", service.model_info),
            ("GET", "/health_generate", service.health_generate),
            ("POST", "/health_generate", service.health_generate),
            ("GET", "/flush_cache", service.flush_cache),
            ("POST", "/flush_cache", service.flush_cache),
            ("POST", "/close_session", service.close_session)]


def model_info_body(model: ModelConfig, model_path: str, served_name: str, mode: str,
                    tool_call_parser: str | None = None,
                    reasoning_parser: str | None = None) -> dict[str, Any]:
    """`/get_model_info`'s fields (SGLang's names); shared with the router."""
    return {
        "model_path": model_path, "served_model_name": served_name,
        "tokenizer_path": model_path, "is_generation": True,
        "preferred_sampling_params": None, "weight_version": "default",
        "load_format": "dummy" if model_path in PRESETS else "auto",  # presets: random weights
        "reasoning_parser": reasoning_parser, "tool_call_parser": tool_call_parser,
        "disaggregation_mode": mode,
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": MODEL_TYPES.get(model.architecture),
        "architectures": [model.architecture],
    }


async def close_session_body(request: Request) -> tuple[str, str]:
    """(session_id, cache_salt) of a `/close_session` body; 400 unless session_id is a
    non-empty string and cache_salt, when given, a string."""
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("the body must be a JSON object") from None
    session_id = body.get("session_id") if isinstance(body, dict) else None
    if not isinstance(session_id, str) or not session_id:
        raise bad_request("session_id must be a non-empty string", param="session_id")
    cache_salt = body.get("cache_salt") or ""
    if not isinstance(cache_salt, str):
        raise bad_request("cache_salt must be a string", param="cache_salt")
    return session_id, cache_salt


def timeout_param(request: Request) -> float:
    """`?timeout=S` of /flush_cache (SGLang's; default 0); 400 unless a number >= 0."""
    raw = request.query_params.get("timeout", "0")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0.0 or value == float("inf"):
        raise bad_request(f"timeout must be a number of seconds >= 0, got {raw!r}",
                          param="timeout", code="invalid_timeout")
    return value
