"""Config-level fuzz: random launcher configurations through ``nemo_ssa.config.check``.

Every case is a resolved ``scripts/pretrain.py`` configuration (attention, policy, parallel
sizes, world, batch sizes, precision, steps, learning rates, distributed optimizer, CPU or
GPU path) drawn from a seeded generator with valid and invalid values mixed. Each case ends
as one of:

- ``accepted``: ``check_run_config`` returned and an independent oracle (the rules below,
  written from the docs, not from the checker) finds nothing unsupported;
- ``refused``: it raised ``ValueError`` / ``NotImplementedError`` with a one-line message
  that names what is supported (``supported`` / ``must`` / ``known``);
- ``failed``: anything else -- another exception, a multi-line or uninformative refusal, or
  an accepted case the oracle knows is unsupported (the silent-acceptance bug a fuzz is for).

``python -m nemo_ssa.testing.config_fuzz --cases 2000 --out FILE`` writes the counts table;
tests/testing/test_config_fuzz.py runs a few hundred cases in CI.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any, Dict, List, Optional, Tuple

from nemo_ssa.config.check import (CP_ATTENTIONS, CUDA_GRAPH_ATTENTIONS, FULL_GRAPH_MEGATRON, POLICIES, PRECISIONS,
                                   TP_ATTENTIONS, check_run_config, installed_megatron_version)
from nemo_ssa.config.policy import ATTENTIONS

_NAMES = sorted(ATTENTIONS) + ["ssa", "sigmoid", ""]


_BASE_TRAIN = {"tensor_parallel": 1, "context_parallel": 1, "sequence_parallel": False, "num_nodes": 1,
               "num_gpus_per_node": 1, "micro_batch_size": 8, "global_batch_size": 32, "seq_length": 1024,
               "max_steps": 300, "warmup_steps": 20, "lr": 6e-4, "min_lr": 6e-5, "precision": "bf16-mixed",
               "distributed_optimizer": "auto"}
# per field: values to mutate to, valid and invalid mixed
_MUTATIONS = {
    "tensor_parallel": [2, 3, 4, 8, 0], "context_parallel": [2, 3, 4], "sequence_parallel": [True],
    "num_nodes": [2, 4], "num_gpus_per_node": [2, 4, 8, 3], "micro_batch_size": [1, 2, 32, 3, 0],
    "global_batch_size": [8, 64, 12, 7], "seq_length": [32, 1000, 4096, 0], "max_steps": [10, 1500],
    "warmup_steps": [0, 2000, -1], "lr": [3e-4, -1.0, 0.0], "min_lr": [1e-3, 0.0],
    "precision": ["16-mixed", "32", "fp8", "bf16"], "distributed_optimizer": [None, True, False, "yes"],
}


def gen_case(rng: random.Random) -> Dict[str, Any]:
    """One resolved configuration (plain dicts, as ``scripts/pretrain.py`` resolves it): the
    recipe's valid defaults with 0-3 fields mutated, so accepted and refused cases both occur."""
    cuda = rng.random() < 0.6
    train = dict(_BASE_TRAIN)
    if not cuda:
        train.update(precision="32", micro_batch_size=2, global_batch_size=4, seq_length=32)
    for key in rng.sample(sorted(_MUTATIONS), rng.choice([0, 1, 1, 2, 2, 3])):
        train[key] = rng.choice(_MUTATIONS[key])
    cfg = {
        "attention": {"name": rng.choice(_NAMES), "options": {}},
        "policy": rng.choice(list(POLICIES) + list(POLICIES) + ["strict"]),
        "seed": rng.choice([1234, 1234, 0, -5]),
        "train": train,
        "model": {"cpu_arch": {"num_attention_heads": 4, "num_query_groups": 2, "hidden_size": 64}},
        "stop_after": rng.choice([None, None, None, 5, 5000]),
    }
    # drawn last so the cases above stay what they were before the option existed
    cfg["model"]["fused_mlp"] = rng.choice(["auto", "auto", True, False, "true", "yes", None])
    train["val_check_interval"] = rng.choice([None, None, 125, 100000, 0])
    cfg["model"]["cuda_graphs"] = rng.choice(["none", None] * 4 + ["local", "LOCAL", "full", True, "auto"])
    if rng.random() < 0.1:
        cfg["profile"] = {"start": 40, "steps": 2}
    return {"cfg": cfg, "cuda": cuda}


