"""Offline (no GPU) compile check of the ELSA forward kernels: registers and spills.

Compiles exactly the launches ``elsa_forward`` would make for a shape (recorded with
``meta`` tensors), for an NVIDIA target (default sm_90a, i.e. H100/H200), with the same
argument specialisation Triton's runtime applies (ints equal to 1 become constants,
16-divisible ints and pointers get ``tt.divisibility=16``), then runs the bundled
``ptxas -v`` and reports registers per thread and spill bytes. Use it to vet a change
of ``routing.FWD_TILES`` / ``MERGE_TILES`` before spending GPU time::

    python -m nemo_ssa.ops.elsa.aot_check                    # every table entry
    python -m nemo_ssa.ops.elsa.aot_check --dtypes bf16 --dims 64 --tiles 128x64x8x3

Any non-zero spill count is printed and makes the exit status 1. Not a timing tool.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from typing import List

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nemo_ssa.ops.common.launch import is_interpreter
from nemo_ssa.ops.elsa import routing
from nemo_ssa.ops.elsa.scan import elsa_forward

__all__ = ["compile_spec", "ptxas_usage", "check_forward"]

_TDT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compile_spec(kernel, args, kwargs, arch: int = 90):
    """Compile one recorded launch for ``cuda:arch`` with the runtime's specialisation."""
    kwargs = dict(kwargs)
    num_warps, num_stages = kwargs.pop("num_warps", 4), kwargs.pop("num_stages", 3)
    names = [n for n in kernel.arg_names if n not in kwargs]
    sig, consts, attrs = {}, dict(kwargs), {}
    for name, a in zip(names, args):
        idx = kernel.arg_names.index(name)
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _TDT[a.dtype]
            attrs[(idx,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            if a == 1:
                consts[name] = 1
                continue
            sig[name] = "i64" if abs(a) >= 2 ** 31 else "i32"
            if a % 16 == 0:
                attrs[(idx,)] = [["tt.divisibility", 16]]
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(a).__name__}")
    for c in consts:
        sig[c] = "constexpr"
    src = ASTSource(kernel, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_usage(compiled, arch: int = 90):
    """``(registers, spill_store_bytes, spill_load_bytes)`` from ``ptxas -v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        r = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}a", "-v", f.name, "-o", "/dev/null"],
                           capture_output=True, text=True)
    out = r.stdout + r.stderr
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    if not regs:
        raise RuntimeError(f"ptxas failed:\n{out[-2000:]}")
    st, ld = (int(x) for x in spills[0]) if spills else (0, 0)
    return int(regs[0]), st, ld


def check_forward(dtype, D: int, *, transform: int, causal: bool, partitions: int, S: int = 4096,
                  Hq: int = 16, Hkv: int = 16, arch: int = 90) -> List[str]:
    """Compile the forward launches of one configuration; one report line per kernel."""
    q = torch.empty(1, Hq, S, D, dtype=dtype, device="meta")
    k = torch.empty(1, Hkv, S, D, dtype=dtype, device="meta")
    nb = torch.empty(1, device="meta")
    specs: list = []
    elsa_forward(q, k, k, nb, nb, transform=transform, causal=causal, scale=D ** -0.5,
                 num_partitions=partitions, fast_log2_override=True, _collect=specs)
    lines = []
    for kernel, _grid, args, kwargs in specs:
        regs, st, ld = ptxas_usage(compile_spec(kernel, args, kwargs, arch), arch)
        tiles = f"BM{kwargs['BLOCK_M']} w{kwargs.get('num_warps')} s{kwargs.get('num_stages', '-')}"
        if "BLOCK_N" in kwargs:
            tiles = f"BM{kwargs['BLOCK_M']} BN{kwargs['BLOCK_N']} w{kwargs['num_warps']} s{kwargs['num_stages']}"
        lines.append(f"{_TDT[dtype]} D{D} {'ssa' if transform else 'softmax'} "
                     f"{'causal' if causal else 'full'} P{partitions} {kernel.__name__} {tiles}: "
                     f"regs {regs} spills {st}/{ld} B")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--dims", default="16,32,48,64,128,256")
    p.add_argument("--tiles", default=None, help="override BLOCK_MxBLOCK_NxWARPSxSTAGES for all dims")
    p.add_argument("--arch", type=int, default=90)
    args = p.parse_args(argv)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if is_interpreter():
        print("unset TRITON_INTERPRET: the compile check needs the real Triton frontend", file=sys.stderr)
        return 2
    bad = 0
    for dname in args.dtypes.split(","):
        dtype = dtypes[dname]
        for D in (int(x) for x in args.dims.split(",")):
            if args.tiles:
                routing.TILE_OVERRIDE = tuple(int(x) for x in args.tiles.split("x"))
            for tr in (0, 1):
                for causal in (False, True):
                    for P in (1, 4):
                        for line in check_forward(dtype, D, transform=tr, causal=causal, partitions=P,
                                                  arch=args.arch):
                            print(line, flush=True)
                            bad += "spills 0/0" not in line
    print(f"{bad} kernel(s) with spills")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
