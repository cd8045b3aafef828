"""Runs SGLang's own client entry points, unmodified, in this process:

    python tests/sglang_client_runner.py bench_serving ARGS...   # sglang.bench_serving's CLI
    python tests/sglang_client_runner.py cache_hit BASE_URL MODEL_DIR DATASET_JSON
    python tests/sglang_client_runner.py serve   # many of the above, one per stdin line

`serve` imports the clients once and then reads JSON lines `{"argv": [COMMAND, ARGS...],
"out": PATH}` from stdin: each command runs as it would alone (`bench_serving` re-executes
the module from the top, as `python -m` does), its stdout and stderr go to PATH, and the
runner answers `RUNNER_DONE <exit status>` on its stdout. The tests pay SGLang's import
(torch, transformers) once per module instead of once per client run.

SGLang's client modules import `sglang.srt.disaggregation.utils` for one constant
(`FAKE_BOOTSTRAP_HOST`); that server-side module pulls in SGLang's multimodal stack and so
torchvision, which has no CPU build for torch 2.13.0+cpu on this machine (PyPI's 0.28.0 links
libc10_cuda.so). The runner puts a module holding just that constant in its place; nothing
the clients run is replaced."""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import traceback
import types

DONE = "RUNNER_DONE "
READY = "RUNNER_READY"


def _without_server_side_imports() -> None:
    name = "sglang.srt.disaggregation.utils"
    try:
        __import__(name)
    except ImportError:
        stand_in = types.ModuleType(name)
        stand_in.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # type: ignore[attr-defined]  # SGLang's value
        sys.modules[name] = stand_in


def run_command(command: str, args: list[str]) -> None:
    if command == "bench_serving":
        sys.argv = ["sglang.bench_serving", *args]
        runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
    elif command == "cache_hit":
        from sglang.test.kits.cache_hit_kit import run_multiturn_cache_hit_test

        base_url, model_dir, dataset = args[:3]
        result = run_multiturn_cache_hit_test(
            base_url,
            model_dir,
            num_clients=2,
            num_rounds=3,
            request_length=40,
            output_length=8,
            dataset_path=dataset,
            max_parallel=2,
        )
        print("CACHE_HIT_RESULT " + json.dumps(result))
    else:
        raise SystemExit(f"unknown command {command!r}")


def exit_status(command: str, args: list[str]) -> int:
    """Runs one command as its own process would end: 0, SystemExit's code, or 1 on an
    exception (its traceback printed)."""
    try:
        run_command(command, args)
    except SystemExit as done:
        code = done.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - reported like an uncaught exception, then the next one
        traceback.print_exc()
        return 1
    return 0


def serve() -> None:
    from sglang.benchmark import serving  # noqa: F401 - the imports every command needs
    from sglang.test.kits import cache_hit_kit  # noqa: F401

    print(READY, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        command, *args = request["argv"]
        with (
            open(request["out"], "w") as out,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(out),
        ):
            status = exit_status(command, args)
        sys.argv = [sys.argv[0]]
        print(f"{DONE}{status}", flush=True)


def _without_tests_dir_on_path() -> None:
    """Run as a script, this file's directory (tests/) comes first on sys.path, and there
    tests/kernels shadows `kernels`, the Hugging Face package that transformers (5.25 on)
    imports when it finds one: SGLang's client imports then fail. The runner needs only the
    repository root (PYTHONPATH)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]


def main() -> None:
    _without_tests_dir_on_path()
    _without_server_side_imports()
    command, args = sys.argv[1], sys.argv[2:]
    if command == "serve":
        serve()
    else:
        run_command(command, args)


if __name__ == "__main__":
    main()
