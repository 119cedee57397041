#!/usr/bin/env bash
# Run a command inside the project's environment, creating it first if it is missing.
#
#   bash scripts/env.sh python scripts/pretrain.py      # the main job
#   bash scripts/env.sh python -m pytest -q -n 2 --dist loadgroup   # the tests
#   bash scripts/env.sh --which-lock                    # print the lock it would use, do nothing
#
# The environment is .venv/ (override with NEMO_SSA_VENV). It is built from a fully pinned
# lock with --no-deps, so the resolver never runs and the three resolver traps (new
# leptonai/ray, huggingface-hub 2.x through datasets, fastapi/starlette through
# prometheus-fastapi-instrumentator) cannot fire. Which lock:
#   - a CUDA machine (nvidia-smi -L lists a GPU, or /dev/nvidiactl or
#     /proc/driver/nvidia/version exists): requirements/gpu-py3XX.lock for the Python the
#     environment runs (torch 2.11.0 CUDA 13.0 build + triton 3.6.0, what the kernels
#     were tested on);
#   - otherwise: requirements/cpu-py311.lock (torch 2.13.0 CPU).
# Force one with NEMO_SSA_LOCK=cpu | gpu | <path to a lock file>. One line on stderr says
# which lock was chosen and why. A stamp file holds the hash of the chosen lock's content
# and pyproject.toml: change either, or switch to another lock, and the next call
# reinstalls; otherwise the environment is reused as is.
#
# For tests of the choice: NEMO_SSA_FAKE_CUDA=1|0 replaces the probe; NEMO_SSA_CUDA_FILES
# (default "/dev/nvidiactl /proc/driver/nvidia/version") lists the files the probe checks.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${NEMO_SSA_VENV:-$root/.venv}"
py="${NEMO_SSA_PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

# Is this a CUDA machine? Sets cuda_why; returns 0 for yes.
cuda_probe() {
    case "${NEMO_SSA_FAKE_CUDA:-}" in
        1) cuda_why="NEMO_SSA_FAKE_CUDA=1"; return 0 ;;
        0) cuda_why="NEMO_SSA_FAKE_CUDA=0"; return 1 ;;
    esac
    local f
    for f in ${NEMO_SSA_CUDA_FILES-/dev/nvidiactl /proc/driver/nvidia/version}; do
        [ -e "$f" ] && { cuda_why="$f exists"; return 0; }
    done
    if command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi -L >/dev/null 2>&1; then
        cuda_why="nvidia-smi -L lists a GPU"; return 0
    fi
    cuda_why="nvidia-smi -L lists no GPU, none of ${NEMO_SSA_CUDA_FILES-/dev/nvidiactl /proc/driver/nvidia/version} exists"
    return 1
}

# The GPU lock for the Python the environment runs: the venv's if it exists, else $py.
gpu_lock() {
    local p="$py" v have
    [ -x "$venv/bin/python" ] && p="$venv/bin/python"
    v="$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
        || { echo "[env] cannot run $p to read its version" >&2; exit 1; }
    lock="$root/requirements/gpu-py${v/./}.lock"
    if [ ! -f "$lock" ]; then
        have="$(cd "$root/requirements" && ls gpu-py*.lock 2>/dev/null | paste -sd' ')"
        echo "[env] no GPU lock for Python $v ($p): requirements/$(basename "$lock") does not exist;" \
             "GPU locks: ${have:-none}. Use one of those Pythons (NEMO_SSA_PYTHON=python3.X," \
             "with a fresh NEMO_SSA_VENV), or NEMO_SSA_LOCK=cpu." >&2
        exit 1
    fi
    why="$why; Python $v"
}

