"""Which lock scripts/env.sh installs, and whether the GPU locks are right (CPU only).

- The choice (``bash scripts/env.sh --which-lock``, which installs nothing): no CUDA ->
  the CPU lock; a CUDA machine (``nvidia-smi -L`` succeeds, or one of the driver files
  exists) -> ``gpu-py3XX.lock`` for the environment's Python; ``NEMO_SSA_LOCK`` forces
  cpu / gpu / a path; a bad value or a Python without a GPU lock fails in one clear line.
  The probe runs for real against a fake ``nvidia-smi`` first on PATH and a fake list of
  driver files, so these tests give the same answers on a GPU machine.
- The stamp: a matching stamp reuses the environment; switching locks reinstalls.
- The GPU locks' content: every line ``name==version``; torch / triton / CUDA major are
  those of the tested GPU image (read from docs/offline-bundle.md); the difference from
  the CPU lock is exactly the listed set, so drift on either side fails.
- Resolution (network, ~1 min per lock): ``pip install --dry-run --ignore-installed``
  WITH dependency resolution resolves each GPU lock to exactly its pins. Skipped, with
  the reason, when the package registry is not reachable or ``NEMO_SSA_OFFLINE=1``.
- Install and import (network, ~1.5 min, ~6 GB in a throwaway venv): README's command with
  ``NEMO_SSA_LOCK=gpu`` installs the CUDA build of torch 2.11.0 and everything imports
  without a GPU (torch reports 2.11.0+cu130, CUDA 13.0, no device). Skipped, naming the
  free space, on a disk with less than GPU_VENV_GIB free (pip fails mid-install there).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV_SH = REPO / "scripts" / "env.sh"
REQ = REPO / "requirements"
CPU_LOCK = REQ / "cpu-py311.lock"
GPU_LOCKS = {"3.11": REQ / "gpu-py311.lock", "3.12": REQ / "gpu-py312.lock"}
OFFLINE_DOC = REPO / "docs" / "offline-bundle.md"

# What the GPU locks change against the CPU lock. Anything else that differs is drift.
CHANGED = {"torch": ("2.13.0", "2.11.0")}  # the tested GPU image's torch (CUDA 13.0 build)
ADDED = {
    # torch 2.11.0's Linux requirements: cuda-toolkit[...]==13.0.2 and the wheels it pins,
    # plus cudnn / cusparselt / nccl / nvshmem pinned by torch itself
    "cuda-toolkit", "nvidia-cublas", "nvidia-cuda-cupti", "nvidia-cuda-nvrtc",
    "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cufft", "nvidia-cufile",
    "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-cusparselt-cu13",
    "nvidia-nccl-cu13", "nvidia-nvjitlink", "nvidia-nvshmem-cu13", "nvidia-nvtx",
    # torch 2.11 wants setuptools<82, nemo_toolkit >=70; a 3.12 venv has none at all (and
    # the editable install of nemo_ssa runs --no-build-isolation)
    "setuptools",
    # NeMo's checkpoint callback on the GPU path (docs/offline-bundle.md), and its deps
    "nvidia-resiliency-ext", "defusedxml", "pynvml",
}
# Installed with --no-deps on purpose (their declared deps pull ray and a new leptonai):
# left out of the with-dependencies resolution, present in every lock.
NO_DEPS = {"leptonai", "nemo-run"}

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!]+)$")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = PIN.match(line.strip())
        assert m, f"{path.name}: not name==version: {line!r}"
        assert norm(m[1]) not in out, f"{path.name}: {m[1]} twice"
        out[norm(m[1])] = m[2]
    return out


def tested_image() -> dict[str, str]:
    """torch / triton / CUDA of the GPU image the kernels were tested on, as the docs state."""
    m = re.search(r"torch (\d[\w.]*)\+cu(\d+)(\d), triton (\d[\w.]*)", OFFLINE_DOC.read_text())
    assert m, "docs/offline-bundle.md no longer states the image's torch+cuXXX, triton"
    return {"torch": m[1], "cuda": f"{m[2]}.{m[3]}", "triton": m[4]}


# --- the choice ------------------------------------------------------------------------


def fake_python(path: Path, version: str) -> Path:
    """A 'python' that prints its version for env.sh's probe and fails at anything else."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *version_info*) echo {version}; exit 0;; esac\n'
        'echo "fake python: $*" >&2; exit 3\n'
    )
    path.chmod(0o755)
    return path


