#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install everything it needs.
#
# torch and torchvision are installed first, explicitly and as a matching pair, because a bare
# `torch` requirement pulls a multi-GB CUDA build even on machines without a GPU, and a
# torchvision that does not match the torch build fails on import (`torchvision::nms does not
# exist`). torchvision is needed by the evaluation's FID/KID (torchmetrics + torch-fidelity).
#   - a machine with an NVIDIA GPU (nvidia-smi works) gets the default CUDA build of the pair;
#   - a machine without one gets `torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION` from the
#     index pip is configured with (on the latentforge dev/CI machines: wheels on local disk, a
#     CUDA build that runs on the CPU, because no CPU build of a torch that has a matching
#     torchvision is at hand there); set LATENTFORGE_TORCH_INDEX to a CPU wheel index
#     (https://download.pytorch.org/whl/cpu) to get the CPU build of the pair elsewhere.
# The environment is reused while pyproject.toml and this script are unchanged.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LATENTFORGE_VENV:-$ROOT/.venv}"
TORCH_VERSION="${LATENTFORGE_TORCH_VERSION:-2.14.1}"
TORCHVISION_VERSION="${LATENTFORGE_TORCHVISION_VERSION:-0.29.1}"
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
  echo "[setup] NVIDIA GPU found: installing the CUDA build of torch==$TORCH_VERSION + torchvision==$TORCHVISION_VERSION" >&2
  quiet "${PIP[@]}" install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
elif [ -n "${LATENTFORGE_TORCH_INDEX:-}" ]; then
  echo "[setup] no GPU: installing torch==$TORCH_VERSION + torchvision==$TORCHVISION_VERSION from $LATENTFORGE_TORCH_INDEX" >&2
  quiet "${PIP[@]}" install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" --index-url "$LATENTFORGE_TORCH_INDEX"
else
  echo "[setup] no GPU: installing torch==$TORCH_VERSION + torchvision==$TORCHVISION_VERSION" >&2
  quiet "${PIP[@]}" install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi
echo "[setup] installing latentforge and its dependencies" >&2
quiet "${PIP[@]}" install -e "$ROOT[test,report,demo,eval]"
"$VENV/bin/python" -m pip check >&2
echo "$stamp_now" > "$VENV/.latentforge-stamp"