# Sets lock (absolute path) and why.
case "${NEMO_SSA_LOCK:-}" in
    "")  if cuda_probe; then why="CUDA machine: $cuda_why"; gpu_lock
         else lock="$root/requirements/cpu-py311.lock"; why="no CUDA: $cuda_why"; fi ;;
    cpu) lock="$root/requirements/cpu-py311.lock"; why="NEMO_SSA_LOCK=cpu" ;;
    gpu) why="NEMO_SSA_LOCK=gpu"; gpu_lock ;;
    *)   [ -f "$NEMO_SSA_LOCK" ] || { echo "[env] NEMO_SSA_LOCK=$NEMO_SSA_LOCK is not cpu, gpu or an existing lock file" >&2; exit 1; }
         lock="$(cd "$(dirname "$NEMO_SSA_LOCK")" && pwd)/$(basename "$NEMO_SSA_LOCK")"
         why="NEMO_SSA_LOCK=$NEMO_SSA_LOCK" ;;
esac
echo "[env] lock ${lock#"$root"/} ($why)" >&2
if [ "${1:-}" = "--which-lock" ]; then echo "$lock"; exit 0; fi

# The hash covers the lock's content, so it also tells the locks apart (cpu and gpu locks
# differ); the lock's name goes beside it for people.
want="$(cat "$lock" "$root/pyproject.toml" "$root"/requirements/overlays/*.txt "$root"/requirements/sources/*.txt \
    | sha256sum | cut -d' ' -f1)"
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
    # Overlays: requirements/overlays/NAME.txt -> $venv/overlays/NAME (pip --target, no
    # deps). A test that must also pass against another version (numpy 2, say) puts the
    # overlay first on PYTHONPATH of a subprocess; the environment itself is unchanged.
    rm -rf "$venv/overlays"
    for ov in "$root"/requirements/overlays/*.txt; do
        [ -f "$ov" ] || continue
        name="$(basename "$ov" .txt)"
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: \
            --target "$venv/overlays/$name" -r "$ov" 2>&1 | grep -v "^WARNING: Location" >&2 || true
        [ -n "$(ls -A "$venv/overlays/$name" 2>/dev/null)" ] \
            || { echo "[env] overlay $name ($ov) failed to install" >&2; exit 1; }
    done
    # Sources: requirements/sources/*.txt -> $venv/sources/<name>-<version>/ (the wheels'
    # megatron/*.py, for tests that read other versions' source; never on sys.path). Wheels
    # for Python 3.12 on x86_64, pinned by hash, whatever this machine runs: the source is the same.
    rm -rf "$venv/sources"
    for src in "$root"/requirements/sources/*.txt; do
        [ -f "$src" ] || continue
        wheels="$(mktemp -d)"
        # one pip call per line: several versions of one package in one call do not resolve
        grep -v '^[[:space:]]*\(#\|$\)' "$src" | while IFS= read -r req; do
            echo "$req" > "$wheels/req.txt"
            "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
                --python-version 3.12 --platform manylinux_2_28_x86_64 --require-hashes -d "$wheels" \
                -r "$wheels/req.txt" 2>&1 | grep -v "^WARNING: Location" >&2 || true
        done
        "$venv/bin/python" "$root/scripts/unpack_sources.py" "$wheels" "$venv/sources" \
            || { rm -rf "$wheels"; echo "[env] sources $src failed to download or unpack" >&2; exit 1; }
        rm -rf "$wheels"
        for v in $(sed -n 's/^\([A-Za-z0-9_.-]*\)==\([^ ]*\).*/\1-\2/p' "$src"); do
            [ -d "$venv/sources/$v" ] || { echo "[env] sources: $v from $src is missing (download failed)" >&2; exit 1; }
        done
    done
    echo "$want" > "$stamp"
    echo "$lock" > "$venv/.nemo-ssa-lock"
    echo "[env] ready in $(( $(date +%s) - start )) s" >&2
fi
# CI's row on Python 3.13 + megatron-core 0.19.2 (tests/test_py313_row.py): a Debian trixie
# root, built when NEMO_SSA_PY313=1 (.ci/run sets it; 5.5 GB, about 2 minutes)
if [ "${NEMO_SSA_PY313:-}" = 1 ]; then
    bash "$root/scripts/py313_root.sh" "$venv/py313-root"
fi
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
cd "$root"
exec "$@"