@pytest.fixture
def run(tmp_path):
    """env.sh with a controlled probe: a fake nvidia-smi (failing unless `smi=0`), driver
    files under tmp_path, a fake Python 3.11 and a venv path that does not exist."""
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    py311 = fake_python(tmp_path / "py" / "python", "3.11")

    def _run(*args, smi=9, files=(), cwd=REPO, **env):
        (fakebin / "nvidia-smi").write_text(f"#!/bin/sh\nexit {smi}\n")
        (fakebin / "nvidia-smi").chmod(0o755)
        base = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_SSA_")}
        base["PATH"] = f"{fakebin}:{base['PATH']}"
        base["NEMO_SSA_CUDA_FILES"] = " ".join(str(f) for f in files) or str(tmp_path / "no-such-driver-file")
        base.setdefault("NEMO_SSA_VENV", str(tmp_path / "venv"))
        base.setdefault("NEMO_SSA_PYTHON", str(py311))
        base.update(env)
        return subprocess.run(["bash", str(ENV_SH), *(args or ["--which-lock"])], cwd=cwd,
                              env=base, capture_output=True, text=True, timeout=60)

    return _run


def chose(res) -> Path:
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("[env] lock ") == 1, res.stderr  # one line says which and why
    return Path(res.stdout.strip())


def test_no_cuda_picks_cpu_lock(run, tmp_path):
    res = run()
    assert chose(res) == CPU_LOCK
    assert "no CUDA" in res.stderr
    assert not (tmp_path / "venv").exists()  # --which-lock installs nothing


def test_nvidia_smi_picks_gpu_lock(run):
    res = run(smi=0)
    assert chose(res) == GPU_LOCKS["3.11"]
    assert "nvidia-smi -L lists a GPU" in res.stderr and "Python 3.11" in res.stderr


def test_driver_file_picks_gpu_lock(run, tmp_path):
    ctl = tmp_path / "nvidiactl"
    ctl.touch()
    res = run(files=[tmp_path / "missing", ctl])
    assert chose(res) == GPU_LOCKS["3.11"]
    assert f"{ctl} exists" in res.stderr


def test_gpu_lock_follows_the_pythons_minor_version(run, tmp_path):
    py312 = fake_python(tmp_path / "py312" / "python", "3.12")
    assert chose(run(smi=0, NEMO_SSA_PYTHON=str(py312))) == GPU_LOCKS["3.12"]
    # an existing environment's own Python decides, not NEMO_SSA_PYTHON
    venv = tmp_path / "old-venv"
    fake_python(venv / "bin" / "python", "3.12")
    assert chose(run(smi=0, NEMO_SSA_VENV=str(venv))) == GPU_LOCKS["3.12"]


def test_fake_cuda_overrides_the_probe(run, tmp_path):
    assert chose(run(NEMO_SSA_FAKE_CUDA="1")) == GPU_LOCKS["3.11"]
    ctl = tmp_path / "nvidiactl"
    ctl.touch()
    assert chose(run(smi=0, files=[ctl], NEMO_SSA_FAKE_CUDA="0")) == CPU_LOCK


def test_nemo_ssa_lock_forces(run, tmp_path):
    res = run(smi=0, NEMO_SSA_LOCK="cpu")
    assert chose(res) == CPU_LOCK and "NEMO_SSA_LOCK=cpu" in res.stderr
    res = run(NEMO_SSA_LOCK="gpu")
    assert chose(res) == GPU_LOCKS["3.11"] and "NEMO_SSA_LOCK=gpu" in res.stderr
    own = tmp_path / "mine.lock"
    own.write_text("torch==2.11.0\n")
    assert chose(run(NEMO_SSA_LOCK="mine.lock", cwd=tmp_path)) == own  # relative to the caller


def test_bad_nemo_ssa_lock_fails_clearly(run):
    res = run(NEMO_SSA_LOCK="cuda")
    assert res.returncode != 0 and res.stdout == ""
    assert "NEMO_SSA_LOCK=cuda is not cpu, gpu or an existing lock file" in res.stderr


def test_python_without_gpu_lock_fails_naming_the_ones_that_exist(run, tmp_path):
    py310 = fake_python(tmp_path / "py310" / "python", "3.10")
    res = run(smi=0, NEMO_SSA_PYTHON=str(py310))
    assert res.returncode != 0 and res.stdout == ""
    assert "no GPU lock for Python 3.10" in res.stderr
    for lock in GPU_LOCKS.values():
        assert lock.name in res.stderr
    assert "NEMO_SSA_LOCK=cpu" in res.stderr


