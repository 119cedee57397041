"""``model.cuda_graphs`` (nemo_ssa/megatron/cuda_graphs.py, nemo_ssa/config/check.py) on CPU.

Nothing here runs a graph (they need a GPU). What is checked:

- the option: values, and every refusal of ``check_cuda_graphs`` (no CUDA, an attention whose
  layers never ran under graphs, TP / CP / SP, expandable segments), through the
  run-config check and the launcher as a user meets them;
- the plumbing: ``local`` puts ``cuda_graph_impl='local'`` and the warm-up runs on the recipe's
  TransformerConfig (built: megatron accepts them) and asks for the cudagraphable RNG tracker
  (the callback); ``none`` leaves the recipe exactly as without the option;
- the tracker swap keeps every stream, on CPU generators;
- the contracts this rests on, read from the installed megatron-core, Lightning and NeMo:
  the layer's graph manager asserts the cudagraphable tracker, megatron's no-pipelining
  schedule captures the graphs itself, and Lightning calls a callback's ``setup`` after NeMo
  seeded the tracker and before the model is built.
"""

from __future__ import annotations

import inspect
import os
import re
import types
import warnings

import pytest
import torch

from nemo_ssa.config.check import (CUDA_GRAPH_ATTENTIONS, CUDA_GRAPHS_MEGATRON, check_cuda_graphs, check_run_config,
                                   resolve_cuda_graphs)
from nemo_ssa.megatron.cuda_graphs import (CUDA_GRAPH_WARMUP_STEPS, capture_recorded_graphs, cuda_graph_fields,
                                           use_cudagraphable_rng_tracker)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OK = dict(cuda=True, attention="ssa_triton", env={})


# ----------------------------------------------------------------------------- the option


def test_values():
    assert [check_cuda_graphs(v, **OK) for v in ("none", None, "None", "local", " LOCAL ", "Auto", "Full")] == [
        "none", "none", "none", "local", "local", "auto", "full"]
    for bad in ("full_iteration", "transformer_engine", True, False, 1):
        with pytest.raises(ValueError,
                           match=r"model.cuda_graphs=.* is not supported \(supported: auto, none, local, full\)"):
            check_cuda_graphs(bad, **OK)


@pytest.mark.parametrize("kw, error, says", [
    (dict(cuda=False), ValueError, "needs a CUDA device"),
    (dict(attention="softmax"), NotImplementedError, "attention=softmax is not supported .*softmax_triton, ssa_triton"),
    (dict(attention="ssa_reference"), NotImplementedError, "ssa_reference is not supported"),
    (dict(attention="nsa"), NotImplementedError, "nsa is not supported"),
    (dict(tensor_parallel=2), NotImplementedError, "tensor_parallel=2.*supported: tensor and context parallel 1"),
    (dict(context_parallel=2), NotImplementedError, "context_parallel=2"),
    (dict(sequence_parallel=True), NotImplementedError, "sequence_parallel=True"),
    (dict(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}), ValueError, "expandable_segments:True"),
])
@pytest.mark.parametrize("value", ["local", "full"])
def test_local_refuses_what_it_cannot_run(kw, error, says, value):
    with pytest.raises(error, match=says):
        check_cuda_graphs(value, **{**OK, **kw})
    assert check_cuda_graphs("none", **{**OK, **kw}) == "none"  # none runs everywhere
    assert check_cuda_graphs("auto", **{**OK, **kw}) == "auto"  # auto falls back to none there


@pytest.mark.parametrize("kw, says", [
    (dict(world=2), "full with 2 processes is not supported .*supported: full on one GPU; local with data parallel"),
    (dict(megatron_version="0.16.1"), "megatron-core 0.16.1 is not supported .*0.15.x"),
])
def test_full_refuses_several_processes_and_other_megatrons(kw, says):
    from nemo_ssa.config.check import resolve_cuda_graphs

    args = dict(cuda=True, attention="ssa", world=1, megatron_version="0.15.3")
    assert resolve_cuda_graphs("full", **args) == ("full", None)
    assert resolve_cuda_graphs("full", **{**args, "megatron_version": None}) == ("full", None)  # not known here
    with pytest.raises(NotImplementedError, match=says):
        resolve_cuda_graphs("full", **{**args, **kw})
    # auto never picks full
    assert resolve_cuda_graphs("auto", **args)[0] == "local"
    assert resolve_cuda_graphs("auto", **{**AUTO, **kw})[0] == "none"


#: where ``auto`` is local: everything the checks before the default covered
AUTO = dict(OK, world=1, megatron_version="0.15.3")


