"""Checks of the offline GPU bundle's inputs (CPU, no network, no pip).

requirements/gpu-bundle.txt lists what travels to the GPU image as wheels
(scripts/build_offline_bundle.sh; docs/offline-bundle.md). Here: the list is fully pinned
and has no duplicates; a package the image already holds is listed only with an
"# image-has: <reason>" note; every pin matches the CPU lock (or is an explicit,
explained exception); heavy packages that are left out on purpose stay out; the PuLP
stub imports and fails loudly on use; the build script parses.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "requirements" / "gpu-bundle.txt"
LOCK = REPO / "requirements" / "cpu-py311.lock"
SCRIPT = REPO / "scripts" / "build_offline_bundle.sh"

# Every distribution in the GPU image 'cuda' (pip list there, 2026-11-21; Python 3.12.3,
# torch 2.11.0+cu130). Normalised names.
IMAGE_PACKAGES = set("""
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio 
    attrs botorch build certifi charset-normalizer chex click cloudpickle cmake 
    colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit 
    cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock 
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py 
    hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig 
    interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib 
    kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax 
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes 
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals 
    networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti 
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile 
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py 
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir 
    onnxruntime onnxscript opencv-python-headless opt-einsum opt-einsum-fx optax 
    optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy 
    portalocker prometheus-client propcache protobuf psutil py-cpuinfo pyarrow pybind11 
    pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark 
    pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil 
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors 
    scikit-build-core scikit-image scikit-learn scipy seaborn sentence-transformers 
    sentencepiece setuptools shellingham simplejson six sortedcontainers statsmodels 
    sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl 
    tifffile tiktoken timm tokenizers toolz torch torch-geometric torchaudio 
    torchdiffeq torchmetrics torchvision tqdm transformers treescope triton typer 
    typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt 
    xarray xxhash yarl zipp
