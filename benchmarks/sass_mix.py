"""Static instruction mix of the fused attention kernels on sm_90, without a GPU.

The SSA backward at head dim 32 is bound by instruction issue, not by the tensor cores:
every score costs a handful of FP32/ALU instructions plus ``lg2``/``ex2``/``rcp`` on the
MUFU pipe, and the dots are small. Counting the SASS of the hot loops tells which change
removes instructions before any device time is spent. This tool compiles the real
kernels (flash forward, dQ and dK/dV backward) for an H100 (``sm_90``) on a CPU-only
machine -- Triton ships ``ptxas`` and ``cuobjdump`` -- through a stand-in driver that
only reports the target, captures each launch's arguments from the ordinary host code
(``_flash_fwd``, ``attention_bwd``) on CPU tensors, and compiles with ``warmup``.

For each kernel it prints registers, spills (``STL``/``LDL``), the instruction count of
every loop body (a backward branch in the SASS) and the opcode classes inside the
largest loop, per loop iteration and per score (``/ (BLOCK_M * BLOCK_N / threads)``).

    python -m benchmarks.sass_mix                      # the recipe's shape, SSA and softmax
    python -m benchmarks.sass_mix --head-dim 64 --transforms ssa --params n,b --dump /tmp/sass

Numbers are static counts (no timing): a loop body with fewer instructions per score
issues faster when the loop is issue-bound, which the D32 backward is. Run on the GPU
(``bench_attention``) to confirm any change.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("sass_mix compiles for sm_90: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.sass_ab import SM90Driver, sass_of  # noqa: E402


_MUFU = re.compile(r"\bMUFU\.(\w+)")
_OPC = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_BRA = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")

CLASSES = [
    ("mufu", ("MUFU",)),
    ("mma", ("HGMMA", "HMMA", "WARPGROUP", "WARPSYNC")),
    ("fp32", ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FRND")),
    ("cvt", ("F2F", "F2FP", "I2F", "F2I", "F2IP")),
    ("int", ("IMAD", "IADD3", "LOP3", "SHF", "LEA", "ISETP", "SEL", "IABS", "IMNMX", "PRMT", "SGXT",
             "BMSK", "POPC", "FLO", "VIADD", "IMUL", "IMNMX", "VIMNMX")),
    ("shfl", ("SHFL",)),
    ("mem", ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDGSTS", "LDGDEPBAR", "DEPBAR", "UTMALDG",
             "SYNCS", "LDL", "STL", "LD", "ST", "RED", "ATOM", "ATOMG", "REDG")),
    ("ctrl", ("BRA", "BAR", "EXIT", "BSSY", "BSYNC", "NOP", "YIELD", "WARPSYNC", "CALL", "RET")),
]


def _cls(op: str) -> str:
    base = op.split(".")[0]
    for name, ops in CLASSES:
        if base in ops:
            return name
    return "other"


def parse_sass(sass: str) -> List[Tuple[int, str, str]]:
    """``[(address, opcode, line)]`` of every instruction."""
    out = []
    for line in sass.splitlines():
        m = _OPC.match(line)
        a = _ADDR.search(line)
        if m and a:
            out.append((int(a.group(1), 16), m.group(2), line))
    return out


def loops(instrs: List[Tuple[int, str, str]]) -> List[Tuple[int, int]]:
    """``(start, end)`` index ranges of loop bodies: a branch to a lower address."""
    index = {addr: i for i, (addr, _, _) in enumerate(instrs)}
    found = []
    for i, (addr, op, line) in enumerate(instrs):
        if op.startswith("BRA"):
            m = _BRA.search(line)
            if m:
                tgt = int(m.group(1), 16)
                if tgt < addr and tgt in index:
                    found.append((index[tgt], i))
    return found


def mix(instrs, lo: int, hi: int) -> Dict[str, int]:
    c = collections.Counter()
    for _, op, _ in instrs[lo:hi + 1]:
        c[_cls(op)] += 1
        if op.startswith("MUFU"):
            c["mufu." + op.split(".")[1].lower()] += 1
    c["total"] = hi - lo + 1
    return dict(c)


def capture_launches(fn) -> List[Tuple[object, tuple, tuple, dict]]:
    """Run ``fn`` with every kernel launch recorded instead of executed."""
    import nemo_ssa.ops.common.launch as launcher
    got = []

    def fake_launch(kernel, grid, args, meta, ntensors=None, cached=True):
        got.append((kernel, tuple(grid), tuple(args), dict(meta)))

    saved = launcher.launch  # what launch_kw ends in: positional arguments, presence flags in meta
    launcher.launch = fake_launch
    try:
        fn()
    finally:
        launcher.launch = saved
    return got


def compile_launch(kernel, grid, args, meta):
    return kernel.warmup(*args, grid=grid, **meta)


def kernel_report(name: str, compiled, meta: dict, dump: Optional[str]) -> Dict[str, object]:
    sass, regs = sass_of(compiled)
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{name}.sass"), "w") as f:
            f.write(sass)
        with open(os.path.join(dump, f"{name}.ptx"), "w") as f:
            f.write(compiled.asm["ptx"])
    instrs = parse_sass(sass)
    spills = sum(1 for _, op, _ in instrs if op.split(".")[0] in ("STL", "LDL"))
    lps = sorted(loops(instrs))
    threads = 32 * int(meta.get("num_warps", 4))
    bm, bn = int(meta["BLOCK_M"]), int(meta["BLOCK_N"])
    per_thread_scores = bm * bn / threads
    # the unmasked loop (where almost all the work of a long sequence runs) has no per-element
    # index compares; the causal-band / ragged-tail loop has one ISETP per element
    def isetp(r):
        return sum(1 for _, op, _ in instrs[r[0]:r[1] + 1] if op.startswith("ISETP"))
    hot_range = min(lps, key=isetp) if lps else (0, -1)
    hot = mix(instrs, *hot_range) if lps else {}
    # ptxas's rescue code for subnormal lg2 inputs (x * 2^24) and div.full's range check for
    # huge divisors (|y| > 2^126): neither belongs in the SSA loops (t = 1 + b|s| >= 1)
    slow = sum(1 for _, _, line in instrs[hot_range[0]:hot_range[1] + 1]
               if "16777216" in line or "8.50705917302346158658e+37" in line)
    # the Hopper path (ops.common.tma): tensor-memory-accelerator loads, stores, bulk reduces
    tma = {k: sum(1 for _, op, _ in instrs if op.startswith(op_name))
           for k, op_name in (("ldg", "UTMALDG"), ("stg", "UTMASTG"), ("red", "UTMAREDG"))}
    return dict(kernel=name, regs=regs, spills=spills, instrs=len(instrs), slow_paths=slow, tma=tma,
                loops=[r[1] - r[0] + 1 for r in lps], hot=hot, scores_per_thread=per_thread_scores,
                tile=f"{bm}x{bn}/{meta.get('num_warps')}w")


def collect(transform: str, head_dim: int, causal: bool, dtype: torch.dtype, hq: int, hkv: int,
            params: str, bwd: str = "deterministic", bwd_cfg=None, fwd_cfg=None) -> List[Tuple[str, object, tuple, tuple, dict]]:
    from nemo_ssa.ops.common.bwd import attention_bwd
    from nemo_ssa.ops.attention.flash import _flash_fwd
    B, N, D = 1, 256, head_dim
    q = torch.zeros(B, hq, N, D, dtype=dtype)
    k = torch.zeros(B, hkv, N, D, dtype=dtype)
    v = torch.zeros_like(k)
    n = torch.ones(1, dtype=torch.float32)
    b = torch.ones(1, dtype=torch.float32)
    prec = "ieee" if dtype == torch.float32 else "tf32"
    out = []
    for kern, grid, args, meta in capture_launches(lambda: _flash_fwd(
            q, k, v, n if transform == "ssa" else None, b if transform == "ssa" else None, None, None, None,
            transform, causal, D ** -0.5, 0.0, N, N, prec, True,
            save_c=bwd == "atomic" and params == "n", config=fwd_cfg)):
        out.append(("fwd", kern, grid, args, meta))
    o = torch.zeros_like(q)
    M = torch.zeros(B, hq, N, dtype=torch.float32)
    single = bwd == "atomic"
    for kern, grid, args, meta in capture_launches(lambda: attention_bwd(
            o, q, k, v, o, M, transform=transform, n=n, b=b, causal=causal, input_precision=prec,
            fast_math=True, need_dparams=params != "none", need_db=params == "n,b",
            cstat=torch.zeros_like(M) if single else None, deterministic=not single, config=bwd_cfg)):
        name = {"attn_bwd_kernel_dq": "bwd_dq", "attn_bwd_kernel_dkv": "bwd_dkv",
                "attn_bwd_preprocess": "bwd_pre"}.get(kern.__name__, kern.__name__)
        if meta.get("ATOMIC_DQ"):
            name = "bwd_dkv+dq"
        out.append((name, kern, grid, args, meta))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transforms", default="ssa,softmax")
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--heads", default="24/8", help="Hq/Hkv")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--params", default="n", choices=["n", "n,b", "none"],
                    help="SSA parameters with gradients: n (the pinned policy: b fixed), n,b, none")
    ap.add_argument("--bwd", default="deterministic", choices=["deterministic", "atomic"],
                    help="backward schedule: two kernels (dQ + dK/dV) or single pass (dK/dV adds dq atomically)")
    ap.add_argument("--bwd-config", default=None,
                    help="override the backward tiles: 8 ints 'dqBM,dqBN,dqW,dqS,kvBM,kvBN,kvW,kvS' (BwdConfig), "
                         "or 10 with the TMA modes of the dQ and dK/dV kernels")
    ap.add_argument("--fwd-config", default=None,
                    help="override the forward tiles: 'BM,BN,W,S' or 'BM,BN,W,S,TMA' (FwdConfig)")
    ap.add_argument("--dump", default=None, help="write each kernel's SASS and PTX here")
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    triton.runtime.driver.set_active(SM90Driver())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    hq, hkv = (int(x) for x in args.heads.split("/"))
    bwd_cfg = None
    if args.bwd_config:
        from nemo_ssa.ops.common.bwd_config import BwdConfig
        bwd_cfg = BwdConfig(*(int(x) for x in args.bwd_config.split(",")))
    fwd_cfg = None
    if args.fwd_config:
        from nemo_ssa.ops.attention.flash import FwdConfig
        fwd_cfg = FwdConfig(*(int(x) for x in args.fwd_config.split(",")))
    # the host code sees CPU tensors: its device facts answer as an H100's (the TMA path)
    from nemo_ssa.ops.common.target import H100, stand_in
    with stand_in(H100):
        rows = _rows(args, dtype, hq, hkv, bwd_cfg, fwd_cfg)
    _print(args, rows, hq, hkv)
    return 0


def _rows(args, dtype, hq, hkv, bwd_cfg, fwd_cfg) -> List[Dict[str, object]]:
    rows = []
    for tr in args.transforms.split(","):
        for name, kern, grid, kargs, meta in collect(tr, args.head_dim, not args.non_causal, dtype, hq, hkv,
                                                     args.params, args.bwd, bwd_cfg, fwd_cfg):
            compiled = compile_launch(kern, grid, kargs, meta)
            if "BLOCK_N" not in meta:
                continue
            r = kernel_report(f"{tr}_{name}", compiled, meta, args.dump)
            rows.append(r)
    return rows


def _print(args, rows, hq, hkv) -> None:
    keys = ["total", "fp32", "int", "mufu", "mufu.lg2", "mufu.ex2", "mufu.rcp", "cvt", "mma", "shfl", "mem", "ctrl",
            "other"]
    print(f"sm_90 static SASS, D={args.head_dim}, H{hq}/{hkv}, {args.dtype}, "
          f"{'non-causal' if args.non_causal else 'causal'}; "
          f"SSA grads: {args.params}; hot loop = the unmasked key/query-block loop; "
          "/score = its instructions / (BLOCK_M*BLOCK_N/threads)")
    print("| kernel | tile | regs | spills | loops | " + " | ".join(keys) + " | total/score | mufu/score |")
    print("|---" * (7 + len(keys)) + "|")
    for r in rows:
        h = r["hot"]
        sp = r["scores_per_thread"]
        print(f"| {r['kernel']} | {r['tile']} | {r['regs']} | {r['spills']} | {','.join(map(str, r['loops'][:3]))} | "
              + " | ".join(str(h.get(kk, 0)) for kk in keys)
              + f" | {h.get('total', 0) / sp:.2f} | {h.get('mufu', 0) / sp:.2f} |")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
