"""Runs one of SGLang's own client entry points, unmodified, in this process:

    python tests/sglang_client_runner.py bench_serving ARGS...   # sglang.bench_serving's CLI
    python tests/sglang_client_runner.py cache_hit BASE_URL MODEL_DIR DATASET_JSON

SGLang's client modules import `sglang.srt.disaggregation.utils` for one constant
(`FAKE_BOOTSTRAP_HOST`); that server-side module pulls in SGLang's multimodal stack and so
torchvision, which has no CPU build for torch 2.13.0+cpu on this machine (PyPI's 0.28.0 links
libc10_cuda.so). The runner puts a module holding just that constant in its place; nothing
the clients run is replaced."""

from __future__ import annotations

import json
import runpy
import sys
import types


def _without_server_side_imports() -> None:
    name = "sglang.srt.disaggregation.utils"
    try:
        __import__(name)
    except ImportError:
        stand_in = types.ModuleType(name)
        stand_in.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # type: ignore[attr-defined]  # SGLang's value
        sys.modules[name] = stand_in


def main() -> None:
    _without_server_side_imports()
    command, args = sys.argv[1], sys.argv[2:]
    if command == "bench_serving":
        sys.argv = ["sglang.bench_serving", *args]
        runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
    elif command == "cache_hit":
        from sglang.test.kits.cache_hit_kit import run_multiturn_cache_hit_test

        base_url, model_dir, dataset = args[:3]
        result = run_multiturn_cache_hit_test(
            base_url, model_dir, num_clients=2, num_rounds=3, request_length=40,
            output_length=8, dataset_path=dataset, max_parallel=2)
        print("CACHE_HIT_RESULT " + json.dumps(result))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
