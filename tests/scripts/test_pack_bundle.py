"""scripts/device/pack_bundle.py: the packed bundle holds every wheel with the same members
and bytes (pip installs it as before), smaller than the wheels; and the copy is made from the
source member's own compression (reading after changing it fails the CRC check: the bug the
first hand-made bundle had)."""

from __future__ import annotations

import os
import random
import sys
import tarfile
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "device"))

import pack_bundle  # noqa: E402


def _wheel(path, files):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)


def test_packed_wheels_keep_every_member_and_shrink(tmp_path):
    rng = random.Random(0)
    src = tmp_path / "whl"
    src.mkdir()
    words = ["def", "return", "self", "import", "torch", "tensor", "class", "None", "x", "=", "(", ")"]
    wheels = {}
    for i in range(3):
        files = {f"pkg{i}/m{j}.py": " ".join(rng.choice(words) for _ in range(4000)).encode() for j in range(5)}
        files[f"pkg{i}-1.0.dist-info/RECORD"] = b"pkg/m0.py,,\n"
        files[f"pkg{i}/blob.bin"] = bytes(rng.getrandbits(8) for _ in range(3000))
        wheels[f"pkg{i}-1.0-py3-none-any.whl"] = files
        _wheel(src / f"pkg{i}-1.0-py3-none-any.whl", files)
    bundle = tmp_path / "b" / "bundle.tar.xz"
    assert pack_bundle.main(["--src", str(src), "--out", str(bundle)]) == 0
    assert bundle.stat().st_size < sum(p.stat().st_size for p in src.iterdir())
    out = tmp_path / "out"
    with tarfile.open(bundle) as t:
        t.extractall(out)
    assert sorted(os.listdir(out)) == sorted(wheels)
    for name, files in wheels.items():
        with zipfile.ZipFile(out / name) as z:
            assert z.testzip() is None
            assert {i.filename: z.read(i.filename) for i in z.infolist()} == files
            assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())


def test_no_wheels_is_a_clear_error(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="no wheels in"):
        pack_bundle.main(["--src", str(tmp_path), "--out", str(tmp_path / "b.tar.xz")])