def test_auto_is_local_only_where_the_default_was_checked():
    assert CUDA_GRAPHS_MEGATRON == ("0.15",)  # widening it is a GPU run's decision (graphs_default.py)
    value, why = resolve_cuda_graphs("auto", **AUTO)
    assert value == "local" and "one GPU, attention=ssa_triton, megatron-core 0.15.3" in why
    assert resolve_cuda_graphs("auto", **{**AUTO, "attention": "ssa"})[0] == "local"  # the pinned kernel
    for kw, says in [(dict(cuda=False), "no CUDA device"),
                     (dict(cuda=None), "not known where the recipe is built"),
                     (dict(attention="softmax"), "attention=softmax has not run under graphs"),
                     (dict(world=2), "2 processes: data parallel with graphs has not run"),
                     (dict(tensor_parallel=2), "tensor / context / sequence parallel"),
                     (dict(megatron_version="0.16.1"), "megatron-core 0.16.1: graphs have run through NeMo on 0.15.x"),
                     (dict(megatron_version=None), r"megatron-core \(unknown\)"),
                     (dict(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}), "expandable_segments")]:
        value, why = resolve_cuda_graphs("auto", **{**AUTO, **kw})
        assert value == "none", kw
        assert re.search(says, why), (kw, why)
    # none and local are checked, not decided: no reason to print
    assert resolve_cuda_graphs("none", **AUTO) == ("none", None)
    assert resolve_cuda_graphs("local", **{**AUTO, "world": 4, "megatron_version": "0.16.1"}) == ("local", None)
    with pytest.raises(NotImplementedError, match="attention=softmax is not supported"):
        resolve_cuda_graphs("local", **{**AUTO, "attention": "softmax"})


def test_local_takes_the_attentions_that_ran_under_graphs():
    # widening this is a GPU run's decision (bench_model --cuda-graph local, then the NeMo step)
    assert CUDA_GRAPH_ATTENTIONS == ("softmax_triton", "ssa_triton")
    for name in ("softmax_triton", "ssa_triton", "ssa"):  # ssa: the pinned kernel (graphs run on CUDA)
        assert check_cuda_graphs("local", **{**OK, "attention": name}) == "local"
    # not known where it runs (a recipe built on a login node), other allocator settings
    assert check_cuda_graphs("local", attention="ssa", env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) \
        == "local"


def _run_config(**model):
    return {"attention": {"name": "ssa"}, "policy": "pinned", "seed": 1234,
            "train": {"micro_batch_size": 8, "global_batch_size": 8, "precision": "bf16-mixed"},
            "model": model}


