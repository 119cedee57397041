"""nemo_ssa.megatron.lm_pretrain (Megatron-LM's loop from the megatron-core 0.19 wheel) and
nemo_ssa.megatron.block_specs.

megatron-core 0.19 needs Python 3.12, so here (3.11, megatron-core 0.15.3) the loop itself
cannot run: these tests check what we hand it -- the argument list, the refusals, the batch,
the loss, the block specs -- on the installed core, and every call between our entry and
0.19.2's ``megatron.training`` against 0.19.2's source (the sources scripts/env.sh unpacks,
as tests/megatron/test_contracts.py). The GPU run is docs/results/2026-11-27-stack."""

from __future__ import annotations

import ast
import os

import pytest
import torch

from nemo_ssa.megatron import block_specs, contracts, layer_specs, lm_pretrain

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LM_SOURCE = open(lm_pretrain.__file__, encoding="utf-8").read()


# ------------------------------------------------------------------------ the argument list
def test_preset_first_then_corpus_then_the_users_arguments():
    preset, argv = lm_pretrain.build_argv(["--spec", "nemo_ssa.megatron.block_specs", "ssa_triton",
                                           "--micro-batch-size", "8"], corpus=("/c/prefix", "/c/tok"))
    assert preset == "nemotron-114m"
    n = len(lm_pretrain.PRESETS[preset])
    assert argv[:n] == lm_pretrain.PRESETS[preset]
    assert argv[n:n + 6] == ["--data-path", "/c/prefix", "--tokenizer-type", "HuggingFaceTokenizer",
                             "--tokenizer-model", "/c/tok"]
    assert argv[-5:] == ["--spec", "nemo_ssa.megatron.block_specs", "ssa_triton", "--micro-batch-size", "8"]
    # argparse keeps the last value: the user's micro batch wins over the preset's 32
    last = max(i for i, a in enumerate(argv) if a == "--micro-batch-size")
    assert argv[last + 1] == "8"


def test_the_preset_is_the_recipes_model():
    pytest.importorskip("nemo_run", reason="the recipe module needs NeMo's launcher (not in the 0.19 stack)")
    from recipes.nemotron_114m import ARCH

    p = lm_pretrain.PRESETS["nemotron-114m"]
    value = {p[i]: p[i + 1] for i in range(len(p) - 1) if p[i].startswith("--") and not p[i + 1].startswith("--")}
    assert int(value["--num-layers"]) == ARCH["num_layers"]
    assert int(value["--hidden-size"]) == ARCH["hidden_size"]
    assert int(value["--ffn-hidden-size"]) == ARCH["ffn_hidden_size"]
    assert int(value["--num-attention-heads"]) == ARCH["num_attention_heads"]
    assert int(value["--num-query-groups"]) == ARCH["num_query_groups"]
    assert "--group-query-attention" in p and "--apply-layernorm-1p" in p and "--squared-relu" in p
    assert "--untie-embeddings-and-output-weights" not in p  # tied, as the recipe
    assert value["--transformer-impl"] == "local"


def test_preset_none_user_data_and_bad_preset():
    preset, argv = lm_pretrain.build_argv(["--preset", "none", "--mock-data", "--lr", "1e-3"], corpus=("/p", "/t"))
    assert preset == "none" and argv == ["--mock-data", "--lr", "1e-3"]
    _, argv = lm_pretrain.build_argv(["--preset=none", "--data-path", "/mine"], corpus=("/p", "/t"))
    assert argv == ["--data-path", "/mine"]
    with pytest.raises(SystemExit, match="one of"):
        lm_pretrain.build_argv(["--preset", "gpt3-175b"])
    with pytest.raises(SystemExit, match="needs a value"):
        lm_pretrain.build_argv(["--preset"])


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("version", ["0.15.3", "0.16.1", "0.20.0"])
def test_megatron_outside_the_loops_range_is_refused_naming_the_way(version):
    with pytest.raises(SystemExit) as e:
        lm_pretrain.check_megatron(version)
    msg = str(e.value)
    assert version in msg and lm_pretrain.MEGATRON_CORE in msg
    assert "scripts/pretrain.py" in msg and "train_megatron_core.py" in msg