def _stamped_venv(tmp_path: Path, lock: Path) -> Path:
    venv = tmp_path / "stamped"
    fake_python(venv / "bin" / "python", "3.11")
    overlays = " ".join(f"'{p}'" for sub in ("overlays", "sources")
                        for p in sorted((REPO / "requirements" / sub).glob("*.txt")))
    digest = subprocess.run(f"cat '{lock}' '{REPO / 'pyproject.toml'}' {overlays} | sha256sum",
                            shell=True, capture_output=True, text=True, check=True).stdout.split()[0]
    (venv / ".nemo-ssa-stamp").write_text(digest + "\n")
    return venv


def test_matching_stamp_reuses_the_environment(run, tmp_path):
    venv = _stamped_venv(tmp_path, CPU_LOCK)
    res = run("echo", "ran", NEMO_SSA_VENV=str(venv))
    assert res.returncode == 0 and res.stdout == "ran\n", res.stderr
    assert "creating" not in res.stderr


def test_switching_lock_reinstalls(run, tmp_path):
    # a CPU-lock environment on a CUDA machine: the stamp no longer matches, env.sh
    # reinstalls from the GPU lock (the fake python fails pip, so it stops there)
    venv = _stamped_venv(tmp_path, CPU_LOCK)
    res = run("echo", "ran", smi=0, NEMO_SSA_VENV=str(venv))
    assert res.returncode != 0 and "ran" not in res.stdout
    assert "creating" in res.stderr and "from gpu-py311.lock" in res.stderr
    assert f"install from {GPU_LOCKS['3.11']} failed" in res.stderr


# --- the GPU locks' content --------------------------------------------------------------


@pytest.mark.parametrize("py", sorted(GPU_LOCKS))
def test_gpu_lock_is_the_tested_image_stack(py):
    gpu, image = pins(GPU_LOCKS[py]), tested_image()
    assert gpu["torch"] == image["torch"] == "2.11.0"
    assert gpu["triton"] == image["triton"] == "3.6.0"
    # PyPI's Linux torch 2.11.0 is the CUDA 13.0 build: its cuda-toolkit pin says so
    assert gpu["cuda-toolkit"].startswith(image["cuda"] + "."), (gpu["cuda-toolkit"], image["cuda"])
    assert all(n.endswith("-cu13") or not n.endswith(("-cu12", "-cu11")) for n in gpu)
    head = GPU_LOCKS[py].read_text().split("\n\n")[0]
    assert f"Python {py}" in head and "torch 2.11.0" in head and "triton 3.6.0" in head


@pytest.mark.parametrize("py", sorted(GPU_LOCKS))
def test_gpu_lock_differs_from_cpu_lock_only_as_listed(py):
    cpu, gpu = pins(CPU_LOCK), pins(GPU_LOCKS[py])
    assert set(gpu) - set(cpu) == ADDED
    assert set(cpu) - set(gpu) == set()
    changed = {n: (cpu[n], gpu[n]) for n in cpu if cpu[n] != gpu[n]}
    assert changed == CHANGED


def test_gpu_locks_agree_with_each_other_and_the_bundle():
    assert pins(GPU_LOCKS["3.11"]) == pins(GPU_LOCKS["3.12"])  # one set resolves on both
    # gpu-bundle.txt lines may carry "# image-has:" notes: strip them before parsing
    bundle = {}
    for line in (REQ / "gpu-bundle.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, ver = line.split("==")
            bundle[norm(name)] = ver
    gpu = pins(GPU_LOCKS["3.11"])
    assert {n: bundle[n] for n in bundle if n in gpu and bundle[n] != gpu[n]} == {}
    assert {"nvidia-resiliency-ext", "defusedxml"} <= set(bundle)


def test_pin_parser_rejects_what_it_must(tmp_path):
    bad = tmp_path / "bad.lock"
    for text in ("torch>=2.11\n", "torch==2.11.0\nTorch==2.11.0\n", "torch\n"):
        bad.write_text(text)
        with pytest.raises(AssertionError):
            pins(bad)


# --- resolution against the package registry ---------------------------------------------


def _python_for(version: str) -> str | None:
    """An interpreter of that minor version with pip, or None."""
    cands = [sys.executable] + [shutil.which(f"python{version}") or ""]
    cands += sorted(str(p) for p in Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))
    for c in cands:
        if not c:
            continue
        r = subprocess.run([c, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == version:
            return c
    return None


@pytest.fixture(scope="module")
def registry():
    if os.environ.get("NEMO_SSA_OFFLINE") == "1":
        pytest.skip("NEMO_SSA_OFFLINE=1")
    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch", "--retries", "0",
                        "--timeout", "15"], capture_output=True, text=True, timeout=120)
    if not re.search(r"\b2\.11\.0\b", r.stdout):
        pytest.skip("package registry not reachable (pip index versions torch lists no 2.11.0): "
                    + ([x for x in r.stderr.splitlines() if x.strip() and not x.startswith("WARNING")]
                       or ["no error message"])[-1][:200])


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.parametrize("py", sorted(GPU_LOCKS))
def test_gpu_lock_resolves_to_exactly_its_pins(py, registry, tmp_path):
    python = _python_for(py)
    if python is None:
        pytest.skip(f"no Python {py} with pip on this machine")
    want = {n: v for n, v in pins(GPU_LOCKS[py]).items() if n not in NO_DEPS}
    req = tmp_path / "req.txt"
    req.write_text("".join(f"{n}=={v}\n" for n, v in want.items()))
    t0 = time.time()
    r = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                        "--no-cache-dir", "--quiet", "--report", str(tmp_path / "r.json"),
                        "-r", str(req)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {norm(i["metadata"]["name"]): i["metadata"]["version"]
           for i in json.loads((tmp_path / "r.json").read_text())["install"]}
    assert got == want, {"extra": {n: got[n] for n in set(got) - set(want)},
                         "missing": sorted(set(want) - set(got)),
                         "other version": {n: (want[n], got[n]) for n in set(got) & set(want) if got[n] != want[n]}}
    print(f"resolved {len(got)} pins for Python {py} in {time.time() - t0:.0f} s")


