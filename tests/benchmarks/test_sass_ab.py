"""benchmarks/sass_ab.py: the kernels an H100 would launch, compiled for sm_90 on this CPU.

- At the recipe's shape every kernel entry compiles through the public ops with the
  dispatcher deciding as on an H100 (the rows name the kernels and the choices the
  dispatcher made: the SSA backward's single pass, softmax's two kernels), with a
  fingerprint per kernel.
- ``compare`` calls identical SASS identical, SASS from the same IR (without source
  locations) same IR, the same instructions in another order reordered, and counts a changed kernel (another loop body included), a changed choice and
  a kernel present on one side only as differences (the exit status).

The compile runs in a subprocess: the suite sets TRITON_INTERPRET=1, which it must not see.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def _rows(**kw):
    base = dict(op="attention", shape="recipe", impl="ssa_triton", mode="fwd+bwd", kernel="0:_attn_fwd_kernel",
                regs=128, spills=0, instrs=3000, sass="aaaa")
    base.update(kw)
    return base


def test_recipe_shape_compiles_every_kernel_as_an_h100_would(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.sass_ab", "--op", "attention", "--shape", "recipe",
                        "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = json.loads(out.read_text())
    assert not [x for x in rows if "error" in x], rows
    kernels = [x for x in rows if x["kernel"] != "dispatch"]
    by = {(x["shape"], x["impl"], x["mode"]): [k["kernel"].split(":", 1)[1] for k in kernels
                                               if (k["shape"], k["impl"], k["mode"]) == (x["shape"], x["impl"], x["mode"])]
          for x in kernels}
    assert by[("recipe", "ssa_triton", "fwd")] == ["_attn_fwd_kernel"]
    # the recipe's SSA backward: the single pass (dK/dV adds dq), softmax: the two kernels
    assert "attn_bwd_kernel_dkv" in by[("recipe", "ssa_triton", "fwd+bwd")]
    assert "attn_bwd_kernel_dq" not in by[("recipe", "ssa_triton", "fwd+bwd")]
    assert {"attn_bwd_kernel_dq", "attn_bwd_kernel_dkv"} <= set(by[("recipe", "softmax_triton", "fwd+bwd")])
    choice = {(x["shape"], x["impl"], x["mode"]): x["choice"] for x in rows if x["kernel"] == "dispatch"}
    assert "attention.bwd: single-pass" in choice[("recipe-B32", "ssa_triton", "fwd+bwd")]
    assert "flash.fwd: triton-pointers" in choice[("recipe", "softmax_triton", "fwd")]
    for k in kernels:
        assert k["regs"] > 0 and k["instrs"] > 100 and len(k["sass"]) == len(k["ir"]) == len(k["mix"]) == 12, k
    # one compiled kernel, one fingerprint: the same launch at B8 and B32 is the same code
    fp = {(k["shape"], k["impl"], k["mode"], k["kernel"]): k["sass"] for k in kernels}
    assert fp[("recipe", "ssa_triton", "fwd", "0:_attn_fwd_kernel")] == fp[("recipe-B32", "ssa_triton", "fwd",
                                                                             "0:_attn_fwd_kernel")]
    assert "| attention | recipe | ssa_triton |" in r.stdout


def test_compare_names_what_differs():
    from benchmarks.sass_ab import compare

    same, bad = compare([_rows()], [_rows()])
    assert bad == 0 and same[0]["ab"] == "identical"
    rows, bad = compare([_rows(sass="bbbb", regs=130, instrs=2990)], [_rows()])
    assert bad == 1 and rows[0]["ab"] == "differs (regs 128->130, instrs 3000->2990, spills 0->0)"
    # the same instructions in another order: not a difference; another loop body is one
    moved = dict(sass="cccc", mix="m1", loops=[529, 1045])
    rows, bad = compare([_rows(**moved)], [_rows(**dict(moved, sass="dddd"))])
    assert bad == 0 and rows[0]["ab"] == "reordered"
    rows, bad = compare([_rows(**moved, ir="i1", regs=140)], [_rows(**dict(moved, sass="dddd", ir="i1"))])
    assert bad == 0 and rows[0]["ab"] == "same IR"
    rows, bad = compare([_rows(**moved)], [_rows(**dict(moved, sass="dddd", loops=[531, 1045]))])
    assert bad == 1 and rows[0]["ab"].endswith("loops [531, 1045]->[529, 1045])")
    rows, bad = compare([_rows(kernel="1:attn_bwd_kernel_dq")], [_rows()])
    assert bad == 2 and {r["ab"] for r in rows} == {"only here", "only in ref"}
    here = dict(_rows(kernel="dispatch", choice="attention.bwd: single-pass"))
    ref = dict(_rows(kernel="dispatch", choice="attention.bwd: two-kernel"))
    rows, bad = compare([here], [ref])
    assert bad == 1 and rows[0]["ab"] == "was: attention.bwd: two-kernel"
    rows, bad = compare([_rows(error="ValueError: x")], [_rows()])
    assert bad == 1 and rows[0]["ab"] == "was: compiled"