def test_megatron_019_is_accepted():
    assert lm_pretrain.check_megatron("0.19.2") == "0.19.2"
    assert lm_pretrain.check_megatron("0.19.0rc1") == "0.19.0rc1"


class _Args:
    def __init__(self, **kw):
        self.pipeline_model_parallel_size = 1
        self.transformer_impl = "local"
        self.attention_backend = "AttnBackend.auto"
        self.spec = ["nemo_ssa.megatron.block_specs", "ssa_triton"]
        self.sft = False
        self.fim_data = False
        self.__dict__.update(kw)


@pytest.mark.parametrize("bad, words", [
    (dict(pipeline_model_parallel_size=2), "pipeline"),
    (dict(transformer_impl="transformer_engine"), "--transformer-impl local"),
    (dict(attention_backend="AttnBackend.local"), "replaces the spec's core attention"),
    (dict(sft=True), "GPTDataset"),
])
def test_what_the_entry_does_not_run_is_refused_before_building(bad, words):
    with pytest.raises(SystemExit, match="not supported here") as e:
        lm_pretrain.check_args(_Args(**bad))
    assert words in str(e.value)


def test_supported_arguments_pass_and_megatrons_own_layer_may_use_its_backends():
    lm_pretrain.check_args(_Args())
    lm_pretrain.check_args(_Args(spec=None, attention_backend="AttnBackend.local", transformer_impl="transformer_engine"))


# ------------------------------------------------------------------------- batch and loss
def test_loss_is_megatrons_per_token_sum_and_count():
    torch.manual_seed(0)
    losses = torch.rand(3, 7)
    mask = (torch.rand(3, 7) > 0.3).float()
    loss, n, report = lm_pretrain.loss_func(mask, losses)
    want = (losses.double() * mask.double()).sum()
    assert torch.allclose(loss.double(), want, rtol=1e-6)
    assert int(n) == int(mask.sum())
    assert torch.allclose(report["lm loss"], torch.stack([loss.detach(), n.float()]))


def test_get_batch_returns_the_micro_batch_on_one_rank():
    from nemo_ssa.megatron.cpu import cpu_device_shims
    from nemo_ssa.megatron.single import init_single_process

    init_single_process(1234)
    tokens = torch.randint(0, 100, (2, 9))
    data = {"tokens": tokens, "labels": tokens.roll(-1, 1), "position_ids": torch.arange(9).expand(2, -1),
            "loss_mask": torch.ones(2, 9), "attention_mask": None}
    with cpu_device_shims():
        b = lm_pretrain.get_batch(iter([data]))
    assert set(b) == set(lm_pretrain.BATCH_KEYS)
    assert torch.equal(b["tokens"], tokens) and torch.equal(b["labels"], tokens.roll(-1, 1))
    assert b["loss_mask"].dtype == torch.float32 and b["tokens"].dtype == torch.int64


# ---------------------------------------------------------------------------- block specs
def test_a_block_spec_per_layer_spec_and_it_is_the_recipes_block():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from nemo_ssa.megatron.layernorm import LayerNorm1P

    assert set(block_specs.ALL) == set(layer_specs.ALL)
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               add_bias_linear=False, use_cpu_initialization=True)

    class _Proxy:  # megatron.training's GPTModelConfig: the TransformerConfig under .transformer
        transformer = config

    for cfg in (config, _Proxy()):
        spec = block_specs.ssa(cfg)
        assert isinstance(spec, TransformerBlockSubmodules) and len(spec.layer_specs) == 3
        assert spec.layer_norm is LayerNorm1P
        core = spec.layer_specs[0].submodules.self_attention.submodules.core_attention
        assert core.module is layer_specs.ssa.submodules.self_attention.submodules.core_attention.module
    import inspect

    # GPTModelBuilder hands vp_stage only to a callable that names it
    assert "vp_stage" in inspect.signature(block_specs.ssa_triton).parameters
    assert vars(block_specs)["softmax"] is block_specs.ALL["softmax"]  # megatron's import_module reads vars()


# ----------------------------------------------------- our calls against 0.19.2's source
V019 = "0.19.2"


def _root():
    root = contracts.source_roots([V019])[V019]
    if root is None:
        msg = f"megatron-core {V019} sources missing under {contracts.sources_dir()} (scripts/env.sh unpacks them)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return root


