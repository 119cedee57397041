"""Regenerate the CPU golden loss curves (tests/golden/cpu_smoke/) from the README's main job.

    python scripts/make_golden.py            # trains softmax + ssa (train=cpu_smoke), ~2 min

Writes ``<attention>.csv`` (step, loss) per run and ``meta.json`` (corpus hash, versions,
date, the command). ``tests/test_golden.py`` reruns the same job and checks every step
against these values with Megatron's golden rule (relative tolerance, see
tests/golden/README.md). Regenerate only for an intended change of the training
numerics, and say why in the commit.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]
GOLDEN = os.path.join(REPO, "tests", "golden", "cpu_smoke")
ATTENTIONS = ("softmax", "ssa")
SEED = 1234


def story_command(runs_root: str):
    return [sys.executable, os.path.join(REPO, "scripts", "pretrain.py"), f"runs_root={runs_root}",
            "train=cpu_smoke", f"seed={SEED}", "compare_to=[softmax]", "attention=ssa"]


def main() -> int:
    import torch

    with tempfile.TemporaryDirectory(prefix="golden-") as root:
        subprocess.run(story_command(root), cwd=REPO, check=True)
        os.makedirs(GOLDEN, exist_ok=True)
        for name in ATTENTIONS:
            rows = list(csv.DictReader(open(os.path.join(root, f"{name}-s{SEED}", "metrics.csv"))))
            with open(os.path.join(GOLDEN, f"{name}.csv"), "w", newline="") as f:
                w = csv.writer(f, lineterminator="\n")
                w.writerow(["step", "loss"])
                for r in rows:
                    w.writerow([r["step"], r["loss"]])
    from nemo_ssa.data import default_corpus_dir

    manifest = json.load(open(os.path.join(default_corpus_dir(), "manifest.json")))
    meta = {
        "what": "README main job on CPU: train=cpu_smoke, seed 1234, attention=softmax and ssa",
        "command": " ".join(["python scripts/pretrain.py", *story_command("<tmp>")[2:]]),
        "corpus_inputs_sha256": manifest["inputs"]["sha256"],
        "corpus_python": manifest["inputs"].get("python_version"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": datetime.date.today().isoformat(),
    }
    with open(os.path.join(GOLDEN, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(f"[golden] wrote {', '.join(a + '.csv' for a in ATTENTIONS)} and meta.json to {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
