"""`pdcache bench kv-bytes`: rows from the geometry, DeepSeek-V3's latent against Llama-70B."""

from __future__ import annotations

import json

from pdcache.bench import kv_bytes


def test_rows_give_the_real_shapes_bytes(tmp_path) -> None:
    out = tmp_path / "kv.json"
    args = kv_bytes.argparse.Namespace(page_size=64, json_path=str(out))
    assert kv_bytes.run(args) == 0
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    deepseek = rows["DeepSeek-V3 / R1, Kimi K2"]
    assert (deepseek["bytes_per_token"], deepseek["slabs"]) == (61 * 576 * 2, 1)
    assert rows["Llama-3.1-70B"]["bytes_per_token"] == 327_680
    assert deepseek["vs_llama70b"] == round(70_272 / 327_680, 4)
    assert rows["preset tiny-mla"]["bytes_per_page"] == 64 * 4 * 80 * 4
