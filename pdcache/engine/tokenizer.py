"""Tokenizers: a byte-level one for the random-weight presets and a `tokenizers`-backed one for
real checkpoints. Both turn chat messages into token ids with the model's chat template."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Message = dict[str, Any]


class Tokenizer(ABC):
    """What the engine and servers need from a tokenizer. Implementations are stateless after
    construction and safe to share between threads."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens are produced from plain text)."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""

    @abstractmethod
    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat rendered with the model's template; `tools` (OpenAI function
        definitions `{"type": "function", "function": {...}}`) and `template_kwargs` (extra
        template variables, as `chat_template_kwargs`: `enable_thinking`) are handed to the
        template. A template that reads no such variable renders as without them."""


# Variables the server itself gives a chat template: `chat_template_kwargs` may not set them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})

BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes; 256.. are the special tokens of BYTE_SPECIAL_TOKENS.

    `encode` never produces special ids from text (a prompt that contains "<|im_end|>" is just
    those bytes), so `decode(encode(t)) == t` for every string. Chat template (ChatML-like):
    `<|bos|>` then per message `<|im_start|>{role}\\n{content}<|im_end|>\\n`, and with
    `add_generation_prompt` a final `<|im_start|>assistant\\n`.

    Tools, Qwen2.5-style (docs/tools.md): with `tools`, the first system message's content (or
    a new first system message) gets `render_tools_block(tools)` (one `tojson` line per tool in
    `<tools></tools>`, then the `<tool_call>` instructions); an assistant message's
    `tool_calls` follow its content as `<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>`
    (each after a `\\n` unless it opens an empty content); `tool` messages are ordinary
    `<|im_start|>tool\\n...` turns. `pdcache.engine.export.CHAT_TEMPLATE` renders the same ids.
    """

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(BYTE_SPECIAL_TOKENS)}
        self.special_tokens = {i: tok for tok, i in self.special_ids.items()}
        self.vocab_size = 256 + len(BYTE_SPECIAL_TOKENS)
        self.bos_token_id = self.special_ids["<|bos|>"]
        self.pad_token_id = self.special_ids["<|pad|>"]
        self.im_start_id = self.special_ids["<|im_start|>"]
        self.im_end_id = self.special_ids["<|im_end|>"]
        self.eos_token_ids = (self.special_ids["<|eos|>"], self.im_end_id)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, pending = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                pending.append(i)
                continue
            if i not in self.special_tokens:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens:
                out.append(self.special_tokens[i])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        ids = [self.bos_token_id]
        for message in with_tools_system(messages, tools):
            role, content = _role_and_content(message)
            body = content + render_tool_calls(message.get("tool_calls"), content)
            ids += [self.im_start_id, *self.encode(f"{role}\n{body}"), self.im_end_id]
            ids += self.encode("\n")
        if add_generation_prompt:
            ids += [self.im_start_id, *self.encode("assistant\n")]
        return ids


def _role_and_content(message: Message) -> tuple[str, str]:
    role, content = message.get("role"), message.get("content")
    if content is None and message.get("tool_calls"):
        content = ""  # OpenAI: an assistant turn that only calls tools has content null
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(f"a chat message needs string 'role' and 'content', got {message!r}")
    return role, content


# Qwen2.5's tool prompt (the Hermes format: <tool_call>{json}</tool_call>), shared by the byte
# tokenizer and the exported jinja template so both render identical ids.
TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tojson(value: Any) -> str:
    """JSON as transformers' chat-template `tojson` filter writes it (keys in order, non-ASCII
    kept, `", "` / `": "` separators), so our renderer and HF's give the same text."""
    return json.dumps(value, ensure_ascii=False)


def render_tools_block(tools: list[dict[str, Any]]) -> str:
    return TOOLS_INTRO + "".join("\n" + tojson(tool) for tool in tools) + TOOLS_OUTRO


def with_tools_system(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message]:
    """`messages` with the tools block appended to the first system message (or added as one)."""
    if not tools:
        return messages
    block = render_tools_block(tools)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def render_tool_calls(tool_calls: Any, content: str) -> str:
    """The `<tool_call>` blocks of an assistant message (OpenAI `tool_calls`; `arguments` is
    JSON text, written as it is, or an object, written as its `tojson`)."""
    if not tool_calls:
        return ""
    out = []
    for i, call in enumerate(tool_calls):
        function = call.get("function", call)
        arguments = function.get("arguments")
        # JSON text (OpenAI's `arguments`) is written as it is, an object as its tojson
        arguments = arguments if isinstance(arguments, str) else tojson(arguments)
        sep = "\n" if content or i > 0 else ""
        out.append(
            f'{sep}<tool_call>\n{{"name": {tojson(function.get("name"))}, '
            f'"arguments": {arguments}}}\n</tool_call>'
        )
    return "".join(out)


class HFTokenizer(Tokenizer):
    """A checkpoint's `tokenizer.json` (via the `tokenizers` library) plus the Jinja chat
    template and special tokens from `tokenizer_config.json`."""

    def __init__(self, path: str | Path, eos_token_ids: Sequence[int] = ()) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json; pdcache loads tokenizers only from tokenizer.json"
                " (convert a slow/sentencepiece tokenizer with transformers' "
                "AutoTokenizer.from_pretrained(...).save_pretrained(...))"
            )
        self._tok = RustTokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        self.chat_template = _chat_template(path, config)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id_of(self.bos_token)
        self.pad_token_id = self._id_of(_token_text(config.get("pad_token")))
        eos = [*eos_token_ids, self._id_of(self.eos_token)]
        self.eos_token_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
        self._path = path

    @property
    def tokenizer_file(self) -> Path:
        """The checkpoint's tokenizer.json (grammar libraries read the vocabulary from it)."""
        return self._path / "tokenizer.json"

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if self.chat_template is None:
            raise ValueError(
                f"{self._path} has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); send a plain prompt instead"
            )
        for message in messages:
            _role_and_content(message)
        taken = sorted(RESERVED_TEMPLATE_VARIABLES & set(template_kwargs or {}))
        if taken:
            raise ValueError(f"template variables {taken} are the server's to set")
        text = _render_template(
            self.chat_template,
            **dict(template_kwargs or {}),
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools or None,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return self.encode(text)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json holds either "<s>" or {"content": "<s>", ...}
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    return template


def _render_template(template: str, **context: Any) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson  # transformers' filter (jinja's own sorts keys, escapes <>)
    try:
        return env.from_string(template).render(**context)
    except TemplateError as exc:
        raise ValueError(f"chat template failed: {exc}") from exc
