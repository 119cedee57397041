"""Attention block (RoPE + layout + core attention + output layout): megatron path vs fused.

    python benchmarks/bench_rope_layout.py                       # GPU, B8 N1024 H24/Hkv8 D32 bf16
    python benchmarks/bench_rope_layout.py --out $OUT/rope_layout.md
    python benchmarks/bench_rope_layout.py --smoke               # CPU interpreter, tiny shape

What runs, per attention (softmax_triton, ssa_triton), from the QKV projection's output
(a [s, b, ng, (np/ng + 2) * hn] buffer split exactly like megatron's
``get_query_key_value_tensors``) to the output projection's input [s, b, h*d]:

* **old**: megatron-core's ``apply_rotary_pos_emb`` on q and k (unfused, the recipe's
  rotary_percent 0.5), then the core attention's ``.contiguous()`` copies, the kernel and
  the copy back (what ``fused_rope_layout: false`` runs);
* **split**: megatron's split, then the core attention with the rotary tensor handed over
  (what ``FusedRopeSelfAttention`` does where the split must run): one Triton RoPE+layout
  pass on the split views, the kernel, the output written in place when the op takes ``out=``;
  backward, the split's concatenation of dq, dk, dv (and q's reshape copy forward) remain;
* **new**: what ``FusedRopeSelfAttention`` runs otherwise: the pass reads q, k, v from the
  QKV buffer itself (``rope_layout_qkv_triton``) and its backward writes the buffer's
  gradient in one launch -- no split, copy or cat.

Prints ms (fwd, fwd+bwd; ``triton.testing.do_bench`` medians), CUDA kernel launches per
fwd+bwd, and agreement: the rel. error of each path's output and QKV-buffer gradient vs an
fp32 run of the old path (split and new must be <= 2x old + 1e-3: the 2x-eager rule), and
whether new is bitwise split (the same arithmetic) beside whether split is bitwise itself when
run again: where a core attention's backward is not deterministic run to run (ssa_triton's
and cuDNN's on an H200: the outputs were bitwise, the gradients not), "new == split" can only
be as exact as the rerun. Exit 1 on disagreement.

The 114M recipe's micro batch: ``--shape 32,1024,24,8,32``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def make_block(attention, b, s, hq, hkv, d, dtype, device):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_ssa.megatron.spec import CORE_ATTENTIONS
    from nemo_ssa.ops.rope import rope_layout_qkv_triton

    cfg = TransformerConfig(num_layers=1, hidden_size=hq * d, num_attention_heads=hq, num_query_groups=hkv,
                            attention_dropout=0.0, hidden_dropout=0.0, apply_rope_fusion=False)
    core = CORE_ATTENTIONS[attention](cfg, 1, AttnMaskType.causal, "self").to(device)
    rot = d // 2  # the recipe's rotary_percent 0.5
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv)
    freqs = torch.cat((f, f), -1)[:, None, None, :]
    g = hq // hkv
    mixed = torch.randn(s, b, hkv, (g + 2) * d, device=device, dtype=dtype, requires_grad=True)

    def split(m):
        q, k, v = torch.split(m, [g * d, d, d], dim=3)
        return q.reshape(s, b, hq, d), k, v

    cp = object()  # only read for packed sequences

    def old(m):
        q, k, v = split(m)
        q = apply_rotary_pos_emb(q, freqs, config=cfg, cp_group=cp)
        k = apply_rotary_pos_emb(k, freqs, config=cfg, cp_group=cp)
        return core(q, k, v, None)

    def split_path(m):
        q, k, v = split(m)
        core._pending_rope = (freqs, freqs, 1.0)
        return core(q, k, v, None)

    def new(m):
        q, k, v = rope_layout_qkv_triton(m, g, freqs, freqs, 1.0)
        return core(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), None)

    return core, mixed, old, {"split": split_path, "new": new}


def run_grad(fn, mixed, dout):
    m = mixed.detach().clone().requires_grad_(True)
    out = fn(m)
    out.backward(dout)
    return out.detach(), m.grad.detach()


def count_kernels(fn, mixed, dout):
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(mixed).backward(dout)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as exc:  # profiler unavailable: the table says so
        print(f"(kernel count unavailable: {exc})")
        return -1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (interpreter): checks only")
    ap.add_argument("--shape", default="8,1024,24,8,32", help="B,N,Hq,Hkv,D")
    ap.add_argument("--attentions", default="softmax_triton,ssa_triton,softmax",
                    help="softmax (SDPA: cuDNN/flash) is context: the fused pass is not wired for it in the spec")
    ap.add_argument("--out", default="", help="markdown + json results file")
    args = ap.parse_args(argv)

    from nemo_ssa.megatron.cpu import cpu_device_shims
    from nemo_ssa.testing import rel_err

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    b, s, hq, hkv, d = (int(x) for x in ("2,9,6,2,16" if args.smoke else args.shape).split(","))
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    rows, ok = [], True
    shim = cpu_device_shims() if not cuda else torch.autograd.set_grad_enabled(True)
    with shim:
        for attention in args.attentions.split(","):
            core, mixed, old, fused = make_block(attention, b, s, hq, hkv, d, dtype, device)
            dout = torch.randn(s, b, hq * d, device=device, dtype=dtype)
            # fp32 truth: the old path in fp32 on the same values
            core32, _, old32, _ = make_block(attention, b, s, hq, hkv, d, torch.float32, device)
            core32.load_state_dict(core.state_dict())
            ref_out, ref_grad = run_grad(old32, mixed.detach().float(), dout.float())
            paths = {"old": old, **fused}
            got = {name: run_grad(fn, mixed, dout) for name, fn in paths.items()}
            errs = {}
            for name, (o, gr) in got.items():
                errs[f"out_{name}"], errs[f"grad_{name}"] = rel_err(o, ref_out), rel_err(gr, ref_grad)
            agree = all(errs[f"{t}_{name}"] <= 2 * errs[f"{t}_old"] + 1e-3 for t in ("out", "grad") for name in fused)
            bitwise = all(torch.equal(a, b_) for a, b_ in zip(got["new"], got["split"]))
            rerun = all(torch.equal(a, b_) for a, b_ in zip(run_grad(fused["split"], mixed, dout), got["split"]))
            ok &= agree
            row = dict(attention=attention, shape=f"B{b} N{s} H{hq}/{hkv} D{d} {str(dtype)[6:]}",
                       out_takes_out=core._op_takes_out, agree=agree, new_is_split=bitwise, split_is_split=rerun,
                       **{k: float(v) for k, v in errs.items()})
            if cuda:
                from triton.testing import do_bench

                m = mixed.detach().requires_grad_(True)
                for name, fn in paths.items():
                    row[f"{name}_fwd_ms"] = do_bench(lambda: fn(m), warmup=25, rep=200)
                    row[f"{name}_fb_ms"] = do_bench(lambda: fn(m).backward(dout), warmup=25, rep=200,
                                                    grad_to_none=[m])
                    row[f"{name}_kernels"] = count_kernels(fn, m, dout)
            rows.append(row)
            print(json.dumps(row), flush=True)

    head = "| attention | shape | agree | out err old/split/new | grad err old/split/new | new == split (split == split) |"
    lines = [head, "|" + "---|" * 6]
    if cuda:
        lines[0] += (" fwd / fwd+bwd ms old | split | new | fwd+bwd new/old | new/split | kernels old/split/new"
                     " | out= |")
        lines[1] += "---|" * 7
    for r in rows:
        line = (f"| {r['attention']} | {r['shape']} | {r['agree']} | "
                f"{r['out_old']:.2e} / {r['out_split']:.2e} / {r['out_new']:.2e} | "
                f"{r['grad_old']:.2e} / {r['grad_split']:.2e} / {r['grad_new']:.2e} | {r['new_is_split']} ({r['split_is_split']}) |")
        if cuda:
            line += "".join(f" {r[f'{n}_fwd_ms']:.3f} / {r[f'{n}_fb_ms']:.3f} |" for n in ("old", "split", "new"))
            line += (f" {r['new_fb_ms'] / r['old_fb_ms']:.2f}x | {r['new_fb_ms'] / r['split_fb_ms']:.2f}x | "
                     f"{r['old_kernels']} / {r['split_kernels']} / {r['new_kernels']} | {r['out_takes_out']} |")
        lines.append(line)
    table = "\n".join(lines)
    dev = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(f"# bench_rope_layout ({dev}, torch {torch.__version__})\n\n{table}\n\n```json\n"
                    f"{json.dumps(rows, indent=1)}\n```\n")
    print(f"\nattention block, {dev}:\n{table}")
    print("PASS" if ok else "FAIL: fused path disagrees with the megatron path (2x rule)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