def _parsed(root, rel, cls, name, bound=False):
    with open(os.path.join(root, "megatron", rel), encoding="utf-8") as f:
        fn = contracts.parse_function(f.read(), cls, name)
    assert fn is not None, f"{rel}: {cls or ''}.{name} is gone from {V019}"
    return contracts.signature_from_ast(fn, bound=bound)


# (the name our module calls, megatron file, class, function, bound)
CALLS = [
    ("pretrain", "training/training.py", None, "pretrain", False),
    ("parse_and_validate_args", "training/arguments.py", None, "parse_and_validate_args", False),
    ("gpt_config_from_args", "training/argument_utils.py", None, "gpt_config_from_args", False),
    ("pretrain_cfg_container_from_args", "training/argument_utils.py", None, "pretrain_cfg_container_from_args", False),
    ("get_blend_and_blend_per_split", "training/utils/common_utils.py", None, "get_blend_and_blend_per_split", False),
    ("BlendedMegatronDatasetBuilder", "core/datasets/blended_megatron_dataset_builder.py",
     "BlendedMegatronDatasetBuilder", "__init__", True),
    ("tensor_parallel.broadcast_data", "core/tensor_parallel/data.py", None, "broadcast_data", False),
    ("get_batch_on_this_cp_rank", "core/utils.py", None, "get_batch_on_this_cp_rank", False),
]


@pytest.mark.parametrize("ours, rel, cls, name, bound", CALLS, ids=[c[0] for c in CALLS])
def test_every_call_into_megatron_training_binds_on_0_19_2(ours, rel, cls, name, bound):
    root = _root()
    sig = _parsed(root, rel, cls, name, bound)
    calls = contracts.find_calls(LM_SOURCE, [ours], file="lm_pretrain.py")
    assert calls, f"lm_pretrain.py no longer calls {ours}: update this table"
    for call in calls:
        assert not contracts._problems(sig, call), (str(call), contracts._problems(sig, call))


