"""`pdcache export-model`: a preset as a Hugging Face checkpoint that pdcache and transformers
load with the preset's weights, tokenizer ids and chat template ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from pdcache.cli import main as pdcache_main  # noqa: E402
from pdcache.engine.api import GenerateRequest, SamplingParams  # noqa: E402
from pdcache.engine.config import CacheConfig  # noqa: E402
from pdcache.engine.engine import Engine  # noqa: E402
from pdcache.engine.export import (  # noqa: E402
    ExportError,
    bytes_to_unicode,
    export_preset,
    hf_config,
)
from pdcache.engine.loader import (  # noqa: E402
    allocate_device_kv,
    load_model,
    load_model_config,
    model_config_from_hf,
)
from pdcache.engine.presets import PRESETS, preset_config  # noqa: E402
from pdcache.engine.tokenizer import BYTE_SPECIAL_TOKENS, ByteTokenizer, HFTokenizer  # noqa: E402
from tests.engine.test_model_parity import ATOL, PAGE, extend, hf_logits  # noqa: E402

TOK = ByteTokenizer()
FILES = {
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
}
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo wörld €"},
        {"role": "assistant", "content": "Hello\n  there"},
        {"role": "user", "content": ""},
    ],
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Wéather <now>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CHATS = [
    CHATS[0],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"function": {"name": "x", "arguments": {}}}]},
    ],
]
# Text without special-token strings: there both tokenizers give the same ids.
PLAIN_TEXT = st.text().filter(lambda t: not any(s in t for s in BYTE_SPECIAL_TOKENS))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "tiny"
    export_preset("tiny", out)
    return out


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = _state(a), _state(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    req = GenerateRequest("r", ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [t for out in engine.generate(req, timeout=60) for t in out.new_token_ids]


# --- what is written --------------------------------------------------------------------------

def test_export_writes_a_hf_checkpoint(exported: Path) -> None:
    assert {p.name for p in exported.iterdir()} == FILES
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["eos_token_id"] == list(TOK.eos_token_ids)
    assert (exported / "model.safetensors").stat().st_mode & 0o044  # readable by servers
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [257, 260] and generation["bos_token_id"] == 256


@pytest.mark.parametrize("name", list(PRESETS))
def test_config_json_describes_the_preset(name: str) -> None:
    """For every preset (small without writing its weights): our loader and transformers read
    the config.json back as the preset's shape."""
    preset = preset_config(name)
    hf = hf_config(preset)
    assert model_config_from_hf(hf, preset.name) == preset
    if preset.is_mla:
        deepseek = transformers.DeepseekV3Config.from_dict(hf)
        assert (deepseek.kv_lora_rank, deepseek.qk_rope_head_dim, deepseek.n_routed_experts) == (
            preset.kv_lora_rank, preset.qk_rope_head_dim, preset.moe.num_experts)
        assert deepseek.rope_parameters["rope_type"] == "yarn"
        return
    llama = transformers.LlamaConfig.from_dict(hf)
    assert (llama.hidden_size, llama.num_key_value_heads, llama.head_dim) == (
        preset.hidden_size, preset.num_key_value_heads, preset.head_dim)
    assert llama.rope_parameters["rope_theta"] == preset.rope_theta
    assert llama.max_position_embeddings == preset.max_position_embeddings


# --- pdcache loads it ---------------------------------------------------------------------------

def test_pdcache_loads_the_preset_weights_and_tokenizer(exported: Path) -> None:
    model, tokenizer = load_model(str(exported))
    preset, _ = load_model("tiny")
    assert _same_weights(model, preset)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.eos_token_ids == TOK.eos_token_ids
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id) == (TOK.bos_token_id, TOK.pad_token_id)
    for chat in CHATS:
        for gen in (True, False):
            assert tokenizer.apply_chat_template(chat, gen) == TOK.apply_chat_template(chat, gen)
    assert load_model_config(str(exported)).max_position_embeddings == 8192


def test_exported_template_renders_tools_and_tool_calls_to_our_ids(exported: Path) -> None:
    tokenizer = HFTokenizer(exported)
    for chat in TOOL_CHATS:
        for tools in (None, TOOLS):
            for gen in (True, False):
                ours = TOK.apply_chat_template(chat, gen, tools=tools)
                assert tokenizer.apply_chat_template(chat, gen, tools=tools) == ours
    text = TOK.decode(TOK.apply_chat_template(TOOL_CHATS[1], tools=TOOLS), False)
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city":"Paris"}}\n</tool_call>\n<tool_call>') in text


def test_served_checkpoint_gives_the_presets_greedy_tokens(exported: Path) -> None:
    cache = CacheConfig(page_size=PAGE, num_device_pages=128)
    prompt = TOK.apply_chat_template(CHATS[1])
    with Engine.from_spec(str(exported), cache=cache) as engine:
        from_checkpoint = _greedy(engine, prompt, 32)
    with Engine.from_spec("tiny", cache=cache) as engine:
        from_preset = _greedy(engine, prompt, 32)
    assert len(from_checkpoint) == 32
    assert from_checkpoint == from_preset


# --- transformers loads it ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_model(exported: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        exported, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _assert_transformers_runs_as_we_do(hf_model: torch.nn.Module, preset: str) -> None:
    """transformers' logits of a chat prompt equal ours, and its greedy tokens our engine's."""
    model, _ = load_model(preset)
    ids = TOK.apply_chat_template(CHATS[1])
    kv = allocate_device_kv(model.config, num_pages=64, page_size=PAGE)
    ours = extend(model, kv, ids, 0, torch.arange(64))
    theirs = hf_logits(hf_model, ids)
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=1e-4)
    generated = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    theirs_tokens = generated[0, len(ids):].tolist()  # may stop early at an eos id
    with Engine.from_spec(preset, cache=CacheConfig(page_size=PAGE, num_device_pages=64)) as eng:
        ours_tokens = _greedy(eng, ids, 16)
    assert theirs_tokens and theirs_tokens == ours_tokens[: len(theirs_tokens)]


