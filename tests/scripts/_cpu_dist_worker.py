"""Run several tiny CPU-loop trainings, one after another, in one ``torchrun`` world.

    torchrun --nproc-per-node 2 tests/scripts/_cpu_dist_worker.py jobs.json

``jobs.json``: ``{"corpus": {"prefix": ..., "tokenizer_dir": ...}, "jobs": [{...}, ...],
"out": "results.json"}``; each job's keys are :func:`tiny_recipe`'s plus ``run_dir``,
``max_steps``, ``train`` (keyword arguments of ``train_on_cpu``). Importing megatron and
NeMo takes most of a process's start-up, so the multi-process tests launch one world for
all their layouts (megatron's parallel state is rebuilt between jobs). Rank 0 writes every
job's losses, n trajectory (from metrics.csv) and extras to ``out``; a failing job is
recorded with its error and the rest still run.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def tiny_recipe(prefix, tokenizer_dir, *, attention="ssa_reference", max_steps=20, run_dir="/tmp/unused",
                world=1, tp=1, cp=1, sp=False, dist_opt=False, hidden=32, heads=4, groups=2, seq_length=32,
                micro_batch_size=2, global_batch_size=4, dropout=0.0, attention_options=None, policy="pinned",
                lr=2e-3, precision="32"):
    """The tests' tiny model (2 layers) on the tiny corpus, at a given parallel layout."""
    from recipes import nemotron_114m
    from nemo_ssa.train.cpu_recipe import shrink_for_cpu

    recipe = nemotron_114m.pretrain_recipe(
        dir=run_dir, attention=attention, attention_options=attention_options, policy=policy,
        data_prefix=prefix, tokenizer_dir=tokenizer_dir, max_steps=max_steps, warmup_steps=1, lr=lr, seed=1234,
        num_gpus_per_node=world, tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp,
        use_distributed_optimizer=dist_opt, seq_length=seq_length, micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
    )
    shrink_for_cpu(recipe, arch=dict(num_layers=2, hidden_size=hidden, ffn_hidden_size=2 * hidden,
                                     num_attention_heads=heads, num_query_groups=groups),
                   seq_length=seq_length, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size)
    recipe.model.config.hidden_dropout = dropout
    recipe.model.config.attention_dropout = dropout
    if precision == "bf16":
        from nemo_ssa.train.cpu_recipe import use_bf16_on_cpu

        use_bf16_on_cpu(recipe)
    return recipe


def n_trajectory(run_dir):
    rows = list(csv.DictReader(open(os.path.join(run_dir, "metrics.csv"))))
    cols = sorted(c for c in rows[0] if c.startswith("n_layer_")) if rows else []
    return [[float(r[c]) for c in cols] for r in rows]


def run_job(corpus, job):
    from nemo_ssa.train.loop import train_on_cpu

    job = dict(job)
    run_dir = job.pop("run_dir")
    train = dict(job.pop("train", {}))
    name = job.pop("name", run_dir)
    max_steps = job.get("max_steps", 20)
    recipe = tiny_recipe(corpus["prefix"], corpus["tokenizer_dir"], run_dir=run_dir, **job)
    res = train_on_cpu(recipe, run_dir, max_steps=max_steps, quiet=True, **train)
    return name, {"losses": res.losses, "ssa_n": res.ssa_n, "steps": res.steps, "checkpoint": res.checkpoint,
                  "extra": {k: v for k, v in res.extra.items() if k != "no_weight_decay"}}


