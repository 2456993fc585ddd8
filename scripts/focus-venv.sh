#!/usr/bin/env bash
# The FinOps FOCUS reference validator in its own venv: focus-validator 1.0.0 (the newest on the
# package index) pins old pandas/pandera and needs multimethod<1.11, which the project's own
# environment must not inherit. Idempotent.
set -euo pipefail
venv="${1:-.venv-focus}"
python="${PYTHON:-python3}"
if [ -x "$venv/bin/focus-validator" ]; then
    exit 0
fi
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "focus-validator==1.0.0" "multimethod<1.11"
"$venv/bin/focus-validator" --supported-versions >/dev/null
