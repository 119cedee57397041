#!/usr/bin/env bash
# Build (or reuse) the Python 3.13 root of the CI row on megatron-core 0.19.2:
#
#   bash scripts/py313_root.sh ROOT        # -> ROOT/ (a Debian trixie root), ROOT/opt/v (the venv)
#
# Why a root: megatron-core >= 0.17 needs Python >= 3.12; the CI machine (Debian bookworm) has
# 3.11, and trixie's python3.13 (Debian's registry) pre-depends on glibc 2.38 (bookworm: 2.36),
# so it runs in a trixie root made by debootstrap. Needs root privileges (debootstrap, chroot;
# the tests bind-mount with unshare) and Debian's registry and PyPI. About 3 minutes and 5.5 GB
# (torch's CUDA build and its NVIDIA libraries). ROOT/.ready holds the hash of what was built,
# so a second call with the same inputs does nothing.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${1:?usage: py313_root.sh ROOT}"
reqs="$repo/requirements/py313-mcore019.txt"
want="$( (cat "$reqs" "$0"; echo trixie) | sha256sum | cut -d' ' -f1)"
if [ -f "$root/.ready" ] && [ "$(cat "$root/.ready")" = "$want" ]; then
    echo "[py313] $root is ready" >&2
    exit 0
fi
[ "$(id -u)" = 0 ] || { echo "[py313] needs root privileges (debootstrap, chroot)" >&2; exit 1; }
start=$(date +%s)
command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
rm -rf "$root"
echo "[py313] debootstrap trixie -> $root" >&2
debootstrap --variant=minbase --include=python3.13,python3.13-venv,libpython3.13-dev,g++,ca-certificates \
    trixie "$root" http://deb.debian.org/debian >"$root.debootstrap.log" 2>&1 \
    || { tail -20 "$root.debootstrap.log" >&2; echo "[py313] debootstrap failed" >&2; exit 1; }
# this machine's CA bundle (PyPI through its proxy) and resolver
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
cp /etc/resolv.conf "$root/etc/resolv.conf"
cp "$reqs" "$root/requirements.txt"
echo "[py313] venv and $(basename "$reqs")" >&2
# no wheel cache: it would keep a second copy of the CUDA wheels (~3 GB) on a CI disk that runs short
chroot "$root" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 /bin/sh -c \
    "python3.13 -m venv /opt/v && /opt/v/bin/pip install -q -r /requirements.txt" >&2
chroot "$root" /opt/v/bin/python -c "import torch, triton, megatron.core, megatron.training" 2>/dev/null \
    || { echo "[py313] the venv does not import torch / megatron" >&2; exit 1; }
mkdir -p "$root/repo"
echo "$want" > "$root/.ready"
echo "[py313] ready in $(( $(date +%s) - start )) s: $(chroot "$root" /opt/v/bin/python -c \
    'import sys, torch, megatron.core as m; print(sys.version.split()[0], torch.__version__, m.__version__)' 2>/dev/null)" >&2
