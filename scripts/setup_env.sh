#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install everything it needs.
#
# torch is installed first and explicitly, because a bare `torch` requirement pulls a multi-GB
# CUDA build even on machines without a GPU:
#   - a machine with an NVIDIA GPU (nvidia-smi works) gets the default CUDA build of torch;
#   - a machine without one gets `torch==$TORCH_VERSION` from the index pip is configured with
#     (on the latentforge dev/CI machines that resolves to a CPU wheel on local disk); set
#     LATENTFORGE_TORCH_INDEX to a CPU wheel index to get a CPU build elsewhere.
# The environment is reused while pyproject.toml and this script are unchanged.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LATENTFORGE_VENV:-$ROOT/.venv}"
TORCH_VERSION="${LATENTFORGE_TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-python3}"

stamp_now="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.latentforge-stamp" 2>/dev/null)" = "$stamp_now" ]; then
  exit 0
fi

echo "[setup] creating virtual environment in $VENV" >&2
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# pip's output minus the noise of this machine's local-index warnings; fails when pip fails (pipefail).
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; } >&2; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] NVIDIA GPU found: installing the CUDA build of torch==$TORCH_VERSION" >&2
  quiet "${PIP[@]}" install "torch==$TORCH_VERSION"
elif [ -n "${LATENTFORGE_TORCH_INDEX:-}" ]; then
  echo "[setup] no GPU: installing torch==$TORCH_VERSION from $LATENTFORGE_TORCH_INDEX" >&2
  quiet "${PIP[@]}" install "torch==$TORCH_VERSION" --index-url "$LATENTFORGE_TORCH_INDEX"
else
  echo "[setup] no GPU: installing torch==$TORCH_VERSION" >&2
  quiet "${PIP[@]}" install "torch==$TORCH_VERSION"
fi
echo "[setup] installing latentforge and its dependencies" >&2
quiet "${PIP[@]}" install -e "$ROOT[test,report,demo]"
"$VENV/bin/python" -m pip check >&2
echo "$stamp_now" > "$VENV/.latentforge-stamp"