""".split())

# Pins that are not in the CPU lock, and why.
NOT_IN_LOCK = {
    # NeMo's checkpoint setup isinstance-checks nvidia_resiliency_ext's
    # LocalCheckpointCallback; the CPU machine never runs MegatronStrategy, so the lock
    # lacks it. Verified on an H200: without it llm.pretrain fails at ModelCheckpoint setup.
    "nvidia-resiliency-ext": "NeMo checkpoint callback setup on GPU",
    "defusedxml": "dependency of nvidia-resiliency-ext",
    # benchmarks/bench_nsa.py times fla's parallel_nsa beside ours; GPU only (Triton kernels)
    "fla-core": "benchmark comparison (fla's parallel_nsa) in benchmarks/bench_nsa.py",
}

# Left out on purpose (docs/offline-bundle.md): these must not creep back in.
LEFT_OUT = {
    "pulp": "16 MiB of CBC binaries; nemo_ssa/_offline_stubs/pulp stands in",
    "tensorstore": "the image has 0.1.85; only megatron's zarr checkpoints need <0.1.72",
    "protobuf": "the image's onnx/tensorboard are built against its protobuf",
    "numpy": "the image's numpy 2.5 works with megatron-core 0.15.3",
    "torch": "the image's CUDA build",
    "triton": "the image's",
    "ray": "pulled only by an unpinned leptonai",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(path: Path):
    """[(normalised name, version, comment, line number)] for every requirement line."""
    rows = []
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        body, _, comment = raw.partition("#")
        body = body.strip()
        if body:
            rows.append((body, comment.strip(), no))
    return rows


def pins(path: Path):
    out = {}
    for body, _, _ in parse(path):
        name, _, version = body.partition("==")
        out[norm(name)] = version
    return out


def test_fully_pinned_no_duplicates():
    seen = {}
    for body, _, no in parse(BUNDLE):
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)", body)
        assert m, f"gpu-bundle.txt:{no}: not name==version: {body!r}"
        n = norm(m.group(1))
        assert n not in seen, f"gpu-bundle.txt:{no}: {n} already pinned on line {seen[n]}"
        seen[n] = no
    assert len(seen) >= 20


def test_image_packages_only_with_reason():
    for body, comment, no in parse(BUNDLE):
        n = norm(body.split("==")[0])
        if n in IMAGE_PACKAGES:
            m = re.match(r"image-has:\s*(\S.*)", comment)
            assert m and len(m.group(1)) > 10, (
                f"gpu-bundle.txt:{no}: the GPU image already has {n}; ship it only with "
                f"'# image-has: <why the image's version does not do>'")
        else:
            assert not comment.startswith("image-has"), (
                f"gpu-bundle.txt:{no}: {n} is marked image-has but the image lacks it")


def test_pins_match_cpu_lock():
    lock = pins(LOCK)
    for name, version in pins(BUNDLE).items():
        if name in NOT_IN_LOCK:
            assert name not in lock, f"{name} is in the lock now: drop it from NOT_IN_LOCK"
            continue
        assert name in lock, f"{name} is neither in {LOCK.name} nor in NOT_IN_LOCK"
        assert lock[name] == version, f"{name}=={version} but {LOCK.name} pins {lock[name]}"


def test_left_out_stays_out():
    bundle = pins(BUNDLE)
    for name, why in LEFT_OUT.items():
        assert name not in bundle, f"{name} is left out on purpose ({why})"


def test_core_stack_present():
    bundle = pins(BUNDLE)
    for name, version in {"nemo-toolkit": "2.7.3", "megatron-core": "0.15.3",
                          "nemo-run": "0.11.1", "leptonai": "0.27.3",
                          "transformers": "4.57.6", "lightning": "2.4.0",
                          "nvidia-modelopt": "0.37.0"}.items():
        assert bundle.get(name) == version, f"{name}=={version} missing"


def test_build_script_parses_and_knows_the_sdists():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    r = subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = SCRIPT.read_text()
    m = re.search(r"sdist_only=\(([^)]*)\)", text)
    assert m, "sdist_only=(...) not found in the build script"
    sdists = {norm(s) for s in re.findall(r'"([^"]+)"', m.group(1))}
    assert sdists <= set(pins(BUNDLE)), f"sdist_only names not in the list: {sdists - set(pins(BUNDLE))}"
    assert "--no-deps" in text and "--python-version 3.12" in text and "--abi cp312" in text


def test_pulp_stub_imports_and_fails_on_use(monkeypatch):
    stubs = REPO / "nemo_ssa" / "_offline_stubs"
    assert (stubs / "pulp" / "__init__.py").is_file()
    # load it as a top-level 'pulp', as the stub wheel installs it, without touching a
    # real PuLP that may be installed here
    import importlib.util

    spec = importlib.util.spec_from_file_location("pulp_stub_under_test", stubs / "pulp" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.__nemo_ssa_stub__ is True
    # what modelopt's searcher evaluates at import time
    annotation = list[list[mod.LpVariable]]
    assert annotation is not None and mod.LpVariable is mod.LpVariable
    assert mod.LpMinimize is not mod.LpMaximize
    with pytest.raises(ImportError, match="stub"):
        mod.PULP_CBC_CMD(msg=False)
    with pytest.raises(ImportError):
        mod.LpStatus[1]
    with pytest.raises(AttributeError):
        mod.__wrapped__


#: the image's numpy (pip list on the 'cuda' image, 2026-11-25): what the bundle runs beside
IMAGE_NUMPY = "2.5.2"


def test_bundle_megatron_runs_beside_the_image_numpy():
    """The image's numpy is 2.x, which megatron-core 0.15 (the bundle's) does not support on
    its own (np.product in multi-rank checkpointing): the bundle must keep a megatron-core
    that nemo_ssa.megatron.compat covers and that tests/megatron/test_compat.py checks under
    numpy 2 -- the CPU lock's, whose source the compat test scans."""
    from nemo_ssa.megatron import compat

    bundle = pins(BUNDLE)
    assert "numpy" not in bundle, "the bundle must not replace the image's numpy"
    assert int(IMAGE_NUMPY.split(".")[0]) >= 2
    mc = bundle["megatron-core"]
    assert pins(LOCK)["megatron-core"] == mc, "test_compat.py scans the lock's megatron-core, not the bundle's"
    if mc.startswith("0.15."):
        assert len(compat.NUMPY2_MODULES) == 3
    overlay = (REPO / "requirements" / "overlays" / "numpy2.txt").read_text()
    assert re.search(r"^numpy==2\.", overlay, re.M), "the numpy 2 overlay must pin a numpy 2"
