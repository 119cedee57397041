#!/usr/bin/env bash
# Run a command inside the project's environment, creating it first if it is missing.
#
#   bash scripts/env.sh python scripts/pretrain.py      # the main job
#   bash scripts/env.sh python -m pytest -q             # the tests
#
# The environment is .venv/ (override with NEMO_SSA_VENV). It is built from the fully
# pinned lock requirements/cpu-py311.lock with --no-deps, so the resolver never runs and
# the three resolver traps (new leptonai/ray, huggingface-hub 2.x through datasets,
# fastapi/starlette through prometheus-fastapi-instrumentator) cannot fire. A stamp
# file holds the hash of the lock and pyproject.toml: change either and the next call
# reinstalls; otherwise the environment is reused as is.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${NEMO_SSA_VENV:-$root/.venv}"
lock="$root/requirements/cpu-py311.lock"
py="${NEMO_SSA_PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

want="$(cat "$lock" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
stamp="$venv/.nemo-ssa-stamp"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[env] creating $venv from $(basename "$lock") (first run: a few minutes)" >&2
    start=$(date +%s)
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$lock" 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
    # pip's exit status is hidden by the filter above: check the install really happened.
    "$venv/bin/python" -c "import torch, megatron.core, nemo, triton" \
        || { echo "[env] install from $lock failed" >&2; exit 1; }
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root" 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
    # from another directory, so the check sees the installed package, not the checkout's cwd
    (cd / && "$venv/bin/python" -c "import nemo_ssa") || { echo "[env] editable install of nemo_ssa failed" >&2; exit 1; }
    echo "$want" > "$stamp"
    echo "[env] ready in $(( $(date +%s) - start )) s" >&2
fi
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
cd "$root"
exec "$@"