def test_the_dataset_config_fields_we_set_exist_on_0_19_2():
    root = _root()
    fields = set()
    for rel, cls in [("core/datasets/blended_megatron_dataset_config.py", "BlendedMegatronDatasetConfig"),
                     ("core/datasets/gpt_dataset.py", "GPTDatasetConfig")]:
        tree = ast.parse(open(os.path.join(root, "megatron", rel), encoding="utf-8").read())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        fields |= {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    call = contracts.find_calls(LM_SOURCE, ["GPTDatasetConfig"], file="lm_pretrain.py")
    assert len(call) == 1
    assert call[0].keywords <= fields, sorted(call[0].keywords - fields)


def test_the_names_our_entry_reaches_for_exist_on_0_19_2():
    root = _root()
    training = open(os.path.join(root, "megatron", "training", "training.py"), encoding="utf-8").read()
    # the optimizer builder we wrap is a module-level name of megatron.training.training
    assert "get_megatron_optimizer(" in training and "import" in training
    tree = ast.parse(training)
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "get_megatron_optimizer" in imported
    init = open(os.path.join(root, "megatron", "training", "__init__.py"), encoding="utf-8").read()
    for name in ("get_args", "get_timers", "get_tokenizer", "pretrain"):
        assert name in init, name
    # GPTModelBuilder calls a callable spec with (config, vp_stage=...) when it names vp_stage
    gpt = open(os.path.join(root, "megatron", "training", "models", "gpt.py"), encoding="utf-8").read()
    calls = contracts.find_calls(gpt, ["transformer_layer_spec"], ["GPTModelBuilder"], file="gpt.py")
    assert calls
    import inspect

    for call in calls:
        assert not contracts._problems(inspect.signature(block_specs.ssa_triton), call), str(call)


def test_the_0_19_bundle_pins_one_megatron_core_inside_the_loops_range_and_its_sources():
    pins = [line.split("#", 1)[0].strip() for line in
            open(os.path.join(REPO, "requirements", "gpu-bundle-mcore019.txt"), encoding="utf-8")]
    pins = [p for p in pins if p]
    assert pins == [f"megatron-core=={V019}"]  # the image has the rest (its list in the file's header)
    assert lm_pretrain.check_megatron(V019) == V019
    assert V019 in contracts.pinned_versions(os.path.join(REPO, "requirements", "sources", "megatron-core.txt"))


def test_the_readmes_megatron_lm_lines_name_this_entry_and_a_spec_that_exists():
    import re
    import shlex

    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = text.split("**Megatron-LM's own loop**", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [ln for ln in block.splitlines() if ln.startswith("torchrun ")]
    assert len(lines) == 3
    for line in lines:
        argv = shlex.split(line)
        assert argv[argv.index("-m") + 1] == "nemo_ssa.megatron.lm_pretrain"
        rest = argv[argv.index("-m") + 2:]
        module, name = rest[rest.index("--spec") + 1: rest.index("--spec") + 3]
        import importlib

        assert callable(vars(importlib.import_module(module))[name])
        preset, full = lm_pretrain.build_argv(rest, corpus=("/p", "/t"))
        assert preset == "nemotron-114m" and full[-len(rest):] == rest


# ---------------------------------- the loop's own pieces, where megatron.training imports
LOOP_SCRIPT = r'''
import os, sys, json, torch
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
from nemo_ssa.data import build_corpus
from nemo_ssa.megatron import lm_pretrain as L
info = build_corpus(sys.argv[1] + "/corpus", source=sys.argv[1] + "/text", vocab_size=300, quiet=True)
preset, full = L.build_argv(["--spec", "nemo_ssa.megatron.block_specs", "ssa", "--num-layers", "2",
                             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                             "--train-iters", "2", "--distributed-backend", "gloo", "--split", "80,20,0"],
                            corpus=(info.prefix, info.tokenizer_dir))
sys.argv = ["lm_pretrain", *[a for a in full if a != "--bf16"]]  # CPU: fp32
from megatron.training.arguments import parse_and_validate_args
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
args = parse_and_validate_args()
L.check_args(args)
model_cfg = gpt_config_from_args(args)
pretrain_cfg_container_from_args(args, model_cfg)
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from nemo_ssa.megatron.cpu import cpu_device_shims
dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(1, 1)
tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
torch.manual_seed(0)
model_cfg.transformer.use_cpu_initialization = True
with cpu_device_shims():
    model = model_cfg.get_builder_cls()(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
    # (a split with no document and samples asked of it spins in megatron's epoch count: no test split)
    ds = L.train_valid_test_datasets_provider([4, 2, 0])
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    out, loss_fn = L.forward_step(iter(build_pretraining_data_loader(ds[0], 0)), model)
    loss, n, report = loss_fn(out)
    loss.backward()
layer = model.decoder.layers[0]
print(json.dumps({"core": type(layer.self_attention.core_attention).__name__,
                  "final_norm": type(model.decoder.final_layernorm).__name__,
                  "loss_per_token": float(loss) / int(n), "tokens": int(n),
                  "n_grad": float(layer.self_attention.core_attention.n.grad.abs().sum()),
                  "padded_vocab": int(model.embedding.word_embeddings.weight.shape[0])}))
'''


def test_megatron_trainings_pieces_build_our_model_read_the_corpus_and_train_a_step(tmp_path):
    """Everything of the loop but ``pretrain`` itself (which needs CUDA), on the installed
    megatron-core: runs in CI's Python 3.13 row (tests/test_py313_row.py), skips on 0.15/0.16."""
    import importlib.util
    import json
    import math
    import socket
    import subprocess
    import sys

    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron.training is not installed (megatron-core < 0.17); CI's Python 3.13 row runs this")
    text = tmp_path / "text"
    text.mkdir()
    for i in range(40):
        (text / f"doc{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 53} tok{j % 11}" for j in range(120)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", LOOP_SCRIPT, str(tmp_path), str(port)], capture_output=True,
                       text=True, timeout=600, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["core"] == layer_specs.ssa.submodules.self_attention.submodules.core_attention.module.__name__
    assert got["final_norm"] == "LayerNorm1P"
    assert got["tokens"] == 2 * 32
    # an untrained model: about ln(vocab) per token, and n learns
    assert abs(got["loss_per_token"] - math.log(got["padded_vocab"])) < 1.5
    assert got["n_grad"] > 0
