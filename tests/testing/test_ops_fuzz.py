"""The ops fuzz (nemo_ssa/testing/ops_fuzz.py): >= 500 seeded cases over the public attention ops,
each correct against the float64 reference by the 2x-eager rule or refused with a
ValueError / NotImplementedError naming what is supported -- never a crash, a hang or a
silently wrong result. Kernels run in the Triton interpreter (fp32/fp16, tiny shapes);
``python -m nemo_ssa.testing.ops_fuzz --device cuda --cases 3000`` is the GPU run.

Negative controls: an op made silently wrong (output off by 1 %, a dropped sign in db),
one that crashes, one that refuses without naming the supported set, and one that hangs
are each classified ``failed`` -- so a clean run is not vacuous.
"""

import hashlib
import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import nemo_ssa.testing.ops_fuzz as fuzz  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = 520
# NaN-contract cases: the interpreter's max over an all-NaN row warns (expected)
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")


def _seed() -> int:
    salt = os.environ.get("NEMO_SSA_TEST_SEED_SALT", "")
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:2], "little") if salt else 0


@pytest.fixture(scope="module")
def fuzz_results():
    if not fuzz.kernels_runnable_on(DEVICE):
        pytest.skip("Triton kernels were built for GPU (TRITON_INTERPRET=1 set after import) and no CUDA")
    t0 = time.time()
    res = fuzz.run_fuzz(CASES, DEVICE, seed=_seed(), time_limit=60.0)
    print(f"\n[ops fuzz] {len(res)} cases in {time.time() - t0:.0f} s: {fuzz.summarize(res)['total']}")
    return res


def test_every_case_is_correct_or_refused(fuzz_results):
    table = fuzz.summarize(fuzz_results)
    fails = [f"case {r.idx} {r.op} {r.kind}: {r.detail} -- {r.desc}" for r in fuzz_results if r.outcome == "failed"]
    assert not fails, f"{len(fails)} failed (re-run one with python -m nemo_ssa.testing.ops_fuzz --device {DEVICE} " \
                      f"--seed {_seed()} --only IDX):\n" + "\n".join(fails[:20])
    total = table["total"]
    assert total["tried"] >= 500
    # not vacuous: every op is both exercised numerically and probed with bad input
    for op in fuzz.OPS:
        assert table[op]["correct"] >= 3 and table[op]["refused"] >= 3, (op, table[op])
    kinds = {r.kind.split(":")[0] for r in fuzz_results if r.outcome == "correct"}
    assert kinds == {"valid", "huge", "nan", "bad"}, kinds


def _one(op, kind, **over):
    """A spec of ``op`` and ``kind`` (first draw that matches), with overrides."""
    for i in range(2000):
        s = fuzz.gen_spec(fuzz.case_rng(99, i), DEVICE, op=op)
        if s.kind.split(":")[0] == kind and (kind != "bad" or s.kind == over.get("bad_kind", s.kind)):
            for k, v in over.items():
                if k != "bad_kind":
                    setattr(s, k, v)
            return s
    raise AssertionError(f"no {kind} case for {op}")


def test_negative_control_silently_wrong_output_fails(monkeypatch):
    from nemo_ssa.ops import registry

    real = registry.get_attention_fn("softmax", "triton")
    monkeypatch.setitem(registry.ATTENTION_FNS, ("softmax", "triton"), lambda *a, **k: real(*a, **k) * 1.01)
    r = fuzz.run_case(_one("softmax_triton", "valid"))
    assert r.outcome == "failed" and "o rel err" in r.detail, r


def test_negative_control_wrong_db_sign_fails(monkeypatch):
    """db computed without sgn(s) (seed 000's bug) in an otherwise exact reference op."""
    from nemo_ssa.ops import registry
    from nemo_ssa.ops.attention import naive

    def bad_ssa(q, k, v, n, b, **kw):
        class Flip(torch.autograd.Function):  # identity on b, its gradient replaced by |db|-ish
            @staticmethod
            def forward(ctx, b_):
                return b_.clone()

            @staticmethod
            def backward(ctx, g):
                return g.abs() * 1.5 + 1.0

        return naive.ssa_attention_naive(q, k, v, n, Flip.apply(b), **kw)

    monkeypatch.setitem(registry.ATTENTION_FNS, ("ssa", "reference"), bad_ssa)
    r = fuzz.run_case(_one("ssa_reference", "valid", dtype=torch.float32))
    assert r.outcome == "failed" and "db" in r.detail, r


