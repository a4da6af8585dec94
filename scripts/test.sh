#!/usr/bin/env bash
# Set up the environment (first run only) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
VENV="${LATENTFORGE_VENV:-$ROOT/.venv}"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
