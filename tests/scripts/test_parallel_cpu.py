"""Several ranks on CPU (gloo, torchrun): DP, TP, TP+SP, CP, the distributed optimizer, bf16
with fp32 n, and checkpoints that move between layouts (the parallel layouts' proof on CPU).

Every multi-rank layout trains the tiny model for 20 steps and must reproduce the world-1
run's losses and n trajectory (fp32, rtol 1e-5); checkpoints saved at one layout and
resumed at another must continue the world-1 curve. Start-up (importing megatron and NeMo)
dominates, so all 2-rank runs share one ``torchrun`` world (tests/scripts/_cpu_dist_worker.py
rebuilds megatron's parallel state between them) and the 4-rank layout gets one world of
its own. Negative controls show the checks can fail: without the TP all-reduce of n's
gradient the ranks' n diverge; with a wrong chunk order the CP attention is wrong; without
nemo_ssa's optimizer fixes a bf16 checkpoint with an fp32 n cannot be written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _cpu_dist_worker import tiny_recipe  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 20
RTOL = 1e-5
BASE = dict(max_steps=STEPS, global_batch_size=8, micro_batch_size=2)  # DP2: 2 micro-batches per rank


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from nemo_ssa.data import build_corpus

    out = tmp_path_factory.mktemp("corpus")
    c = build_corpus(str(out), source="stdlib", vocab_size=512, max_bytes=400_000, quiet=True)
    return {"prefix": c.prefix, "tokenizer_dir": c.tokenizer_dir}


def _train_here(corpus, run_dir, train=None, **job):
    """A world-1 run in this process (the reference every layout must reproduce)."""
    from nemo_ssa.train.loop import train_on_cpu

    job = {**BASE, **job}
    recipe = tiny_recipe(corpus["prefix"], corpus["tokenizer_dir"], run_dir=str(run_dir), **job)
    return train_on_cpu(recipe, str(run_dir), max_steps=job["max_steps"], quiet=True, **(train or {}))


def _torchrun(nproc, corpus, jobs, out_dir):
    spec = {"corpus": corpus, "out": str(out_dir / "results.json"), "jobs": jobs}
    path = out_dir / "jobs.json"
    path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(HERE, "_cpu_dist_worker.py"), str(path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert os.path.exists(spec["out"]), (proc.stdout + proc.stderr)[-5000:]
    return json.load(open(spec["out"]))


@pytest.fixture(scope="module")
def refs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("refs")
    ssa = _train_here(corpus, root / "ssa", attention="ssa_reference", train={"ckpt_every": 10})
    soft = _train_here(corpus, root / "soft", attention="softmax")
    return {"ssa": ssa, "softmax": soft, "root": root}


def _seed_checkpoint(src_run, step, dst_run):
    """A run directory whose only checkpoint is ``src_run``'s at ``step`` (to resume elsewhere)."""
    name = f"step_{step:07d}"
    os.makedirs(os.path.join(dst_run, "checkpoints"), exist_ok=True)
    shutil.copytree(os.path.join(src_run, "checkpoints", name), os.path.join(dst_run, "checkpoints", name))


LAYOUTS = {  # name -> (attention, layout keys)
    "ssa-dp2": ("ssa_reference", dict(world=2)),
    "ssa-tp2": ("ssa_reference", dict(world=2, tp=2)),
    "ssa-tp2sp": ("ssa_reference", dict(world=2, tp=2, sp=True)),
    "ssa-cp2": ("ssa_reference", dict(world=2, cp=2)),
    "ssa-dp2opt": ("ssa_reference", dict(world=2, dist_opt=True)),
    "softmax-dp2opt": ("softmax", dict(world=2, dist_opt=True)),
    "softmax-tp2sp": ("softmax", dict(world=2, tp=2, sp=True)),
    "softmax-cp2": ("softmax", dict(world=2, cp=2)),
}
BF16 = dict(max_steps=6, world=2, precision="bf16", attention="ssa_reference")


