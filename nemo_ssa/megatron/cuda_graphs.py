"""megatron-core's local CUDA graphs (``model.cuda_graphs=local``): what a training path must set.

With ``TransformerConfig.cuda_graph_impl='local'`` every ``TransformerLayer`` gets a
``CudaGraphManager`` (megatron/core/transformer/module.py, ``GraphableMegatronModule``). The
first training fwd+bwd runs eagerly and records each layer's call; ``create_cudagraphs()``
then captures one forward and one backward graph per layer (after ``cuda_graph_warmup_steps``
eager runs inside the capture call) and later steps replay them: the host launches one graph
per layer and direction instead of every kernel, which is what the host-bound micro batch 8
step lacks. Three things are on the caller:

1. the config fields (:func:`cuda_graph_fields`): ``cuda_graph_impl='local'`` -- not the
   deprecated ``enable_cuda_graph=True``, which NeMo 2.7's ``GPTConfig.configure_model``
   answers by asserting Transformer Engine -- and the warm-up runs; ``cuda_graph_scope`` stays
   megatron's default, which means layerwise in every supported version (a string in 0.15, a
   list in 0.16+);
2. a cudagraphable RNG tracker before the layers are built (``CudaGraphManager.__init__``
   asserts it): :func:`use_cudagraphable_rng_tracker`, which keeps the tracker's streams;
3. ``create_cudagraphs()`` after each fwd+bwd: megatron's schedules call it
   (``forward_backward_no_pipelining`` and the pipelined ones, so NeMo's step needs nothing);
   a loop that calls the model itself calls :func:`capture_recorded_graphs`.

What the project supports with it is decided in one place, ``nemo_ssa.config.check.check_cuda_graphs``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

__all__ = ["CUDA_GRAPH_WARMUP_STEPS", "cuda_graph_fields", "use_cudagraphable_rng_tracker",
           "capture_recorded_graphs", "graphs_created", "arm_full_iteration", "order_static_buffer_copies"]

#: eager runs of each layer inside the capture call before it is captured (megatron's default,
#: the value benchmarks/bench_model.py --cuda-graph local ran with), pinned here so that a change
#: of megatron's default does not change a run
CUDA_GRAPH_WARMUP_STEPS = 3


def cuda_graph_fields(cuda_graphs: Any) -> Dict[str, Any]:
    """The ``TransformerConfig`` fields ``model.cuda_graphs`` sets: ``{}`` for ``none`` (megatron's
    defaults, the config as without the option), ``cuda_graph_impl`` and the warm-up runs for
    ``local``. The value is validated (``check_cuda_graphs``); where it may run is the caller's
    check."""
    from nemo_ssa.config.check import check_cuda_graphs

    value = check_cuda_graphs(cuda_graphs)
    if value == "auto":
        raise ValueError("cuda_graphs=auto is decided by nemo_ssa.config.check.resolve_cuda_graphs (it needs the "
                         "device, the world and the attention); pass its answer: none or local")
    if value == "none":
        return {}
    if value == "full":
        # megatron's whole-iteration scope, where no layer takes graphs of its own. Not the
        # deprecated enable_cuda_graph=True NeMo 2.7's MegatronStep reads: megatron 0.15's
        # __post_init__ turns it into cuda_graph_impl='local' and leaves it set, and NeMo's strategy
        # runs __post_init__ a second time (set_model_parallel_attributes), which then asserts
        # "Do not use enable_cuda_graph ... with cuda_graph_impl". arm_full_iteration sets it on
        # the live config after that second run.
        return {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}
    return {"cuda_graph_impl": "local", "cuda_graph_warmup_steps": CUDA_GRAPH_WARMUP_STEPS}


def arm_full_iteration(config) -> bool:
    """Set ``enable_cuda_graph`` on a config whose scope is ``full_iteration``: the flag NeMo 2.7's
    ``MegatronStep.forward_backward_func`` reads to wrap megatron's schedule in
    ``FullCudaGraphWrapper``. Called once the strategy has re-run the config's ``__post_init__``
    (Lightning's ``setup`` hook, ``CudaGraphRNGCallback``); a later ``__post_init__`` would refuse
    the flag beside ``cuda_graph_impl``. Returns whether the config was armed."""
    if getattr(config, "cuda_graph_scope", None) != "full_iteration":
        return False
    config.enable_cuda_graph = True
    order_static_buffer_copies()
    return True


#: the line megatron-core 0.17 added to ``StaticBufferLoader.__call__`` (before each copy)
_WAIT = "self.stream.wait_stream(torch.cuda.current_stream())"
_ORIGINAL_LOADER_CALL: Dict[str, Any] = {}


def _ordered_loader_call(self, inputs, stage, microbatch):
    """megatron's ``StaticBufferLoader.__call__`` after its side stream waits for the current one."""
    self.stream.wait_stream(torch.cuda.current_stream())
    return _ORIGINAL_LOADER_CALL["call"](self, inputs, stage, microbatch)


def order_static_buffer_copies() -> str:
    """Make megatron-core 0.15/0.16's whole-iteration graph copy each batch into its static
    input buffers only after the work already queued: what megatron 0.17 does.

    ``StaticBufferLoader`` copies the next batch into the buffers the captured graph reads on a
    stream of its own, and before 0.17 that stream waits for nothing: neither for the graph
    replay of the step before, still reading the buffers, nor for the host-to-device copy of
    the batch it copies from. A per-step device sync (Lightning's progress-bar values) had kept
    the host from running ahead, which hid it; without one, the next batch overwrote the tokens
    and labels under the running step (the losses left the synced runs' from step 3,
    held-out 7.08 against 6.66 at step 60; docs/results/2026-12-03-pbar-sync). Returns what it
    decided; patches megatron's class at most once."""
    try:
        import inspect

        from megatron.core import full_cuda_graph
    except ImportError as e:
        return f"megatron.core.full_cuda_graph is not importable ({e})"
    loader = full_cuda_graph.StaticBufferLoader
    if not isinstance(loader, type):
        return f"megatron's StaticBufferLoader is {loader!r}, not the class this was written against: left as it is"
    current = loader.__call__
    if current is _ordered_loader_call:
        return "megatron's static-buffer copies wait for the queued work (patched)"
    try:
        source = inspect.getsource(current)
    except (OSError, TypeError):
        source = ""
    if _WAIT in source:
        return "megatron's static-buffer copies wait for the queued work (its own)"
    _ORIGINAL_LOADER_CALL["call"] = current
    loader.__call__ = _ordered_loader_call
    return "megatron's static-buffer copies wait for the queued work (patched: megatron < 0.17 did not)"


def use_cudagraphable_rng_tracker(generator: Optional[torch.Generator] = None) -> bool:
    """Replace megatron's CUDA RNG tracker by its cudagraphable variant with the same streams.

    NeMo seeds megatron's tracker itself (``nemo.lightning.megatron_init._set_random_seed``:
    ``model_parallel_cuda_manual_seed(seed)``, with no way to ask for the cudagraphable
    variant), so re-seeding would have to repeat NeMo's seed. Instead each named state of the
    tracker becomes a graph-safe generator (a clone of ``generator``'s state, by default the
    current CUDA device's generator, as megatron's ``add`` makes them) holding that same state:
    the weights initialised afterwards and any dropout draw the numbers they drew before.

    Returns True when it replaced the tracker; False when the tracker already suits megatron's
    graphs (cudagraphable, inference or Transformer Engine's) or was never initialised.
    """
    from megatron.core.tensor_parallel import random as mrandom

    if not mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED:
        return False
    old = mrandom.get_cuda_rng_tracker()
    if type(old) is not mrandom.CudaRNGStatesTracker or old.use_cudagraphable_rng or old.is_inference_rng_tracker:
        return False
    if generator is None:
        generator = torch.cuda.default_generators[torch.cuda.current_device()]
    states, seeds = old.get_states(), set(old.seeds_)
    mrandom.initialize_rng_tracker(use_cudagraphable_rng=True, force_reset=True)
    new = mrandom.get_cuda_rng_tracker()
    graph_safe = {}
    for name, state in states.items():
        g = generator.clone_state()
        g.set_state(state)
        graph_safe[name] = g
    new.set_states(graph_safe)
    new.seeds_ = seeds  # megatron's bookkeeping: a later add() of a used seed still fails
    return True


def capture_recorded_graphs(config) -> None:
    """What megatron's schedules do after a fwd+bwd with local CUDA graphs: capture the graphs
    the layers recorded (after the first step; a no-op afterwards). For loops that call the
    model themselves (scripts/train_megatron_core.py); never call it after a schedule, which
    has."""
    if getattr(config, "cuda_graph_impl", "none") == "local":
        from megatron.core.transformer.cuda_graphs import create_cudagraphs

        create_cudagraphs()


def graphs_created() -> bool:
    """Whether megatron has captured the layers' graphs (``local``) or the training iteration's
    (``full``) in this process: what a run reports beside its losses, so that equal losses with
    and without graphs cannot hide graphs that never ran (a 20-step A/B whose losses matched to
    the last digit had no other evidence)."""
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    if _CudagraphGlobalRecord.cudagraph_created:
        return True
    try:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    except ImportError:
        return False
    return FullCudaGraphWrapper.cuda_graph.get("training") is not None
