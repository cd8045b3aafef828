"""Loading Hugging Face safetensors checkpoints into `CausalLM` (same parameter names)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pdcache.engine.model import CausalLM

# Checkpoint tensors that carry no weights of ours (old Llama exports saved RoPE tables).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's shards: those named by model.safetensors.index.json, else *.safetensors."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shards listed in the index are missing: {missing}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, one shard open at a time."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def required_names(model: CausalLM) -> set[str]:
    """Parameter names a checkpoint must provide (a tied lm_head comes from embed_tokens)."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if model.config.tie_word_embeddings:
        names.discard("lm_head.weight")
    return names


@torch.no_grad()
def load_weights(model: CausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into `model`'s parameters (cast to their dtype).

    Raises ValueError listing missing tensors, shape mismatches and unknown tensors, so a
    wrong or partial checkpoint never runs with uninitialised weights.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    required = required_names(model)
    loaded: set[str] = set()
    problems: list[str] = []
    for name, tensor in tensors:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name not in params:
            problems.append(f"unexpected tensor {name}")
            continue
        if tuple(tensor.shape) != tuple(params[name].shape):
            want = tuple(params[name].shape)
            problems.append(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {want}")
            continue
        params[name].copy_(tensor)
        loaded.add(name)
    missing = sorted(required - loaded)
    if missing:
        problems.insert(0, f"missing tensors ({len(missing)}): {', '.join(missing[:8])}")
    if problems:
        raise ValueError("checkpoint does not match the model config: " + "; ".join(problems[:12]))