@pytest.fixture(scope="module")
def world2(corpus, refs, tmp_path_factory):
    out = tmp_path_factory.mktemp("world2")
    jobs = []
    for name, (attention, layout) in LAYOUTS.items():
        train = {"ckpt_every": 10} if name == "ssa-tp2sp" else {}
        jobs.append(dict(name=name, run_dir=str(out / name), attention=attention, train=train, **BASE, **layout))
    # 1 rank -> TP2: the reference's step-10 checkpoint continues at TP2
    _seed_checkpoint(str(refs["root"] / "ssa"), 10, str(out / "r1-to-tp2"))
    jobs.append(dict(name="r1-to-tp2", run_dir=str(out / "r1-to-tp2"), attention="ssa_reference", world=2, tp=2,
                     train={"resume": True}, **BASE))
    # negative control: n's TP all-reduce off -> the ranks' n differ after the first step
    jobs.append(dict(name="neg-tp", run_dir=str(out / "neg-tp"), world=2, tp=2, no_tp_scalar_reduce=True,
                     **{**BASE, "max_steps": 2}))
    # op level: the CP core attention (fwd, dq, dk/dv after the reduce-scatter, dn) vs the
    # whole sequence, for the fused kernels (Triton interpreter) too
    for att in ("softmax", "ssa_reference", "softmax_triton", "ssa_triton"):
        jobs.append(dict(name=f"cpop-{att}", kind="cp_op", attention=att))
    jobs.append(dict(name="cpop-no_mask", kind="cp_op", attention="ssa_reference", causal=False))
    jobs.append(dict(name="cpop-neg", kind="cp_op", attention="ssa_reference", wrong_order=True))
    # bf16 model, fp32 n, both mixed-precision optimizers: stop at 4 (checkpoint at 3), resume
    for opt in (False, True):
        tag = "bf16-distopt" if opt else "bf16-f16opt"
        jobs += [dict(name=f"{tag}-full", run_dir=str(out / f"{tag}-full"), dist_opt=opt, **BF16),
                 dict(name=f"{tag}-a", run_dir=str(out / f"{tag}-res"), dist_opt=opt,
                      train={"stop_after": 4, "ckpt_every": 3, "save_at_end": False}, **BF16),
                 dict(name=f"{tag}-b", run_dir=str(out / f"{tag}-res"), dist_opt=opt, train={"resume": True}, **BF16)]
    jobs.append(dict(name="neg-optfix", run_dir=str(out / "neg-optfix"), no_optimizer_fixes=True,
                     train={"ckpt_every": 1}, **{**BF16, "max_steps": 1}))
    return _torchrun(2, corpus, jobs, out), out


@pytest.fixture(scope="module")
def world4(corpus, tmp_path_factory):
    """DP2 x TP2 with the distributed optimizer, stopped at step 10 (its checkpoint)."""
    out = tmp_path_factory.mktemp("world4")
    jobs = [dict(name="dp2tp2", run_dir=str(out / "dp2tp2"), attention="ssa_reference", world=4, tp=2,
                 dist_opt=True, train={"stop_after": 10, "ckpt_every": 10}, **BASE)]
    return _torchrun(4, corpus, jobs, out), out


def _ok(results, name):
    r = results[name]
    assert "error" not in r, f"{name}: {r['error']}\n{r.get('traceback', '')}"
    return r


def _assert_same_curve(losses, ref_losses, n_hist=None, ref_n_hist=None, what=""):
    assert len(losses) == len(ref_losses), what
    assert losses == pytest.approx(ref_losses, rel=RTOL), what
    if ref_n_hist is not None:
        assert len(n_hist) == len(ref_n_hist) and all(len(r) for r in ref_n_hist), what
        for a, b in zip(n_hist, ref_n_hist):
            assert a == pytest.approx(b, rel=RTOL), what


# ------------------------------------------------------------------------ the layouts

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_reproduces_the_single_rank_run(world2, refs, name):
    results, _ = world2
    r = _ok(results, name)
    attention = LAYOUTS[name][0]
    ref = refs["ssa" if attention.startswith("ssa") else "softmax"]
    _assert_same_curve(r["losses"], ref.losses, r["extra"]["n_history"] if ref.ssa_n else None,
                       ref.extra["n_history"] if ref.ssa_n else None, what=name)
    if ref.ssa_n:  # n moved, so the trajectory check has something to compare
        assert all(abs(v - 1.5) > 1e-4 for v in ref.ssa_n.values())
    layout = r["extra"]["layout"]
    expect = {"dp2": "DP2 x TP1 x CP1", "tp2": "DP1 x TP2 x CP1", "tp2sp": "DP1 x TP2+SP x CP1",
              "cp2": "DP1 x TP1 x CP2", "dp2opt": "DP2 x TP1 x CP1"}[name.split("-", 1)[1]]
    assert layout == f"world 2 = {expect}"
    assert r["extra"]["distributed_optimizer"] == name.endswith("opt")


