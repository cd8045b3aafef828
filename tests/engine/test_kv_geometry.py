"""The KV geometry: sizes of every family, and no module outside it and the kernels spells a
cache layout (reads a model's head sizes to shape a cache, or hard-codes K and V slabs)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.presets import preset_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pdcache"

# Reading these from a config means building a cache shape by hand.
SHAPE_FIELDS = frozenset({"num_key_value_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim",
                          "v_head_dim"})
# Text that describes the old fixed two-slab layout.
LAYOUT_TEXT = ("[L, 2,", "[P, L, 2,", "[N, L, 2,", "l * 2 +", "l*2+")

# Modules that may, with the reason.
ALLOWED: dict[str, str] = {
    "engine/kv_geometry.py": "the geometry itself",
    "engine/config.py": "the model config the geometry is derived from",
    "engine/model.py": "the attention computes with its heads",
    "engine/mla.py": "the latent attention computes with its ranks",
    "engine/qwen3_next.py": "the gated attention computes with its heads; reads config.json",
    "engine/layers.py": "RoPE over the rotated head dims",
    "engine/loader.py": "reads Hugging Face config.json",
    "engine/export.py": "writes Hugging Face config.json",
    "engine/presets.py": "defines the presets' shapes",
    "integrations/sglang/geometry.py": "SGLang's own host-pool layouts, mapped to a KVGeometry",
    "bench/kernel_bench.py": "a kernel micro-benchmark on raw pools, as the kernels",
    "bench/engine_bench.py": "varies a ModelConfig's shape",
    "bench/sglang_plugin_bench.py": "builds SGLang-shaped host pools (SGLang's layout)",
    "bench/pd_bench.py": "passes the model's shape to the transfer bench's command line",
    "bench/transfer_bench.py": "its command line takes a raw shape (--kv-heads, --head-dim)",
}


def layout_findings(source: str, where: str = "<src>") -> list[str]:
    """Places in `source` that spell a cache layout: shape fields read off an object, literal
    6-D shapes with a slab count of 2, and text of the two-slab layout."""
    findings = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in SHAPE_FIELDS:
            findings.append(f"{where}:{node.lineno}: reads .{node.attr}")
        elif isinstance(node, ast.Tuple | ast.List) and _six_d_with_two_slabs(node):
            findings.append(f"{where}:{node.lineno}: a literal 6-D shape with 2 slabs")
    for lineno, line in enumerate(source.splitlines(), 1):
        findings += [f"{where}:{lineno}: {text!r}" for text in LAYOUT_TEXT if text in line]
    return findings


def _six_d_with_two_slabs(node: ast.Tuple | ast.List) -> bool:
    """`(L, 2, P, S, H, D)` or `(P, L, 2, S, H, D)`: six dims, some named, a literal 2 as the
    slab count (a tuple of six constants is data, not a shape)."""
    if len(node.elts) != 6 or all(isinstance(e, ast.Constant) for e in node.elts):
        return False
    return any(isinstance(e, ast.Constant) and e.value == 2 for e in node.elts[1:3])


def _package_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not _under(p, "kernels"))


def _under(path: Path, package: str) -> bool:
    return path.relative_to(PACKAGE).parts[0] == package


def test_no_module_outside_the_geometry_and_the_kernels_spells_a_layout() -> None:
    findings = []
    for path in _package_modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in ALLOWED:
            findings += layout_findings(path.read_text(), rel)
    assert not findings, "modules spell a KV layout (ask KVGeometry):\n" + "\n".join(findings)


def test_the_allow_list_names_existing_modules_only() -> None:
    missing = [rel for rel in ALLOWED if not (PACKAGE / rel).is_file()]
    assert not missing


HARD_CODED = '''
def make_host_pool(model, num_pages, page_size):
    """host_kv[P, L, 2, S, H, D]"""
    shape = (num_pages, model.num_hidden_layers, 2, page_size, model.num_key_value_heads,
             model.head_dim)
    return torch.zeros(shape)


def page_addr(base, l, k, p, num_pages, page_bytes):
    return base + ((l * 2 + k) * num_pages + p) * page_bytes
'''

GEOMETRY_BASED = '''
def make_host_pool(geometry, num_pages, page_size):
    return torch.zeros(geometry.host_shape(num_pages, page_size))
'''


def test_the_check_catches_a_module_that_hard_codes_a_layout() -> None:
    findings = layout_findings(HARD_CODED)
    assert any(".num_key_value_heads" in f for f in findings)
    assert any(".head_dim" in f for f in findings)
    assert any("6-D shape" in f for f in findings)
    assert any("'[P, L, 2,'" in f for f in findings)
    assert any("'l * 2 +'" in f for f in findings)
    assert layout_findings(GEOMETRY_BASED) == []


# ---- sizes ---------------------------------------------------------------------------------

def test_real_shapes_bytes_per_token() -> None:
    deepseek_v3 = KVGeometry.mla(61, kv_lora_rank=512, rope_dim=64, dtype="bfloat16")
    llama_70b = KVGeometry.mha(80, kv_heads=8, head_dim=128, dtype="bfloat16")
    assert deepseek_v3.token_bytes == 61 * 576 * 2 == 70_272
    assert llama_70b.token_bytes == 327_680
    assert deepseek_v3.page_bytes(64) == 64 * 70_272
    assert deepseek_v3.device_shape(10, 64) == (61, 1, 10, 64, 1, 576)
    assert llama_70b.host_shape(3, 16) == (3, 80, 2, 16, 8, 128)


def test_presets_geometry_matches_their_config() -> None:
    tiny = preset_config("tiny")
    assert tiny.kv_geometry == KVGeometry.mha(4, 2, 32, "float32")
    assert tiny.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4


def test_fingerprints_differ_between_geometries_of_equal_bytes() -> None:
    # 1 slab of 64 vs 2 slabs of 32: the same bytes per token, never the same pages
    mla = KVGeometry.mla(4, kv_lora_rank=48, rope_dim=16, dtype="float32")
    mha = KVGeometry.mha(4, kv_heads=1, head_dim=32, dtype="float32")
    assert mla.token_bytes == mha.token_bytes
    assert mla.fingerprint("m", 16) != mha.fingerprint("m", 16)
    assert mla.layout_key(16) != mha.layout_key(16)


def test_the_mha_fingerprint_is_unchanged_so_stored_pages_stay_valid() -> None:
    geometry = KVGeometry.mha(4, kv_heads=2, head_dim=32, dtype="float32")
    assert geometry.fingerprint("preset:tiny:seed=0", 4) == (
        "model=preset:tiny:seed=0;dtype=float32;page=4;layers=4;kv_heads=2;head_dim=32;"
        "layout=page_first;tp=0/1")


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="gqa"), "unknown KV kind"),
    (dict(dtype="float8"), "not supported"),
    (dict(layer_kinds=("full", "recurrent")), "not run by this engine"),
    (dict(layer_kinds=("full", "sliding")), "positive sliding_window"),
    (dict(layer_kinds=("full", "full"), sliding_window=8), "needs sliding layers"),
    (dict(heads=0), "positive sizes"),
])
def test_bad_geometries_are_refused_naming_the_problem(kwargs, message) -> None:
    base = dict(kind="mha", num_layers=2, heads=2, head_dim=8, value_dim=8, dtype="float32")
    with pytest.raises(ValueError, match=message):
        KVGeometry(**{**base, **kwargs})


def test_device_shape_check_names_the_expected_shape() -> None:
    geometry = KVGeometry.mla(2, kv_lora_rank=8, rope_dim=4, dtype="float32")
    geometry.check_device_shape((2, 1, 5, 4, 1, 12))
    with pytest.raises(ValueError, match=r"\[2, 1, P, S, 1, 12\]"):
        geometry.check_device_shape((2, 2, 5, 4, 1, 12))
