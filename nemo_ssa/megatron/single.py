"""One process as a megatron world: what a script without a launcher needs before it builds
megatron modules (a process group, megatron's parallel state, seeded RNGs). Under torchrun
the launcher's variables are used as they are."""

from __future__ import annotations

import os
import socket

import torch

__all__ = ["init_single_process"]


def init_single_process(seed: int = 1234, tp: int = 1, cp: int = 1) -> None:
    """Process group (NCCL with CUDA, gloo without; a free local port when no launcher set
    one), megatron's parallel state at ``tp`` x ``cp``, and seeded torch / megatron RNGs
    (on CPU megatron's tracker forks nothing). Idempotent."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    torch.manual_seed(seed)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
