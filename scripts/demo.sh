#!/usr/bin/env bash
# Set up the environment (first run only) and run the end-to-end demo on the built-in dataset.
# Extra arguments go to `latentforge demo` (e.g. --out DIR, or overrides like synth.num=500).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
VENV="${LATENTFORGE_VENV:-$ROOT/.venv}"
cd "$ROOT"
exec "$VENV/bin/latentforge" demo "$@"