def test_n_stays_identical_on_tp_ranks_and_the_check_can_fail(world2):
    """The loop checks n bitwise across TP ranks after every step (tp2/tp2sp passed it);
    without the TP all-reduce of n's gradient the same run stops at step 1."""
    results, _ = world2
    neg = results["neg-tp"]
    assert "SSA n after step 1 differs between ranks" in neg.get("error", ""), neg


# ------------------------------------------------------------------ context parallel op

@pytest.mark.parametrize("name", ["cpop-softmax", "cpop-ssa_reference", "cpop-softmax_triton", "cpop-ssa_triton",
                                  "cpop-no_mask"])
def test_context_parallel_attention_matches_the_whole_sequence(world2, name):
    results, _ = world2
    errs = _ok(results, name)["errors"]
    keys = {"out", "dq", "dk", "dv"} | ({"dn"} if "ssa" in name or name == "cpop-no_mask" else set())
    assert set(errs) == keys, errs
    assert max(errs.values()) < 2e-6, errs  # fp32: rounding only


def test_context_parallel_check_catches_a_wrong_chunk_order(world2):
    errs = _ok(world2[0], "cpop-neg")["errors"]
    assert min(errs.values()) > 1e-2, errs


# ---------------------------------------------------------------------- checkpoints

def test_single_rank_checkpoint_resumes_at_tp2(world2, refs):
    r = _ok(world2[0], "r1-to-tp2")
    ref = refs["ssa"]
    _assert_same_curve(r["losses"], ref.losses[10:], r["extra"]["n_history"], ref.extra["n_history"][10:],
                       what="1 rank -> TP2")


def test_tp2_checkpoint_resumes_on_one_rank(world2, refs, tmp_path, corpus):
    _, out = world2
    _seed_checkpoint(str(out / "ssa-tp2sp"), 10, str(tmp_path / "run"))
    res = _train_here(corpus, tmp_path / "run", attention="ssa_reference", train={"resume": True})
    ref = refs["ssa"]
    _assert_same_curve(res.losses, ref.losses[10:], res.extra["n_history"], ref.extra["n_history"][10:],
                       what="TP2+SP -> 1 rank")


def test_dp2_tp2_distributed_optimizer_checkpoint_resumes_on_one_rank(world4, refs, tmp_path, corpus):
    results, out = world4
    r = _ok(results, "dp2tp2")
    ref = refs["ssa"]
    assert r["extra"]["layout"] == "world 4 = DP2 x TP2 x CP1" and r["extra"]["distributed_optimizer"]
    _assert_same_curve(r["losses"], ref.losses[:10], r["extra"]["n_history"], ref.extra["n_history"][:10],
                       what="DP2xTP2 first 10 steps")
    _seed_checkpoint(str(out / "dp2tp2"), 10, str(tmp_path / "run"))
    # megatron reshards across layouts, not between optimizer types: one clear line
    with pytest.raises(ValueError, match="set train.distributed_optimizer=true"):
        _train_here(corpus, tmp_path / "run", attention="ssa_reference", train={"resume": True})
    res = _train_here(corpus, tmp_path / "run", attention="ssa_reference", dist_opt=True, train={"resume": True})
    _assert_same_curve(res.losses, ref.losses[10:], res.extra["n_history"], ref.extra["n_history"][10:],
                       what="DP2xTP2 (distributed optimizer) -> 1 rank")


@pytest.mark.parametrize("tag", ["bf16-f16opt", "bf16-distopt"])
def test_bf16_model_keeps_n_fp32_and_resumes_bitwise(world2, tag):
    """bf16 parameters, fp32 n (it moves by less than bf16's 2^-7 step here), both
    mixed-precision optimizers: interrupted at 4 with the checkpoint at 3, the resumed
    curve and n equal the uninterrupted run's exactly."""
    results, _ = world2
    full, a, b = (_ok(results, f"{tag}-{s}") for s in ("full", "a", "b"))
    assert a["losses"][:3] + b["losses"] == full["losses"]
    assert b["ssa_n"] == full["ssa_n"]
    for v in full["ssa_n"].values():
        assert 0 < abs(v - 1.5) < 2 ** -8  # an fp32 move bf16 could not represent


def test_without_the_optimizer_fixes_the_bf16_checkpoint_fails(world2):
    neg = world2[0]["neg-optfix"]
    assert "error" in neg and "does not match model shape" in neg["error"], neg