def test_run_config_check(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    check_run_config(_run_config(cuda_graphs="local"), cuda=True)
    on_cpu = {"micro_batch_size": 2, "global_batch_size": 2, "precision": "32"}
    check_run_config({**_run_config(), "train": on_cpu}, cuda=False)  # unset: none
    with pytest.raises(ValueError, match="model.cuda_graphs=local needs a CUDA device"):
        check_run_config({**_run_config(cuda_graphs="local"), "train": on_cpu}, cuda=False)
    cfg = _run_config(cuda_graphs="local")
    cfg["train"]["tensor_parallel"], cfg["train"]["num_gpus_per_node"] = 2, 2
    with pytest.raises(NotImplementedError, match="tensor_parallel=2"):
        check_run_config(cfg, cuda=True)
    # a profile runs under graphs (without its module ranges: ProfilerCallback(module_ranges=False))
    check_run_config({**_run_config(cuda_graphs="local"), "profile": {"start": 40}}, cuda=True)
    check_run_config({**_run_config(cuda_graphs="none"), "profile": {"start": 40}}, cuda=True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments"):
        check_run_config(_run_config(cuda_graphs="local"), cuda=True)


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(REPO, "nemo_ssa", "configs"), version_base=None):
        return compose("config", overrides=list(overrides))


def test_launcher_default_is_auto_and_local_is_refused_on_cpu_in_one_line():
    from nemo_ssa.cli import pretrain

    assert _compose().model.cuda_graphs == "auto"
    pretrain._check_config(_compose("train=cpu_smoke"), cuda=False)
    with pytest.raises(SystemExit, match=r"^\[pretrain\] invalid configuration: model.cuda_graphs=local needs a CUDA"):
        pretrain._check_config(_compose("train=cpu_smoke", "model.cuda_graphs=local"), cuda=False)


# ----------------------------------------------------------------------------- the plumbing


def test_fields_are_ones_the_installed_megatron_builds():
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert cuda_graph_fields("none") == {} and cuda_graph_fields(None) == {}
    assert cuda_graph_fields("local") == {"cuda_graph_impl": "local",
                                          "cuda_graph_warmup_steps": CUDA_GRAPH_WARMUP_STEPS}
    small = dict(num_layers=1, hidden_size=32, num_attention_heads=4)
    cfg = TransformerConfig(**small, **cuda_graph_fields("local"))  # a misspelt field is a TypeError here
    assert (cfg.cuda_graph_impl, cfg.cuda_graph_warmup_steps, cfg.enable_cuda_graph) == ("local", 3, False)
    # megatron's own refusal, at config time: activation recompute (the recipe sets none)
    with pytest.raises((ValueError, AssertionError), match="recomput"):
        TransformerConfig(**small, **cuda_graph_fields("local"), recompute_granularity="full",
                          recompute_method="uniform", recompute_num_layers=1)
    with pytest.raises(ValueError, match="supported: auto, none, local, full"):
        cuda_graph_fields("on")
    # full: megatron's whole-iteration scope, where no layer takes graphs of its own
    assert cuda_graph_fields("full") == {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}
    full = TransformerConfig(**small, **cuda_graph_fields("full"))
    assert (full.cuda_graph_impl, full.cuda_graph_scope, full.enable_cuda_graph) == ("local", "full_iteration", False)


def test_full_survives_nemos_second_post_init_and_is_armed_after_it(monkeypatch):
    """NeMo's strategy re-runs the config's ``__post_init__`` (set_model_parallel_attributes, in
    ``strategy.connect``); megatron 0.15 then refuses ``enable_cuda_graph`` beside
    ``cuda_graph_impl`` -- the first full run on an H200 died there. The fields must pass that
    second run; the callback's ``setup`` (after connect) arms NeMo's flag; none and local are
    left unarmed."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nemo.lightning._strategy_lib import set_model_parallel_attributes

    from nemo_ssa.megatron.cuda_graphs import arm_full_iteration
    from nemo_ssa.nemo.callbacks import CudaGraphRNGCallback

    small = dict(num_layers=1, hidden_size=32, num_attention_heads=4)
    parallelism = types.SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=1)
    for value in ("full", "local"):
        cfg = TransformerConfig(**small, **cuda_graph_fields(value))
        model = types.SimpleNamespace(config=cfg, configure_model=lambda: None)
        assert set_model_parallel_attributes(model, parallelism) is cfg  # the second __post_init__, NeMo's own
        armed = []
        import nemo_ssa.megatron.cuda_graphs as cg

        monkeypatch.setattr(cg, "use_cudagraphable_rng_tracker", lambda: armed.append("tracker"))  # a CUDA tracker
        CudaGraphRNGCallback().setup(types.SimpleNamespace(global_rank=0), model, "fit")
        assert armed == ["tracker"]
        assert cfg.enable_cuda_graph is (value == "full"), value
        assert (cfg.cuda_graph_impl, cfg.cuda_graph_scope) == ("local", "full_iteration" if value == "full" else
                                                               TransformerConfig(**small).cuda_graph_scope)
    # armed, the config would not survive a third __post_init__: the reason the flag goes on last
    with pytest.raises(AssertionError, match="Do not use enable_cuda_graph"):
        cfg = TransformerConfig(**small, **cuda_graph_fields("full"))
        arm_full_iteration(cfg)
        cfg.__post_init__()
    assert arm_full_iteration(TransformerConfig(**small)) is False


def test_nemos_step_wraps_the_schedule_in_megatrons_full_graph(monkeypatch):
    """NeMo 2.7's MegatronStep, given the config full sets (armed), runs megatron's schedule through
    FullCudaGraphWrapper (and the config local sets, through the schedule itself)."""
    from nemo_ssa.megatron.cuda_graphs import arm_full_iteration
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nemo.lightning.megatron_parallel import MegatronStep

    import megatron.core.pipeline_parallel.schedules as schedules

    def schedule(**kwargs):  # megatron's, as get_forward_backward_func picks it (no parallel state here)
        return kwargs

    monkeypatch.setattr(schedules, "get_forward_backward_func", lambda: schedule)
    import megatron.core.full_cuda_graph as full_cuda_graph

    monkeypatch.setattr(full_cuda_graph, "StaticBufferLoader", lambda: None)  # makes a CUDA stream
    small = dict(num_layers=1, hidden_size=32, num_attention_heads=4)
    for value, wrapped in (("full", True), ("local", False), ("none", False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            cfg = TransformerConfig(**small, **cuda_graph_fields(value))
        arm_full_iteration(cfg)  # what CudaGraphRNGCallback.setup does, after the strategy's __post_init__
        step = MegatronStep.__new__(MegatronStep)
        step.pipeline = types.SimpleNamespace(pipeline=types.SimpleNamespace(config=cfg))  # step.model
        func = step.forward_backward_func
        assert isinstance(func, FullCudaGraphWrapper) is wrapped, value
        assert (func.forward_backward_func if wrapped else func) is schedule


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    from recipes import nemotron_114m

    d = str(tmp_path_factory.mktemp("cg"))
    return {v: nemotron_114m.pretrain_recipe(dir=d, attention="ssa", max_steps=2, **kw)
            for v, kw in (("default", {}), ("none", {"cuda_graphs": "none"}), ("local", {"cuda_graphs": "local"}),
                          ("full", {"cuda_graphs": "full"}))}


def _callbacks(recipe):
    return [c.__fn_or_cls__.__name__ for c in recipe.trainer.callbacks or []]


def test_recipe_local_sets_megatrons_fields_and_asks_for_the_cudagraphable_tracker(recipes):
    import fiddle as fdl

    cfg = fdl.build(recipes["local"].model.config)  # the TransformerConfig NeMo builds the model from
    assert (cfg.cuda_graph_impl, cfg.cuda_graph_warmup_steps, cfg.enable_cuda_graph) == ("local", 3, False)
    assert cfg.recompute_granularity is None and not cfg.cpu_offloading  # what megatron refuses with graphs
    assert _callbacks(recipes["local"]) == _callbacks(recipes["none"]) + ["CudaGraphRNGCallback"]


def test_recipe_none_is_the_recipe_without_the_option(recipes, tmp_path, monkeypatch):
    from nemo_run.core.serialization.yaml import YamlSerializer

    from recipes import nemotron_114m

    ser = YamlSerializer().serialize
    assert ser(recipes["none"]) == ser(recipes["default"])
    assert "cuda_graph_impl" not in recipes["none"].model.config.__arguments__
    assert "CudaGraphRNGCallback" not in _callbacks(recipes["none"])
    # the recipe as it was before the option: the same with the option's step taken out
    monkeypatch.setattr(nemotron_114m, "apply_cuda_graphs", lambda recipe, cuda_graphs="none": None)
    without = nemotron_114m.pretrain_recipe(dir=recipes["none"].log.log_dir, attention="ssa", max_steps=2)
    assert ser(without) == ser(recipes["none"])
    # and local differs from none by the two fields and the callback alone
    diff = [ln for ln in ser(recipes["local"]).splitlines() if ln not in set(ser(recipes["none"]).splitlines())]
    assert sorted(s.strip() for s in diff) == ["- _target_: nemo_ssa.nemo.callbacks.CudaGraphRNGCallback",
                                               "cuda_graph_impl: local", "cuda_graph_warmup_steps: 3"]
    # full: NeMo's two fields for the whole-iteration graph and the same callback
    diff = [ln for ln in ser(recipes["full"]).splitlines() if ln not in set(ser(recipes["none"]).splitlines())]
    assert sorted(s.strip() for s in diff) == ["- _target_: nemo_ssa.nemo.callbacks.CudaGraphRNGCallback",
                                               "cuda_graph_impl: local", "cuda_graph_scope: full_iteration"]


@pytest.mark.parametrize("kw, says", [
    (dict(attention="softmax"), "attention=softmax is not supported"),
    (dict(tensor_parallel=2, num_gpus_per_node=2), "tensor_parallel=2"),
    (dict(cuda_graphs="full_iteration"), "supported: auto, none, local, full"),
    (dict(cuda_graphs="full", num_gpus_per_node=2), "full with 2 processes is not supported"),
])
def test_recipe_refuses_before_building(kw, says, tmp_path):
    from recipes import nemotron_114m

    kw = {"attention": "ssa", "cuda_graphs": "local", **kw}
    with pytest.raises((ValueError, NotImplementedError), match=says):
        nemotron_114m.pretrain_recipe(dir=str(tmp_path), max_steps=2, **kw)


def test_launcher_hands_the_field_to_the_recipe(tmp_path):
    from omegaconf import OmegaConf

    from nemo_ssa.cli import pretrain

    gpu = ("train=gpu_9min", "train.global_batch_size=32", "attention=ssa_triton", f"run_dir={tmp_path}")
    cfg = _compose(*gpu, "model.cuda_graphs=local")
    recipe, resolved = pretrain.build_recipe(cfg, cfg.train, "/data/none", "/tok/none", str(tmp_path))
    assert resolved.name == "ssa_triton" and recipe.model.config.cuda_graph_impl == "local"
    assert "CudaGraphRNGCallback" in _callbacks(recipe)
    none = _compose(*gpu, "model.cuda_graphs=none")
    recipe, _ = pretrain.build_recipe(none, none.train, "/data/none", "/tok/none", str(tmp_path))
    assert "cuda_graph_impl" not in recipe.model.config.__arguments__
    assert OmegaConf.to_container(none)["model"]["cuda_graphs"] == "none"  # what config.yaml records


@pytest.mark.parametrize("version, extra, want, says", [
    ("0.15.3", (), "local", r"model.cuda_graphs=auto -> local: one GPU, attention=ssa_triton, megatron-core 0.15.3"),
    ("0.16.1", (), "none", r"model.cuda_graphs=auto -> none: megatron-core 0.16.1: graphs have run through NeMo on 0.15.x only"),
    ("0.15.3", ("train.num_gpus_per_node=2",), "none", r"model.cuda_graphs=auto -> none: 2 processes"),
    ("0.15.3", ("attention=softmax",), "none", r"model.cuda_graphs=auto -> none: attention=softmax has not run under graphs"),
])
def test_launcher_decides_auto_before_the_identity_and_says_so(tmp_path, monkeypatch, capsys, version, extra, want,
                                                               says):
    from omegaconf import OmegaConf

    from nemo_ssa.cli import pretrain

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(pretrain, "_megatron_version", lambda: version)
    cfg = _compose("train=gpu_9min", "train.global_batch_size=32", "attention=ssa", f"run_dir={tmp_path}", *extra)
    assert cfg.model.cuda_graphs == "auto"
    assert pretrain._decide_cuda_graphs(cfg, pretrain._train_cfg(cfg, True), cuda=True) == want
    assert cfg.model.cuda_graphs == want  # config.yaml and the identity hold what ran
    assert re.search(r"^\[pretrain\] " + says, capsys.readouterr().out, re.M)
    # the identity of an auto run that decided none is a none run's: finished runs are still reused
    if want == "none":
        explicit = _compose("train=gpu_9min", "train.global_batch_size=32", "attention=ssa", f"run_dir={tmp_path}",
                            *extra, "model.cuda_graphs=none")
        assert pretrain._identity(OmegaConf.to_container(cfg)) == pretrain._identity(OmegaConf.to_container(explicit))


def test_launcher_on_cpu_decides_none_silently(tmp_path, capsys):
    from nemo_ssa.cli import pretrain

    cfg = _compose("train=cpu_smoke", f"run_dir={tmp_path}")
    assert pretrain._decide_cuda_graphs(cfg, pretrain._train_cfg(cfg, False), cuda=False) == "none"
    assert cfg.model.cuda_graphs == "none" and "cuda_graphs" not in capsys.readouterr().out


def test_recipe_auto_is_none_where_the_device_is_not_known(recipes, tmp_path):
    from nemo_run.core.serialization.yaml import YamlSerializer

    from recipes import nemotron_114m

    auto = nemotron_114m.pretrain_recipe(dir=recipes["none"].log.log_dir, attention="ssa", max_steps=2,
                                         cuda_graphs="auto")
    assert YamlSerializer().serialize(auto) == YamlSerializer().serialize(recipes["none"])
    with pytest.raises(ValueError, match="auto is decided by nemo_ssa.config.check.resolve_cuda_graphs"):
        cuda_graph_fields("auto")


@pytest.mark.parametrize("names, overrides, want_over, said", [
    (["softmax", "ssa"], [], ["model.cuda_graphs=none"], "softmax has not run under graphs"),
    (["softmax", "ssa"], ["model.cuda_graphs=auto", "x=1"], ["x=1", "model.cuda_graphs=none"], "softmax"),
    (["softmax_triton", "ssa"], [], [], None),  # every one graph-capable: each run decides
    (["softmax", "ssa"], ["model.cuda_graphs=local"], ["model.cuda_graphs=local"], None),  # asked for: refused later
    (["softmax", "ssa"], ["model.cuda_graphs=none"], ["model.cuda_graphs=none"], None),
])
def test_compared_runs_take_graphs_all_or_none(names, overrides, want_over, said):
    from nemo_ssa.cli import compared_cuda_graphs

    got, why = compared_cuda_graphs(names, overrides)
    assert got == want_over
    assert (why is None) if said is None else (said in why and why.startswith("model.cuda_graphs=auto -> none"))


def test_capture_is_called_only_for_local_graphs(monkeypatch):
    import types

    import megatron.core.transformer.cuda_graphs as cg

    calls = []
    monkeypatch.setattr(cg, "create_cudagraphs", lambda: calls.append(1))
    capture_recorded_graphs(types.SimpleNamespace(cuda_graph_impl="none"))
    capture_recorded_graphs(types.SimpleNamespace())
    assert calls == []
    capture_recorded_graphs(types.SimpleNamespace(cuda_graph_impl="local"))
    assert calls == [1]


# ----------------------------------------------------------------------------- the RNG tracker


@pytest.fixture
def plain_tracker(monkeypatch):
    """megatron's tracker as NeMo leaves it (byte-tensor states from seeds), on CPU generators;
    the module globals are restored afterwards. A CPU build of torch lacks the graph API the
    cudagraphable tracker checks for (nothing here captures a graph): a stand-in is set."""
    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.setattr(torch.cuda.CUDAGraph, "register_generator_state", lambda self, g: None, raising=False)

    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    mrandom.initialize_rng_tracker()
    tracker = mrandom.get_cuda_rng_tracker()
    seeds = {"data-parallel-rng": 1234, "model-parallel-rng": 1234 + 2718, "expert-parallel-rng": 1234 + 1024}
    tracker.set_states({k: torch.Generator().manual_seed(s).get_state() for k, s in seeds.items()})
    tracker.seeds_ = set(seeds.values())
    return mrandom, seeds


def test_tracker_swap_keeps_every_stream(plain_tracker):
    mrandom, seeds = plain_tracker
    torch.rand(3, generator=None)  # the default generator is not the tracker's
    assert use_cudagraphable_rng_tracker(generator=torch.Generator()) is True
    tracker = mrandom.get_cuda_rng_tracker()
    assert tracker.use_cudagraphable_rng and tracker.seeds_ == set(seeds.values())
    for name, seed in seeds.items():
        g = tracker.get_states()[name]
        assert isinstance(g, torch.Generator)
        assert torch.equal(torch.rand(5, generator=g), torch.rand(5, generator=torch.Generator().manual_seed(seed)))
    states = tracker.get_states()
    assert use_cudagraphable_rng_tracker(generator=torch.Generator()) is False  # already cudagraphable
    assert mrandom.get_cuda_rng_tracker() is tracker and tracker.get_states() == states
    with pytest.raises(Exception, match="seed 1234 already exists"):
        tracker.add("again", 1234)  # megatron's bookkeeping came along


def test_tracker_swap_leaves_inference_and_uninitialised_trackers(monkeypatch):
    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    assert use_cudagraphable_rng_tracker(generator=torch.Generator()) is False
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # the CPU paths' tracker
    tracker = mrandom.get_cuda_rng_tracker()
    assert use_cudagraphable_rng_tracker(generator=torch.Generator()) is False
    assert mrandom.get_cuda_rng_tracker() is tracker


def test_callback_swaps_the_tracker_in_setup(monkeypatch):
    import nemo_ssa.megatron.cuda_graphs as mcg
    from nemo_ssa.nemo.callbacks import CudaGraphRNGCallback

    calls = []
    monkeypatch.setattr(mcg, "use_cudagraphable_rng_tracker", lambda: calls.append(1) or True)
    CudaGraphRNGCallback().setup(None, None, "fit")
    assert calls == [1]


# ----------------------------------------------------------------------------- the contracts


def test_installed_megatron_asserts_the_tracker_and_its_schedule_captures():
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import module
    from megatron.core.transformer.cuda_graphs import CudaGraphManager

    assert "use_cudagraphable_rng" in inspect.getsource(CudaGraphManager.__init__)
    assert "CudaGraphManager(config" in inspect.getsource(module.GraphableMegatronModule.__init__)
    # NeMo's step runs megatron's schedule (PP 1: forward_backward_no_pipelining), which captures:
    # the recipe must not call create_cudagraphs() a second time
    assert "create_cudagraphs()" in inspect.getsource(schedules.forward_backward_no_pipelining)
    assert schedules.get_forward_backward_func.__module__ == schedules.__name__


def test_lightning_calls_setup_after_nemo_seeded_and_before_the_model_is_built():
    from lightning.pytorch.trainer.trainer import Trainer
    from nemo.lightning.pytorch.strategies.megatron_strategy import MegatronStrategy

    run = inspect.getsource(Trainer._run)
    env, setup, build = (run.index(s) for s in ("strategy.setup_environment()", "_call_setup_hook(self)",
                                                "_call_configure_model(self)"))
    assert env < setup < build
    # NeMo seeds megatron's tracker (init_parallel_ranks -> model_parallel_cuda_manual_seed) in
    # setup_distributed, which the DDP strategy's setup_environment runs
    assert "setup_parallel_ranks(self)" in inspect.getsource(MegatronStrategy.setup_distributed)


def test_graphs_created_reads_megatrons_record(monkeypatch):
    """What train_megatron_core.py reports beside its losses: megatron's own flag, set when
    ``create_cudagraphs`` has captured the layers."""
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    from nemo_ssa.megatron.cuda_graphs import graphs_created

    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    monkeypatch.setattr(_CudagraphGlobalRecord, "cudagraph_created", False)
    monkeypatch.setattr(FullCudaGraphWrapper, "cuda_graph", {"training": None, "validation": None})
    assert graphs_created() is False
    monkeypatch.setattr(_CudagraphGlobalRecord, "cudagraph_created", True)
    assert graphs_created() is True
    # full: the training iteration's graph, captured by megatron's wrapper
    monkeypatch.setattr(_CudagraphGlobalRecord, "cudagraph_created", False)
    monkeypatch.setattr(FullCudaGraphWrapper, "cuda_graph", {"training": object(), "validation": None})
    assert graphs_created() is True


def test_story_runs_take_graphs_all_or_none(monkeypatch, capsys):
    from nemo_ssa.cli import pretrain

    cfg = _compose("train=gpu_9min")  # compare_to: [softmax] -- the README's story
    names = pretrain._story_names(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pretrain._story_cuda_graphs(cfg, names, ["seed=1"]) == ["seed=1"]  # each CPU run decides none
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pretrain._story_cuda_graphs(cfg, names, ["seed=1"]) == ["seed=1", "model.cuda_graphs=none"]
    assert "[pretrain] model.cuda_graphs=auto -> none for every run: softmax has not run" in capsys.readouterr().out
    triton = _compose("train=gpu_9min", "compare_to=[softmax_triton]")
    assert pretrain._story_cuda_graphs(triton, pretrain._story_names(triton), ["seed=1"]) == ["seed=1"]


def test_launcher_callbacks_print_the_progress_themselves(tmp_path):
    """The launcher's GPU path: Lightning's progress bar off and NeMo's TimingCallback out (both
    log or read metrics through Lightning every step), the metrics log printing the progress."""
    from nemo_ssa.cli import pretrain

    cfg = _compose("train=gpu_9min", "train.global_batch_size=32", "attention=ssa_triton", f"run_dir={tmp_path}",
                   "model.cuda_graphs=none")
    recipe, resolved = pretrain.build_recipe(cfg, cfg.train, "/data/none", "/tok/none", str(tmp_path))
    assert "TimingCallback" in _callbacks(recipe)  # the recipe alone keeps NeMo's defaults
    pretrain.launcher_callbacks(cfg, cfg.train, recipe, resolved, str(tmp_path))
    names = _callbacks(recipe)
    assert "TimingCallback" not in names and recipe.trainer.enable_progress_bar is False
    metrics = [c for c in recipe.trainer.callbacks if c.__fn_or_cls__.__name__ == "MetricsCallback"]
    assert len(metrics) == 1 and metrics[0].progress is True and metrics[0].flush_every == 10
    assert names == ["SyncFreeLossReductionCallback", "LightningLogCallback", "MetricsCallback",
                     "ResumeCadenceCallback", "AttentionWarmupCallback"]  # the first two are the recipe's
    log = [c for c in recipe.trainer.callbacks if c.__fn_or_cls__.__name__ == "LightningLogCallback"]
    assert log[0].progress_bar_values == "drop"  # train.progress_bar_values' default: no bar, no per-batch read


def test_train_progress_bar_values_reaches_the_callback_and_is_checked(tmp_path):
    from nemo_ssa.cli import pretrain
    from nemo_ssa.config.check import check_run_config

    cfg = _compose("train=gpu_9min", "train.global_batch_size=32", "attention=ssa_triton", f"run_dir={tmp_path}",
                   "model.cuda_graphs=none", "train.progress_bar_values=keep")
    recipe, resolved = pretrain.build_recipe(cfg, cfg.train, "/data/none", "/tok/none", str(tmp_path))
    pretrain.launcher_callbacks(cfg, cfg.train, recipe, resolved, str(tmp_path))
    log = [c for c in recipe.trainer.callbacks if c.__fn_or_cls__.__name__ == "LightningLogCallback"]
    assert log[0].progress_bar_values == "keep"  # not the default: the override reached the callback
    bad = _compose("train=gpu_9min", "attention=ssa_triton", "train.progress_bar_values=off")
    with pytest.raises(ValueError, match=r"train.progress_bar_values='off' is not supported \(supported: keep, drop\)"):
        check_run_config(bad, cuda=True)


@pytest.fixture
def restore_loader():
    from megatron.core import full_cuda_graph

    import nemo_ssa.megatron.cuda_graphs as cg

    # megatron's own call (an earlier test's arm_full_iteration may have patched it: the patch is
    # process-wide by design)
    before = cg._ORIGINAL_LOADER_CALL.get("call", full_cuda_graph.StaticBufferLoader.__dict__["__call__"])
    full_cuda_graph.StaticBufferLoader.__call__ = before
    cg._ORIGINAL_LOADER_CALL.clear()
    yield full_cuda_graph.StaticBufferLoader
    full_cuda_graph.StaticBufferLoader.__call__ = before
    cg._ORIGINAL_LOADER_CALL.clear()


def test_the_static_buffer_copy_waits_for_the_queued_work_first(restore_loader, monkeypatch):
    """megatron < 0.17 copies each batch into the whole-iteration graph's input buffers on a side
    stream that waits for nothing; the patched call makes that stream wait for the current one,
    then runs megatron's own call."""
    import nemo_ssa.megatron.cuda_graphs as cg

    loader = restore_loader
    import inspect

    own = cg._WAIT in inspect.getsource(loader.__call__)
    msg = cg.order_static_buffer_copies()
    if own:  # a megatron that has the line: left alone
        assert "(its own)" in msg and loader.__call__ is not cg._ordered_loader_call
        return
    assert "patched" in msg and loader.__call__ is cg._ordered_loader_call
    assert "(patched)" in cg.order_static_buffer_copies()  # once
    order = []
    current = object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current)
    monkeypatch.setitem(cg._ORIGINAL_LOADER_CALL, "call",
                        lambda self, inputs, stage, mb: order.append(("copy", inputs, stage, mb)) or "buffers")
    fake = types.SimpleNamespace(stream=types.SimpleNamespace(wait_stream=lambda s: order.append(("wait", s))))
    assert cg._ordered_loader_call(fake, {"tokens": 1}, "training", 0) == "buffers"
    assert order == [("wait", current), ("copy", {"tokens": 1}, "training", 0)]