def test_transformers_logits_and_greedy_tokens_match_ours(hf_model: torch.nn.Module) -> None:
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    _assert_transformers_runs_as_we_do(hf_model, "tiny")


def test_mla_preset_exports_as_deepseek_v3_that_transformers_runs_as_we_do(
        tmp_path: Path) -> None:
    """tiny-mla (MLA + MoE) as a DeepseekV3ForCausalLM checkpoint with per-expert tensors (the
    Hub's layout): transformers' logits and greedy tokens equal ours, and our loader reads the
    checkpoint back to the preset's exact weights."""
    export_preset("tiny-mla", tmp_path)
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    assert _same_weights(load_model(str(tmp_path))[0], load_model("tiny-mla")[0])
    _assert_transformers_runs_as_we_do(hf_model, "tiny-mla")


@pytest.fixture(scope="module", params=["AutoTokenizer", "PreTrainedTokenizerFast"])
def hf_tokenizer(request: pytest.FixtureRequest, exported: Path) -> Any:
    return getattr(transformers, request.param).from_pretrained(exported)


def test_transformers_tokenizer_special_tokens(hf_tokenizer: Any) -> None:
    assert hf_tokenizer.convert_tokens_to_ids(list(BYTE_SPECIAL_TOKENS)) == [
        TOK.special_ids[t] for t in BYTE_SPECIAL_TOKENS]
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (
        256, 257, 258)
    assert len(hf_tokenizer) == TOK.vocab_size
    assert hf_tokenizer("abc")["input_ids"] == TOK.encode("abc")  # no BOS added


def test_transformers_tokenizer_round_trips_our_ids(hf_tokenizer: Any) -> None:
    ids = [TOK.bos_token_id, TOK.im_start_id, *TOK.encode("user\nhé €"), TOK.im_end_id,
           TOK.pad_token_id, 257]
    for skip in (True, False):
        text = hf_tokenizer.decode(ids, skip_special_tokens=skip)
        assert text == TOK.decode(ids, skip_special_tokens=skip)
    assert hf_tokenizer.encode(TOK.decode(ids, skip_special_tokens=False),
                               add_special_tokens=False) == ids
    euro = TOK.encode("€")  # a character split by a special token decodes the same way
    split = [*euro[:2], TOK.im_end_id, euro[2]]
    assert hf_tokenizer.decode(split, skip_special_tokens=False) == TOK.decode(split, False)


@pytest.fixture(scope="module")
def fast_tokenizer(exported: Path) -> Any:
    return transformers.PreTrainedTokenizerFast.from_pretrained(exported)


@settings(max_examples=60, deadline=None)
@given(text=PLAIN_TEXT)
def test_transformers_tokenizer_encodes_text_as_bytes(fast_tokenizer: Any, text: str) -> None:
    ids = fast_tokenizer.encode(text, add_special_tokens=False)
    assert ids == TOK.encode(text)
    assert fast_tokenizer.decode(ids) == text


def test_special_token_text_is_the_one_difference(fast_tokenizer: Any) -> None:
    """Documented: HF tokenizers match special-token text; the byte tokenizer keeps bytes."""
    assert fast_tokenizer.encode("a<|im_end|>", add_special_tokens=False) == [97, TOK.im_end_id]
    assert TOK.encode("a<|im_end|>") == list(b"a<|im_end|>")


def test_transformers_chat_template_gives_our_ids(hf_tokenizer: Any) -> None:
    for chat in CHATS:
        for gen in (True, False):
            ids = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True,
                                                   return_dict=False)
            assert list(ids) == TOK.apply_chat_template(chat, gen)
    for chat in TOOL_CHATS:
        ids = hf_tokenizer.apply_chat_template(chat, tools=TOOLS, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        assert list(ids) == TOK.apply_chat_template(chat, True, tools=TOOLS)


def test_byte_level_alphabet_is_the_tokenizers_one() -> None:
    from tokenizers import pre_tokenizers

    chars = bytes_to_unicode()
    assert sorted(chars) == list(range(256))
    assert set(chars.values()) == set(pre_tokenizers.ByteLevel.alphabet())


# --- the command ----------------------------------------------------------------------------

def test_cli_exports_with_seed_and_refuses_a_non_empty_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ckpt"
    assert pdcache_main(["export-model", "tiny", str(out), "--seed", "3"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    assert _same_weights(load_model(str(out))[0], load_model("tiny", seed=3)[0])

    assert pdcache_main(["export-model", "tiny", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--force" in err
    assert _same_weights(load_model(str(out))[0], load_model("tiny", seed=3)[0])  # untouched

    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    (out / "notes.txt").write_text("mine")
    assert pdcache_main(["export-model", "tiny", str(out), "--force"]) == 0
    assert not (out / "model-00002-of-00002.safetensors").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert _same_weights(load_model(str(out))[0], load_model("tiny", seed=0)[0])


def test_cli_refuses_a_file_and_unknown_presets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    assert pdcache_main(["export-model", "tiny", str(file)]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pdcache_main(["export-model", "huge", str(tmp_path / "x")])
    with pytest.raises(ExportError, match="unknown preset"):
        export_preset("huge", tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
