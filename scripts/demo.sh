#!/usr/bin/env bash
# Sets up ./.venv (scripts/setup.sh), then runs the main job: a local serving stack on the
# `small` preset and a multi-turn replay against it, with a summary. Extra args go to `pdcache demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_TCP_BIND_ADDRESS=127.0.0.1 MC_LOG_LEVEL=ERROR
exec .venv/bin/pdcache demo "$@"