# what the GPU lock's venv needs on disk, with a margin (measured: ~6 GB installed)
GPU_VENV_GIB = 10

IMPORT_CHECK = """
import torch, triton, megatron.core, nemo.collections.llm, nvidia_resiliency_ext, nemo_ssa
from recipes import nemotron_114m
print("GPU-LOCK-ENV", torch.__version__, torch.version.cuda, torch.cuda.is_available(),
      triton.__version__, torch.backends.cudnn.version())
"""


@pytest.mark.network
@pytest.mark.slow
def test_gpu_lock_installs_and_imports_without_a_gpu(registry, tmp_path):
    """README's first command with the GPU lock forced, into a throwaway venv (~6 GB,
    ~1.5 min here): the CUDA build of torch installs and imports on a CPU machine."""
    if sys.version_info[:2] != (3, 11):
        pytest.skip("checked with the CI Python 3.11 (gpu-py311.lock)")
    # The venv takes ~6 GB; CI machines have been seen with anywhere from 287 MB to 80 GB
    # free, and a full disk fails pip mid-install (ENOSPC, then a Bus error on import) --
    # a fact about the machine, not about the lock.
    free = shutil.disk_usage(tmp_path).free / 2**30
    if free < GPU_VENV_GIB:
        pytest.skip(f"the GPU venv needs ~{GPU_VENV_GIB} GiB free, {tmp_path.anchor} has {free:.1f} GiB")
    venv = tmp_path / "gpu-venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_SSA_")}
    # no wheel cache: it would hold another ~3 GB of the same CUDA wheels beside the venv
    env["PIP_NO_CACHE_DIR"] = "1"
    # megatron-core 0.15.3 JIT-builds a CUDA allocator when imported under a CUDA build
    # of torch; with no GPU visible and no arch list, torch's arch detection raises
    # IndexError (not caught there). An arch list makes it fail the build and go on.
    env.update(NEMO_SSA_LOCK="gpu", NEMO_SSA_VENV=str(venv), TORCH_CUDA_ARCH_LIST="9.0")
    try:
        t0 = time.time()
        r = subprocess.run(["bash", str(ENV_SH), "python", "-W", "ignore", "-c", IMPORT_CHECK],
                           env=env, capture_output=True, text=True, timeout=900, cwd="/")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "[env] lock requirements/gpu-py311.lock (NEMO_SSA_LOCK=gpu; Python 3.11)" in r.stderr
        line = next(x for x in r.stdout.splitlines() if x.startswith("GPU-LOCK-ENV")).split()
        image = tested_image()
        assert line[1] == f"{image['torch']}+cu{image['cuda'].replace('.', '')}"  # 2.11.0+cu130
        assert line[2] == image["cuda"] and line[3] == "False" and line[4] == image["triton"]
        assert (venv / ".nemo-ssa-lock").read_text().strip() == str(GPU_LOCKS["3.11"])
        print(f"GPU lock installed and imported in {time.time() - t0:.0f} s: {' '.join(line[1:])}")
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # ~6 GB: pytest keeps old tmp dirs