def cp_op_check(attention, seq=16, batch=2, heads=4, groups=2, head_dim=16, causal=True, wrong_order=False):
    """Context-parallel core attention vs the same module on the whole sequence (one rank's
    view of a CP world): forward rows, dq, dk/dv after the reduce-scatter, dn summed over CP.
    Returns the max relative error of each (``wrong_order``: a negative control that breaks
    the chunk reorder)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_ssa.megatron import parallel as par
    from nemo_ssa.megatron.cpu import cpu_device_shims
    from nemo_ssa.megatron.spec import CORE_ATTENTIONS

    world = dist.get_world_size()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    cp, r = world, parallel_state.get_context_parallel_rank()
    cls = CORE_ATTENTIONS[attention]
    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask

    def make(cp_size):
        cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                                num_query_groups=groups, use_cpu_initialization=True, context_parallel_size=cp_size,
                                attention_dropout=0.0)
        kw = {}
        if attention.startswith("ssa"):
            kw["n_init"] = 1.3
        mod = cls(config=cfg, layer_number=1, attn_mask_type=mask, attention_type="self", **kw)
        return mod

    g = torch.Generator().manual_seed(7)  # the same full inputs on every rank
    q = torch.randn(seq, batch, heads, head_dim, generator=g)
    k = torch.randn(seq, batch, groups, head_dim, generator=g)
    v = torch.randn(seq, batch, groups, head_dim, generator=g)
    dout = torch.randn(seq, batch, heads * head_dim, generator=g)
    c = seq // (2 * cp)
    rows = torch.cat([torch.arange(i * c, (i + 1) * c) for i in par.local_chunk_ids(r, cp)])
    saved = par._natural_order
    if wrong_order:
        par._natural_order = lambda n: list(range(2 * n))
    try:
        with cpu_device_shims():
            ref = make(1)
            qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
            out_ref = ref(qf, kf, vf, None)
            (out_ref * dout).sum().backward()
            mod = make(cp)
            ql, kl, vl = (t[rows].clone().requires_grad_(True) for t in (q, k, v))
            out = mod(ql, kl, vl, None)
            (out * dout[rows]).sum().backward()
    finally:
        par._natural_order = saved

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    errs = {"out": rel(out.detach(), out_ref.detach()[rows]), "dq": rel(ql.grad, qf.grad[rows]),
            "dk": rel(kl.grad, kf.grad[rows]), "dv": rel(vl.grad, vf.grad[rows])}
    if getattr(mod, "n", None) is not None and isinstance(mod.n, torch.nn.Parameter):
        dn = mod.n.grad.clone()
        dist.all_reduce(dn)  # what DDP's dp x cp reduction does to every gradient (before scaling)
        errs["dn"] = rel(dn, ref.n.grad)
    parallel_state.destroy_model_parallel()
    return errs


#: job keys that switch a fix off for that job (negative controls): module, attribute, stand-in
NEGATIVE_CONTROLS = {
    # n's gradient not all-reduced over TP
    "no_tp_scalar_reduce": ("nemo_ssa.megatron.core_attention", "replicate_over_tp", lambda t, g: t),
    # megatron-core 0.15.3's optimizers as they are
    "no_optimizer_fixes": ("nemo_ssa.megatron.optimizer_fixes", "patch_megatron_optimizer", lambda opt: []),
    # megatron-core 0.15's dist_checkpointing as it is under numpy 2 (np.product)
    "no_numpy2_compat": ("nemo_ssa.megatron.compat", "apply_megatron_compat", lambda *a, **k: []),
}


@contextlib.contextmanager
def _negative_controls(controls):
    import importlib

    saved = []
    try:
        for key, on in controls.items():
            if on:
                mod, attr, stand_in = NEGATIVE_CONTROLS[key]
                module = importlib.import_module(mod)
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, stand_in)
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def main(path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = json.load(open(path))
    dist.init_process_group("gloo")
    results = {}
    try:
        for job in spec["jobs"]:
            name = job.get("name", job.get("run_dir"))
            try:
                if job.get("kind") == "cp_op":
                    args = {k: v for k, v in job.items() if k not in ("kind", "name", "run_dir")}
                    results[name] = {"errors": cp_op_check(**args)}
                    continue
                controls = {k: job.pop(k) for k in list(job) if k in NEGATIVE_CONTROLS}
                if controls:
                    with _negative_controls(controls):
                        _, results[name] = run_job(spec["corpus"], job)
                    continue
                _, results[name] = run_job(spec["corpus"], job)
                if dist.get_rank() == 0 and "run_dir" in job:
                    results[name]["n_trajectory"] = n_trajectory(job["run_dir"]) if os.path.exists(
                        os.path.join(job["run_dir"], "metrics.csv")) else []
            except Exception as e:  # noqa: BLE001 -- recorded, the test reports it
                results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                if not spec.get("keep_going", True):
                    raise
    finally:
        if dist.get_rank() == 0:
            import megatron.core
            import numpy

            from nemo_ssa.megatron import compat

            results["_env"] = {"numpy": numpy.__version__, "megatron_core": megatron.core.__version__,
                               "torch": torch.__version__,
                               "numpy2_shimmed": [m for m in compat.NUMPY2_MODULES
                                                  if type(getattr(sys.modules.get(m), "np", None)).__name__
                                                  == "_NumpyWithProduct"]}
            with open(spec["out"], "w") as f:
                json.dump(results, f, indent=1)
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
