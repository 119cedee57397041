"""Pack the offline wheel bundle (``.whl/``) small enough to travel with a device call.

A device call carries the tracked tree and the named paths up to 64 MiB. The wheels are zip
files compressed member by member (deflate), which leaves the Python sources in them about
twice the size xz makes of them; the tree plus ``.whl/`` crossed the limit (2026-11-28). This
writes every wheel again with its members *stored* (same names, bytes and metadata: a valid
wheel, pip installs it as before) into one tar compressed with xz: 46 MB of wheels -> 25 MB.

    python scripts/device/pack_bundle.py                   # .whl/ -> .bundle/bundle.tar.xz
    # on the device (carry [".bundle"]):
    mkdir -p /tmp/w && tar -C /tmp/w -xJf .bundle/bundle.tar.xz && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/w/*.whl && export PYTHONPATH=/tmp/site

``scripts/device/gpu_session.py`` installs ``.bundle/bundle.tar.xz`` the same way when there is
no ``.whl/``.
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALL = ("mkdir -p /tmp/w && tar -C /tmp/w -xJf {bundle} && python3 -m pip install -q --no-index --no-deps "
           "--no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/w/*.whl && export PYTHONPATH=/tmp/site")


def stored_copy(src: str, dst: str) -> None:
    """``src`` rewritten with every member stored (not deflated); names, bytes, dates kept."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)  # before the copy's compress_type changes
            out = copy.copy(info)
            out.compress_type = zipfile.ZIP_STORED
            zout.writestr(out, data)


def pack(src_dir: str, bundle: str, threads: int = 0) -> int:
    wheels = sorted(glob.glob(os.path.join(src_dir, "*.whl")))
    if not wheels:
        raise SystemExit(f"[pack_bundle] no wheels in {src_dir} (build them: bash scripts/build_offline_bundle.sh)")
    os.makedirs(os.path.dirname(os.path.abspath(bundle)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="pack_bundle_")
    try:
        for w in wheels:
            stored_copy(w, os.path.join(tmp, os.path.basename(w)))
        part = bundle + ".part"
        xz = shutil.which("xz")
        if xz:  # multi-threaded; the same format as lzma's
            with open(part, "wb") as f:
                tar = subprocess.Popen(["tar", "-C", tmp, "-cf", "-", *sorted(os.listdir(tmp))], stdout=subprocess.PIPE)
                rc = subprocess.run([xz, "-9", f"-T{threads}", "-c"], stdin=tar.stdout, stdout=f).returncode
                if tar.wait() or rc:
                    raise SystemExit(f"[pack_bundle] tar | xz failed (tar rc {tar.returncode}, xz rc {rc})")
        else:
            with tarfile.open(part, "w:xz", preset=9) as t:
                for name in sorted(os.listdir(tmp)):
                    t.add(os.path.join(tmp, name), arcname=name)
        os.replace(part, bundle)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return len(wheels)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=os.path.join(REPO, ".whl"))
    ap.add_argument("--out", default=os.path.join(REPO, ".bundle", "bundle.tar.xz"))
    ap.add_argument("--threads", type=int, default=0, help="xz threads (0: one per core)")
    args = ap.parse_args(argv)
    before = sum(os.path.getsize(w) for w in glob.glob(os.path.join(args.src, "*.whl")))
    n = pack(args.src, args.out, args.threads)
    after = os.path.getsize(args.out)
    print(f"[pack_bundle] {n} wheels, {before / 2**20:.1f} MiB -> {args.out} {after / 2**20:.1f} MiB")
    rel = os.path.relpath(args.out, REPO)
    print(f"[pack_bundle] carry [\"{os.path.dirname(rel)}\"]; on the device: {INSTALL.format(bundle=rel)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