def test_a_loader_with_megatrons_own_wait_is_left_alone(restore_loader, monkeypatch):
    import nemo_ssa.megatron.cuda_graphs as cg

    class Fixed:  # megatron 0.17+'s shape
        def __call__(self, inputs, stage, microbatch):
            self.stream.wait_stream(torch.cuda.current_stream())
            return inputs

    from megatron.core import full_cuda_graph

    monkeypatch.setattr(full_cuda_graph, "StaticBufferLoader", Fixed)
    assert "(its own)" in cg.order_static_buffer_copies() and Fixed.__call__ is not cg._ordered_loader_call
    monkeypatch.setattr(full_cuda_graph, "StaticBufferLoader", lambda: None)
    assert "left as it is" in cg.order_static_buffer_copies()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_next_batch_does_not_overwrite_the_buffers_a_running_step_reads(restore_loader):
    """On the GPU: a step still reading the static tokens (a long kernel queued first) must see
    its own batch. megatron 0.15's loader overwrites them under it (so the test can fail); the
    ordered one copies after."""
    import nemo_ssa.megatron.cuda_graphs as cg

    loader_cls = restore_loader

    def run(loader):
        loader_cls.static_buffers = {"training": [], "validation": []}
        first = {"tokens": torch.zeros(1 << 20, device="cuda")}
        nxt = {"tokens": torch.ones(1 << 20, device="cuda")}  # the next batch, on the device before the step
        static = loader(first, "training", 0)["tokens"]
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the step still running (~0.1 s on the current stream)
        seen = static.clone()  # what the step reads, after it
        loader(nxt, "training", 0)
        torch.cuda.synchronize()
        return float(seen.sum())

    import inspect

    if cg._WAIT not in inspect.getsource(loader_cls.__call__):
        assert run(loader_cls()) > 0  # megatron's own: the next batch was read by the running step
    cg.order_static_buffer_copies()
    assert run(loader_cls()) == 0.0


@pytest.mark.parametrize("fields, label", [({}, "none"), ({"cuda_graph_impl": "local"}, "local"),
                                           ({"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"},
                                            "local (full_iteration)"),
                                           ({"cuda_graph_impl": "local", "cuda_graph_scope": ["attn", "mlp"]}, "local")])
def test_the_path_line_names_the_whole_iteration_graph(fields, label):
    """model.cuda_graphs=full is impl 'local' with scope full_iteration: the launcher's path
    line printed 'local' for it, read as the layer graphs."""
    from nemo_ssa.cli.pretrain import _graphs_label

    assert _graphs_label(types.SimpleNamespace(**fields)) == label
    if "cuda_graph_scope" in fields and isinstance(fields["cuda_graph_scope"], str):
        assert _graphs_label(types.SimpleNamespace(**cuda_graph_fields("full"))) == label