def test_negative_controls_crash_bad_message_and_hang(monkeypatch):
    from nemo_ssa.ops import registry

    def crash(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access")

    def mute(*a, **k):
        raise ValueError("bad input")

    def hang(*a, **k):
        time.sleep(30)

    s = _one("softmax_sdpa", "valid")
    for fn, want in ((crash, "crash RuntimeError"), (mute, "names no supported set"), (hang, "hang")):
        monkeypatch.setitem(registry.ATTENTION_FNS, ("softmax", "sdpa"), fn)
        r = fuzz.run_case(s, time_limit=2.0)
        assert r.outcome == "failed" and want in r.detail, (want, r)


def test_a_kernel_accepting_bad_input_fails(monkeypatch):
    """An op that returns for an input the reference refuses (here: mixed dtypes made legal
    by casting) is a failure, not a pass."""
    from nemo_ssa.ops import registry

    real = registry.get_attention_fn("softmax", "sdpa")
    monkeypatch.setitem(registry.ATTENTION_FNS, ("softmax", "sdpa"),
                        lambda q, k, v, **kw: real(q, k.to(q.dtype), v.to(q.dtype), **kw))
    s = _one("softmax_sdpa", "bad", bad_kind="bad:dtype_mixed")
    r = fuzz.run_case(s)
    assert r.outcome == "failed" and "reference refuses" in r.detail, r


def test_cli_writes_counts(tmp_path):
    if not fuzz.kernels_runnable_on(DEVICE):
        pytest.skip("kernels not runnable here")
    out = tmp_path / "fuzz.md"
    rc = fuzz.main(["--cases", "12", "--device", DEVICE, "--seed", "5", "--out", str(out)])
    text = out.read_text()
    assert rc == 0 and "| **total** | 12 |" in text and "tried | correct | refused | failed" in text


def test_first_case_continues_the_sequence_and_the_report_is_written_as_cases_finish(monkeypatch, tmp_path):
    """``--first-case K`` runs cases K.. of the seed (a later, time-limited device call adds
    to an earlier one); the report is on disk after every case, so a command killed at a
    device limit still leaves what ran (one GPU call lost its report that way)."""
    seen = []
    out = tmp_path / "f.md"

    def fake_case(s, limit=60.0):
        if len(seen) >= 9:  # the CLI run's second case on: the ones before it are on disk
            assert out.exists() and f"| **total** | {len(seen) - 8} |" in out.read_text()
        seen.append(s.describe())
        return fuzz.CaseResult(idx=-1, op=s.op, kind=s.kind, outcome="correct", desc=s.describe())

    monkeypatch.setattr(fuzz, "run_case", fake_case)
    full = fuzz.run_fuzz(6, "cpu", seed=3)
    assert [r.idx for r in full] == list(range(6))
    first_six, reports = list(seen), []
    tail = fuzz.run_fuzz(2, "cpu", seed=3, first=4, on_result=lambda rs: reports.append(len(rs)))
    assert [r.idx for r in tail] == [4, 5] and seen[6:] == first_six[4:] and reports == [1, 2]
    assert fuzz.main(["--cases", "3", "--device", "cpu", "--seed", "3", "--first-case", "3", "--out", str(out)]) == 0
    assert "3 cases (3..5)" in out.read_text() and seen[8:] == first_six[3:]


def test_flex_cpu_tensors_on_a_cuda_run_are_refused():
    """Issue 47: on a CUDA run, ``device_cpu_no_kernels`` gave ssa_flex CPU tensors that the
    builder had detached while the grad step still asked for their gradients: a crash
    ("One of the differentiated Tensors does not require grad") in place of a refusal. The
    case builds CPU tensors only, so it runs here as on the GPU."""
    s = _one("ssa_flex", "bad", bad_kind="bad:device_cpu_no_kernels")
    s.device = "cuda"  # the run's device; the case itself moves the tensors to the CPU
    s.dtype = torch.float32
    r = fuzz.run_case(s)
    assert r.outcome == "refused" and "no CPU backward" in r.detail and "supported" in r.detail, r
