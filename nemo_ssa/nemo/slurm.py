"""A Slurm submission for the pretrain launcher, rendered by nemo-run's own Slurm executor.

    python -m nemo_ssa slurm --nodes 2 --gpus-per-node 8 --account ACCT --partition PART \\
        [--time 04:00:00] [--container-image IMG] [--out job.sbatch] -- attention=ssa_triton train=gpu_9min ...

prints (or writes) the sbatch script nemo-run would submit: ``#SBATCH`` lines for
``--nodes`` x ``--gpus-per-node``, one ``srun`` task per node running ``torchrun --nnodes N
--nproc-per-node G --rdzv-backend c10d`` on the head node's address, ``--kill-on-bad-exit``
(a rank that dies ends the job; resume with ``resume=true``), and ``-m nemo_ssa.cli.pretrain``
(from a checkout, ``PYTHONPATH`` exported to it; an installed package needs nothing) with
``train.num_nodes`` / ``train.num_gpus_per_node`` set to match. Nothing is submitted:
``sbatch job.sbatch`` on the cluster, or pass the same executor to ``nemo_run.run`` there.

The parallel layout in the overrides (``train.tensor_parallel`` etc.) is checked against
the world size before anything is rendered, with the same one-line errors as a launch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import List, Optional, Sequence

__all__ = ["slurm_executor", "render_sbatch", "main"]


def _override(overrides: Sequence[str], key: str, default):
    for o in overrides:
        if o.startswith(f"{key}="):
            return o.split("=", 1)[1]
    return default


def slurm_executor(nodes: int, gpus_per_node: int, account: str, partition: Optional[str] = None,
                   time: str = "04:00:00", job_dir: Optional[str] = None, container_image: Optional[str] = None):
    """nemo-run's ``SlurmExecutor`` for ``nodes`` x ``gpus_per_node`` GPUs with its torchrun
    launcher (one task per node, torchrun starts the node's ranks)."""
    import nemo_run as run
    from nemo_run.core.execution.slurm import SlurmExecutor
    from nemo_run.core.tunnel.client import LocalTunnel

    job_dir = job_dir or tempfile.mkdtemp(prefix="nemo_ssa_slurm_")
    # no code snapshot: the job runs the checkout it was rendered from (a shared filesystem,
    # as the cluster's login and compute nodes have); nemo-run's GitArchivePackager is the
    # alternative for clusters without one
    ex = SlurmExecutor(account=account, partition=partition, nodes=int(nodes), ntasks_per_node=int(gpus_per_node),
                       gpus_per_node=int(gpus_per_node), time=time, exclusive=True, mem="0",
                       container_image=container_image, tunnel=LocalTunnel(job_dir=job_dir), packager=run.Packager())
    ex.launcher = "torchrun"
    ex.job_dir = job_dir
    ex.experiment_dir = job_dir  # nemo-run writes <job>_sbatch.sh there (the cwd if unset)
    ex.experiment_id = "nemo_ssa"
    return ex


def render_sbatch(nodes: int, gpus_per_node: int, overrides: Sequence[str], account: str,
                  partition: Optional[str] = None, time: str = "04:00:00", job_dir: Optional[str] = None,
                  container_image: Optional[str] = None, check: bool = True) -> str:
    """The sbatch script for ``python -m nemo_ssa.cli.pretrain <overrides>`` on ``nodes`` x ``gpus_per_node``."""
    import logging

    import nemo_run as run
    from nemo_run.run.torchx_backend.packaging import package
    from nemo_run.run.torchx_backend.schedulers.slurm import create_scheduler

    if int(nodes) < 1 or int(gpus_per_node) < 1:
        raise ValueError(f"nodes ({nodes}) and gpus_per_node ({gpus_per_node}) must be >= 1")
    overrides = [o for o in overrides if not o.startswith(("train.num_nodes=", "train.num_gpus_per_node="))]
    if check:
        from nemo_ssa.config.check import check_parallel

        check_parallel(attention=_override(overrides, "attention", "ssa"), world=int(nodes) * int(gpus_per_node),
                       tensor_parallel=int(_override(overrides, "train.tensor_parallel", 1)),
                       context_parallel=int(_override(overrides, "train.context_parallel", 1)),
                       sequence_parallel=str(_override(overrides, "train.sequence_parallel", "false")).lower()
                       in ("1", "true"), pipeline_parallel=1)
    args = [*overrides, f"train.num_nodes={int(nodes)}", f"train.num_gpus_per_node={int(gpus_per_node)}"]
    ex = slurm_executor(nodes, gpus_per_node, account, partition, time, job_dir, container_image)
    # a module, so an installed package and a checkout run the same launcher; from a checkout
    # the job puts it on PYTHONPATH (an installed copy is found by the job's python itself)
    from nemo_ssa.cli import child_env

    env = {k: v for k, v in child_env({}).items() if k == "PYTHONPATH"}
    script = run.Script(path="nemo_ssa.cli.pretrain", args=args, entrypoint="python", m=True, env=env)
    quiet = logging.getLogger("nemo_run")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # "Detected Torchrun launcher, setting ntasks_per_node=1"
    stdin = sys.stdin
    try:
        # nemo-run's dry run makes the job directory through invoke, which reads stdin: give
        # it an empty one (CI and pytest have none it can read)
        sys.stdin = open(os.devnull)
        app = package("nemo-ssa-pretrain", script, executor=ex)
        info = create_scheduler(session_name="nemo_ssa")._submit_dryrun(app, ex)
    finally:
        sys.stdin.close()
        sys.stdin = stdin
        quiet.setLevel(level)
    return info.request.materialize()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m nemo_ssa slurm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, required=True)
    ap.add_argument("--account", required=True)
    ap.add_argument("--partition", default=None)
    ap.add_argument("--time", default="04:00:00")
    ap.add_argument("--container-image", default=None)
    ap.add_argument("--job-dir", default=None, help="where nemo-run puts the job's logs and code snapshot")
    ap.add_argument("--out", default=None, help="write the script here (default: print it)")
    a = ap.parse_args(argv)
    try:
        text = render_sbatch(a.nodes, a.gpus_per_node, overrides, a.account, a.partition, a.time,
                             a.job_dir, a.container_image)
    except ValueError as e:
        print(f"nemo_ssa slurm: {e}", file=sys.stderr)
        return 2
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
        print(f"[slurm] wrote {a.out} ({a.nodes} nodes x {a.gpus_per_node} GPUs); submit with: sbatch {a.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