def oracle(case: Dict[str, Any]) -> List[str]:
    """Reasons the configuration is unsupported, from the documented rules alone."""
    cfg, cuda = case["cfg"], case["cuda"]
    t = cfg["train"]
    why = []
    name = cfg["attention"]["name"]
    impl = {"ssa": "ssa_triton" if cuda else "ssa_reference"}.get(name, name)
    if name not in ATTENTIONS and name != "ssa":
        why.append("unknown attention")
    if cfg["policy"] not in POLICIES:
        why.append("unknown policy")
    elif cfg["policy"] == "pinned" and name in ATTENTIONS and ATTENTIONS[name].status != "stable":
        why.append("experimental attention under the pinned policy")
    for key in ("tensor_parallel", "context_parallel", "micro_batch_size", "global_batch_size", "seq_length"):
        if t[key] < 1:
            why.append(f"{key} < 1")
    if t["warmup_steps"] < 0 or t["warmup_steps"] > t["max_steps"]:
        why.append("warmup_steps")
    if t["lr"] < 0 or t["min_lr"] > max(t["lr"], 0):
        why.append("lr")
    if t["precision"] not in PRECISIONS or (not cuda and t["precision"] != "32"):
        why.append("precision")
    if t["distributed_optimizer"] not in (None, "auto", True, False):
        why.append("distributed_optimizer")
    if cfg["seed"] < 0:
        why.append("seed")
    if cfg["stop_after"] is not None and cfg["stop_after"] > t["max_steps"]:
        why.append("stop_after")
    every = t.get("val_check_interval")
    if every is not None and every < 1:
        why.append("val_check_interval")
    world = t["num_nodes"] * t["num_gpus_per_node"]
    tp, cp = t["tensor_parallel"], t["context_parallel"]
    if tp >= 1 and cp >= 1:
        if world % (tp * cp):
            why.append("world % (tp*cp)")
        elif t["micro_batch_size"] >= 1 and t["global_batch_size"] % (t["micro_batch_size"] * (world // (tp * cp))):
            why.append("global batch")
        if tp > 1 and impl in ATTENTIONS and impl not in TP_ATTENTIONS:
            why.append("tp with this attention")
        if cp > 1 and impl in ATTENTIONS and impl not in CP_ATTENTIONS:
            why.append("cp with this attention")
        heads, groups = (24, 8) if cuda else (4, 2)
        if heads % tp or groups % tp:
            why.append("tp does not divide heads")
    if t["sequence_parallel"] and tp == 1:
        why.append("sequence_parallel at tp 1")
    fm = cfg["model"].get("fused_mlp", "auto")
    if fm not in ("auto", "true", "false", True, False, None):
        why.append("fused_mlp value")
    elif fm in (True, "true") and (tp != 1 or t["sequence_parallel"]):
        why.append("fused_mlp=true with tensor parallel")
    cg = cfg["model"].get("cuda_graphs")
    if cg not in (None, "none", "local", "LOCAL", "full", "auto"):  # auto: never refused (it falls back to none)
        why.append("cuda_graphs value")
    elif cg in ("local", "LOCAL", "full"):
        if not cuda:
            why.append("cuda_graphs=local without CUDA")
        if impl not in CUDA_GRAPH_ATTENTIONS:
            why.append("cuda_graphs=local with an attention that has not run under graphs")
        if tp != 1 or cp != 1 or t["sequence_parallel"]:
            why.append("cuda_graphs=local with tensor/context parallel")
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            why.append("cuda_graphs=local with expandable segments")
        if cg == "full" and world != 1:
            why.append("cuda_graphs=full with several processes")
        release = ".".join((installed_megatron_version() or "").split(".")[:2])
        if cg == "full" and cuda and release and release not in FULL_GRAPH_MEGATRON:
            why.append("cuda_graphs=full on a megatron-core whose step NeMo does not wrap")
    return why


_REFUSAL_WORDS = ("supported", "must", "known", "required", "needs", "use attention=", "opt out")


def classify(case: Dict[str, Any]) -> Tuple[str, str]:
    why = oracle(case)
    try:
        check_run_config(case["cfg"], cuda=case["cuda"])
    except (ValueError, NotImplementedError) as e:
        msg = str(e)
        if "\n" in msg.strip() or not any(w in msg for w in _REFUSAL_WORDS):
            return "failed", f"refusal without the supported set: {msg[:160]}"
        return "refused", msg.splitlines()[0][:160]
    except Exception as e:  # noqa: BLE001 - anything else is a failure of the checker
        return "failed", f"crash {type(e).__name__}: {str(e)[:160]}"
    if why:
        return "failed", "accepted an unsupported configuration: " + ", ".join(why)
    return "accepted", ""


def run(cases: int, seed: int = 0) -> Tuple[Dict[str, int], List[Tuple[int, str]]]:
    import logging

    logging.getLogger("nemo_ssa.policy").setLevel(logging.ERROR)  # the ssa -> ssa_reference note, per case
    counts = {"tried": 0, "accepted": 0, "refused": 0, "failed": 0}
    failures = []
    for i in range(cases):
        case = gen_case(random.Random(seed * 1_000_003 + i))
        outcome, detail = classify(case)
        counts["tried"] += 1
        counts[outcome] += 1
        if outcome == "failed":
            failures.append((i, detail))
    return counts, failures


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    counts, failures = run(args.cases, args.seed)
    lines = [f"`python -m nemo_ssa.testing.config_fuzz --cases {args.cases} --seed {args.seed}`", "",
             "| tried | accepted | refused | failed |", "|---|---|---|---|",
             f"| {counts['tried']} | {counts['accepted']} | {counts['refused']} | {counts['failed']} |"]
    lines += [f"- case {i}: {d}" for i, d in failures[:20]]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
