"""Model-level gradient parity on a GPU: the 114M model with ``ssa_triton`` vs ``ssa_reference``.

Same weights, same batch (the local corpus), gradients of every parameter -- n and, with
``policy=free learnable_b``, b included -- at initialisation and after ``--steps`` training
steps. Rule (the kernel issue's bf16 tolerance): for each parameter,
``rel_err(grad_triton_bf16, grad_fp32) <= 2 * rel_err(grad_reference_bf16, grad_fp32) + floor``,
where ``grad_fp32`` comes from the same model in fp32 with the reference attention.

    python benchmarks/model_grad_parity.py --steps 300 --out $OUT/grad_parity.md

Prints one line per checkpoint (init / trained) and the worst parameters, table last;
exit 1 if any parameter breaks the rule.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

from nemo_ssa.testing import rel_err  # noqa: E402

VOCAB = 50304


def init_megatron(seed: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def build_model(attention: str, seq: int, learnable_b: bool):
    import fiddle as fdl

    from recipes import nemotron_114m

    opts = {"learnable_b": True} if learnable_b else {}
    cfg_partial = nemotron_114m.model(attention=attention, attention_options=opts,
                                      policy="free" if learnable_b else "pinned",
                                      seq_length=seq, vocab_size=VOCAB)
    cfg = fdl.build(cfg_partial.config)
    cfg.bf16, cfg.fp16, cfg.params_dtype = False, False, torch.float32
    cfg.attention_dropout = cfg.hidden_dropout = 0.0
    model = cfg.configure_model(None)
    return model.cuda()


def corpus_batches(batch: int, seq: int, seed: int):
    from nemo_ssa.data import build_corpus, default_corpus_dir

    info = build_corpus(default_corpus_dir(), source="stdlib", vocab_size=50257)
    manifest = json.load(open(info.manifest_path))
    tokens = np.memmap(info.prefix + ".bin", dtype=np.dtype(manifest.get("dtype", "uint16")), mode="r")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq - 2, size=batch)
        chunk = np.stack([np.asarray(tokens[s: s + seq + 1], dtype=np.int64) for s in starts])
        x = torch.from_numpy(chunk).cuda()
        yield x[:, :-1].contiguous(), x[:, 1:].contiguous()


def loss_of(model, tokens, labels):
    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    out = model(tokens, pos, None, labels=labels)
    return out.float().mean()


def grads(model, tokens, labels):
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, tokens, labels)
    loss.backward()
    return float(loss), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(tag: str, fp32_model, ref_bf16, tri_bf16, batch, floor: float):
    tokens, labels = batch
    l32, g32 = grads(fp32_model, tokens, labels)
    with torch.autocast("cuda", enabled=False):
        lref, gref = grads(ref_bf16, tokens, labels)
        ltri, gtri = grads(tri_bf16, tokens, labels)
    rows = []
    for name, g in g32.items():
        e_ref, e_tri = rel_err(gref[name], g), rel_err(gtri[name], g)
        rows.append((name, e_tri, e_ref, e_tri <= 2 * e_ref + floor))
    bad = [r for r in rows if not r[3]]
    worst = sorted(rows, key=lambda r: r[1] / max(r[2], 1e-12), reverse=True)[:8]
    scal = [r for r in rows if r[0].endswith(".n") or r[0].endswith(".b")]
    print(f"[grad-parity] {tag}: loss fp32 {l32:.5f} ref-bf16 {lref:.5f} triton-bf16 {ltri:.5f}; "
          f"{len(rows)} params, {len(bad)} over 2x eager + {floor}", flush=True)
    return {"tag": tag, "loss": {"fp32": l32, "ref_bf16": lref, "triton_bf16": ltri},
            "params": len(rows), "failed": [r[0] for r in bad],
            "worst": [{"param": r[0], "err_triton": r[1], "err_ref_bf16": r[2]} for r in worst],
            "ssa_scalars": [{"param": r[0], "err_triton": r[1], "err_ref_bf16": r[2], "ok": r[3]} for r in scal]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps between the two checks")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--floor", type=float, default=1e-4, help="absolute slack on the relative error")
    ap.add_argument("--no-learnable-b", action="store_true", help="b fixed (pinned policy) instead of learnable")
    ap.add_argument("--out", default=None, help="markdown report path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("model_grad_parity.py needs CUDA")
    init_megatron(1234)
    learnable_b = not args.no_learnable_b
    fp32 = build_model("ssa_reference", args.seq, learnable_b)
    # megatron modules hold process-group handles: no deepcopy; build and load instead
    ref_bf16 = build_model("ssa_reference", args.seq, learnable_b)
    tri_bf16 = build_model("ssa_triton", args.seq, learnable_b)
    data = corpus_batches(args.batch, args.seq, seed=7)
    check_batch = next(data)

    def bf16_pair():
        for m in (ref_bf16, tri_bf16):
            m.float()
            m.load_state_dict(fp32.state_dict())
            m.bfloat16()
        return ref_bf16, tri_bf16

    results = []
    ref, tri = bf16_pair()
    results.append(compare("init", fp32, ref, tri, check_batch, args.floor))
    opt = torch.optim.AdamW(fp32.parameters(), lr=args.lr, weight_decay=0.0)
    t0 = time.time()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for step in range(args.steps):
            tokens, labels = next(data)
            opt.zero_grad(set_to_none=True)
            loss = loss_of(fp32, tokens, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(fp32.parameters(), 1.0)
            opt.step()
            if (step + 1) % 100 == 0:
                print(f"[grad-parity] train step {step + 1}/{args.steps} loss {loss.item():.4f} "
                      f"({time.time() - t0:.0f} s)", flush=True)
    ref, tri = bf16_pair()
    results.append(compare(f"after {args.steps} steps", fp32, ref, tri, check_batch, args.floor))
    lines = ["| check | params | failing | loss fp32 / ref bf16 / triton bf16 | n, b: err triton vs err ref-bf16 (worst layer) |",
             "|---|---|---|---|---|"]
    for r in results:
        sc = r["ssa_scalars"]
        worst_n = max((s for s in sc if s["param"].endswith(".n")), key=lambda s: s["err_triton"], default=None)
        worst_b = max((s for s in sc if s["param"].endswith(".b")), key=lambda s: s["err_triton"], default=None)
        txt = "; ".join(f"{k} {s['err_triton']:.2e} vs {s['err_ref_bf16']:.2e}"
                        for k, s in (("n", worst_n), ("b", worst_b)) if s)
        lines.append(f"| {r['tag']} | {r['params']} | {len(r['failed'])} | {r['loss']['fp32']:.4f} / "
                     f"{r['loss']['ref_bf16']:.4f} / {r['loss']['triton_bf16']:.4f} | {txt} |")
    table = "\n".join(lines)
    print("\nworst parameters (err triton / err reference-bf16, both vs fp32):")
    for r in results:
        for w in r["worst"][:5]:
            print(f"  {r['tag']:>18}  {w['param']:<60} {w['err_triton']:.3e} / {w['err_ref_bf16']:.3e}")
    print("\n" + table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(f"# Model-level gradient parity ({torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')})\n\n"
                    f"`{' '.join(sys.argv)}`\n\n{table}\n\n```json\n{json.dumps(results, indent=1)}\n```\n")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
