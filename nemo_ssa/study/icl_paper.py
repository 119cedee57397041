"""The SSA paper's own in-context experiments, run the way the authors' code runs them, with
the model built from our layer spec (any ``attention=`` name, the same kernels as the recipe).

    python -m nemo_ssa.study.icl_paper --task linear --attentions softmax,ssa --seeds 3 --steps 50000 --out runs/icl_paper/linear
    python -m nemo_ssa.study.icl_paper --task every  --attentions softmax,ssa --seeds 3 --steps 50000 --out runs/icl_paper/every
    python -m nemo_ssa.study.icl_paper --task linear --cpu-smoke --out /tmp/icl_paper          # CPU: seconds
    # GPU: the runs of a call in one process, each step one CUDA graph (docs/icl-paper-setup.md, "Running it")
    python -m nemo_ssa.study.icl_paper --task linear --steps 50000 --concurrent 6 --cuda-graphs --budget-s 450 --out /tmp/icl/linear
    python -m nemo_ssa.study.icl_paper --task linear --steps 50000 --cuda-graphs --bench-steps 200   # steps/s, writes nothing

What the authors' code does, item by item with the file and function it comes from, and
how this module matches each item: docs/icl-paper-setup.md. In short:

- **tasks** (``scratch/src/tasks.py``): ``linear``: 1-D ``f(x) = a·x + b`` with ``a, b, x ~
  N(0, 1)``, a fresh ``(a, b)`` per prompt, squared error; ``every``: ``y_j = +1`` iff ``x_1 …
  x_j`` are all positive, else ``-1``, binary cross-entropy on the logit.
- **tokens** (``models.py``, ``TransformerModel._combine``): ``x_1, y_1, x_2, y_2, …``, one
  number per token in the same channel (``n_dims = 1``), so only the position tells an ``x``
  token from a ``y`` token; the prediction of ``y_j`` is read at the ``x_j`` token.
- **model**: GPT-2 (12 layers, 8 heads, width 256, GELU-tanh MLP of 4× width, pre-LN with
  a final LayerNorm, biases, no dropout) -> here megatron-core's ``TransformerBlock`` from
  :func:`nemo_ssa.megatron.spec.layer_spec` with the same sizes and, like GPT-2, learned
  absolute positions added to the linear read-in (``positions="rope"`` is an option).
- **schedule** (``conf/base.yaml``, ``train.py``): Adam at a constant 1e-4, batch 64,
  500,001 steps, fp32, no clipping; prompts of 11 points growing by 2 every 2,000 steps to 41
  (``curriculum.py``); loss over every point of the prompt.
- **evaluation** (``testoverxandy.py``): 9-point prompts, squared error over points 3…8
  (0-based), ``x = σx·u`` with the same unit draws ``u`` for every ``σx``, 100 functions
  ``(a, b) = σ·v`` each applied to the same 64 prompts, ``σx, σ ∈ 1…10``; the same grid with
  an outlier ``x_5 = 20000`` (the injection the script carries commented out); least squares
  with an intercept on the same prompts beside it (the floor: exact from 2 points on).
  ``every`` (``testoverlandx.py``): lengths 10…200 by 10 × ``σ ∈ 1…29``, the fraction of 64
  prompts with any wrong sign at points 3 and later; and ``testcross.py``'s probe ``x = (1,
  -1, -2, 1000)``.

Seeds: the run seed fixes the model's initialisation, every training batch (a function of
``(seed, step)``) and the evaluation prompts, so every attention sees the same prompts for a
seed. Each run is saved as it finishes (``runs/<task>-<attention>-s<seed>.json``) and reused
by a later call with the same configuration; a run in progress checkpoints every
``--checkpoint-every`` steps (and when ``--budget-s`` or ``--stop-after-steps`` ends the
call) and resumes from there, bit for bit on CPU. Exit status 3: some run is unfinished
(call again). ``icl_paper.md`` summarises the finished runs with heat maps as CSV and PNG
(``heatmaps/``): each attention's error over the grid, the seed-paired difference of the
first attention minus each other one with its seed spread, and the error above the
least-squares floor. Use one ``--out`` per task.

Speed (GPU): ``--concurrent N`` trains N runs of the call in one process, in turns step by
step, each on its own CUDA stream; ``--cuda-graphs`` makes each run's whole step (forward,
backward, fused Adam, the loss sum) one CUDA graph per prompt length; the host never waits
for the GPU inside the loop (pinned, non-blocking batch copies; losses read back only at
log lines, checkpoints and the end). ``--tf32`` (a different configuration: its runs are
kept apart) lets cuBLAS use TF32; ``--deterministic`` (also a configuration of its own) turns on
torch's deterministic algorithms, under which the SSA backward adds no atomics (so that a rerun
repeats a run to the last bit; its GPU test: tests/test_icl_paper.py). ``--bench-steps N`` times N steps of the call's runs
together and writes nothing. None of this changes the CPU loop.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "TASKS", "PaperConfig", "PAPER", "CPU_SMOKE", "curriculum_points", "sample_linear", "sample_every",
    "every_labels", "to_tokens", "task_loss", "training_batch", "least_squares_affine", "linear_eval_functions",
    "linear_eval_prompts", "every_eval_prompts", "evaluate_linear", "evaluate_every", "PaperModel",
    "check_attentions", "train_run", "train_runs", "bench", "main",
]

TASKS = ("linear", "every")
POSITIONS = ("learned", "rope")
#: testcross.py's probe: a positive, two negatives, then an outlier far above anything seen
CROSS_PROBE_X = (1.0, -1.0, -2.0, 1000.0)
EXIT_UNFINISHED = 3
#: about this many points on a run's saved loss curve
CURVE_POINTS = 500


@dataclass(frozen=True)
class Variant:
    """``--variant "LABEL=ATTENTION KEY=VALUE ..."``: one attention under its own policy and SSA
    options, trained and summarised under LABEL beside the plain attentions (the paper's
    "trainable b, n >= 1": ``ssa_nb=ssa policy=free learnable_b=true n_min=1.0``)."""

    label: str
    attention: str
    policy: str = "pinned"
    options: Tuple[Tuple[str, object], ...] = ()

    def identity(self) -> Dict:
        return {"attention": self.attention, "policy": self.policy, "options": dict(self.options)}


@dataclass(frozen=True)
class PaperConfig:
    """One experiment: the task, the model, the schedule and the evaluation grids. Defaults
    are the authors' (conf/polynomial_regression.yaml with its inherited base.yaml and
    models/standard.yaml; the grids of testoverxandy.py and testoverlandx.py)."""

    task: str = "linear"                  # one of TASKS
    # model: GPT-2 sizes
    layers: int = 12
    hidden: int = 256
    heads: int = 8
    positions: str = "learned"            # learned absolute positions (GPT-2's) or "rope"
    n_positions: int = 256                # points; 2 * n_positions tokens of positions (GPT2Config(n_positions=2*256))
    # schedule
    steps: int = 500_001
    batch: int = 64
    lr: float = 1e-4
    points_start: int = 11
    points_end: int = 41
    points_inc: int = 2
    points_interval: int = 2000
    # linear grid (testoverxandy.py)
    eval_points: int = 9
    eval_from: int = 3                    # first scored point (0-based): z[:, 3:] - p[:, 3:]
    sigma_x: Tuple[float, ...] = tuple(float(s) for s in range(1, 11))
    sigma: Tuple[float, ...] = tuple(float(s) for s in range(1, 11))
    functions: int = 100
    eval_prompts: int = 64
    outlier_position: int = 5
    outlier_value: float = 20000.0
    # every grid (testoverlandx.py)
    every_lengths: Tuple[int, ...] = tuple(range(10, 201, 10))
    every_sigma: Tuple[float, ...] = tuple(float(s) for s in range(1, 30))
    every_from: int = 3
    # precision: TF32 matrix products on CUDA (--tf32); off = IEEE fp32 everywhere (the default)
    tf32: bool = False
    # bit-exact reruns (--deterministic): torch's deterministic algorithms, under which the fused
    # attention backward takes its two-kernel schedule instead of the single pass that adds dQ
    # with fp32 atomics (ops/common/dispatch.py decides and notes it); part of the identity when
    # on, since only runs of one mode repeat each other to the last bit
    deterministic: bool = False
    # the labels --variant defines (not part of a plain run's identity: see run_identity)
    variants: Tuple[Variant, ...] = ()

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} is not supported (supported: {', '.join(TASKS)})")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions={self.positions!r} is not supported (supported: {', '.join(POSITIONS)})")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}")
        longest = max(self.points_end, self.eval_points, max(self.every_lengths) if self.task == "every" else 0)
        if longest > self.n_positions:
            raise ValueError(f"prompts of {longest} points need n_positions >= {longest} (got {self.n_positions})")
        if not 0 <= self.outlier_position < self.eval_points:
            raise ValueError(f"outlier_position={self.outlier_position} is outside the {self.eval_points}-point prompts")
        if not 0 <= self.eval_from < self.eval_points or self.every_from >= min(self.every_lengths):
            raise ValueError("the first scored point must lie inside every evaluation prompt")

    def identity(self) -> Dict:
        """What makes two runs the same (JSON-normalised): every field but the other task's grid."""
        other = {"linear": _EVERY_FIELDS, "every": _LINEAR_FIELDS}[self.task]
        d = {k: v for k, v in asdict(self).items() if k not in other and k != "variants"}
        if not self.tf32:
            del d["tf32"]  # fp32 runs keep the identity they had before the field existed
        if not self.deterministic:
            del d["deterministic"]  # the same for runs in the default (atomic-backward) mode
        return json.loads(json.dumps(d))


    def variant(self, name: str) -> Optional[Variant]:
        return next((v for v in self.variants if v.label == name), None)

    def build(self, name: str) -> Tuple[str, Optional[Dict], str]:
        """``(attention, SSA options or None, policy)`` that ``name`` (an attention or a label) builds."""
        v = self.variant(name)
        return (v.attention, dict(v.options), v.policy) if v else (name, None, "pinned")


def run_identity(cfg: PaperConfig, name: str) -> Dict:
    """What makes a saved run or checkpoint of ``name`` reusable: the configuration, and for a
    variant its definition (a changed definition retrains; plain runs keep their identity)."""
    d = cfg.identity()
    v = cfg.variant(name)
    if v is not None:
        d["variant"] = json.loads(json.dumps(v.identity()))
    return d


_VARIANT_VALUES = {"true": True, "false": False, "null": None, "none": None}


def parse_variant(spec: str) -> Variant:
    """``"LABEL=ATTENTION KEY=VALUE ..."`` -> :class:`Variant`; KEY is ``policy`` or an SSA option
    (``attention.options.`` may prefix it, as the study and the launcher spell it). ValueError
    naming what is wrong."""
    import re

    from nemo_ssa.config.attentions import SSA_OPTION_KEYS, option_keys
    from nemo_ssa.config.policy import known_names
    from nemo_ssa.megatron.spec import gpt_layer_spec

    head, *rest = spec.split()
    label, eq, attention = head.partition("=")
    if not eq or not re.fullmatch(r"[A-Za-z0-9_.+-]+", label) or not attention:
        raise ValueError(f"--variant {spec!r}: give \"LABEL=ATTENTION KEY=VALUE ...\", LABEL of letters, digits "
                         "and _.+- (it names the runs)")
    if label in known_names():
        raise ValueError(f"--variant {spec!r}: LABEL {label!r} is an attention's name; choose another")
    if attention not in known_names():
        raise ValueError(f"--variant {spec!r}: unknown attention {attention!r}; known: {', '.join(known_names())}")
    policy, options = "pinned", {}
    for item in rest:
        key, eq, raw = item.partition("=")
        key = key[len("attention.options."):] if key.startswith("attention.options.") else key
        if not eq or (key != "policy" and key not in SSA_OPTION_KEYS):
            raise ValueError(f"--variant {spec!r}: {item!r} is not KEY=VALUE with KEY policy or one of "
                             f"{', '.join(SSA_OPTION_KEYS)}")
        if key == "policy":
            policy = raw
            continue
        value = _VARIANT_VALUES.get(raw.lower(), raw)
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"--variant {spec!r}: {key}={raw!r} is not true/false/null or a number") from None
        options[key] = value
    if options and policy != "free":
        raise ValueError(f"--variant {spec!r}: SSA options need policy=free (the pinned policy resets them)")
    takes = option_keys(attention)
    if any(k not in takes for k in options):
        # the layer spec would only warn and drop them: an ablation that silently is not one
        raise ValueError(f"--variant {spec!r}: attention={attention} takes no {sorted(set(options) - set(takes))} "
                         f"(its options: {', '.join(takes) or 'none'})")
    gpt_layer_spec(attention, options or None, policy)  # the spec builds: values it refuses fail here
    return Variant(label, attention, policy, tuple(sorted(options.items())))


# eval_prompts (64 in both scripts) belongs to both grids
_LINEAR_FIELDS = frozenset({"eval_points", "eval_from", "sigma_x", "sigma", "functions", "outlier_position",
                            "outlier_value"})
_EVERY_FIELDS = frozenset({"every_lengths", "every_sigma", "every_from"})

PAPER = PaperConfig()
#: a tiny model and grid for CPU (seconds): the pipeline, not learning
CPU_SMOKE = PaperConfig(layers=2, hidden=32, heads=2, n_positions=16, steps=20, batch=8, lr=1e-3, points_start=5,
                        points_end=9, points_inc=2, points_interval=5, sigma_x=(1.0, 4.0), sigma=(1.0, 3.0),
                        functions=3, eval_prompts=4, every_lengths=(8, 12), every_sigma=(1.0, 10.0))


# ----------------------------------------------------------------------------- sampling
def _generator(*key) -> torch.Generator:
    """A CPU generator seeded from ``key`` (stable across processes and platforms), so each
    draw is a function of what it is for, not of what was drawn before it."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def curriculum_points(cfg: PaperConfig, step: int) -> int:
    """Points per prompt at 0-based ``step``: curriculum.py raises the count by ``inc`` after
    every ``interval``-th step, capped at ``end`` (11, 13 from step 2000, ..., 41 from 30000)."""
    return min(cfg.points_start + cfg.points_inc * (step // cfg.points_interval), cfg.points_end)


def sample_linear(batch: int, points: int, *, sigma_x: float = 1.0, sigma: float = 1.0,
                  generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x ~ N(0, σx²)`` ``[batch, points]``, one ``(a, b) ~ N(0, σ²)`` per prompt ``[batch, 2]``,
    ``y = a·x + b``; float32 on CPU."""
    x = torch.randn(batch, points, generator=generator) * sigma_x
    ab = torch.randn(batch, 2, generator=generator) * sigma
    return x, ab[:, :1] * x + ab[:, 1:], ab


def every_labels(x: torch.Tensor) -> torch.Tensor:
    """``+1`` where every ``x`` up to and including this point is positive, else ``-1``."""
    return torch.cumprod((x > 0).to(torch.int64), dim=-1).to(x.dtype) * 2 - 1


def sample_every(batch: int, points: int, *, sigma_x: float = 1.0,
                 generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, points, generator=generator) * sigma_x
    return x, every_labels(x)


def to_tokens(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[B, k]`` and ``[B, k]`` -> ``[B, 2k, 1]``: ``x_1, y_1, x_2, y_2, ...`` in one channel."""
    return torch.stack((x, y), dim=2).reshape(x.shape[0], 2 * x.shape[1], 1)


def task_loss(pred: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    """The training loss over every point: mean squared error (linear), or binary
    cross-entropy of ``sigmoid(pred)`` against ``(y + 1) / 2`` (every; computed from the logit)."""
    if task == "linear":
        return (pred - y).pow(2).mean()
    if task == "every":
        return F.binary_cross_entropy_with_logits(pred, (y + 1) / 2)
    raise ValueError(f"task={task!r} is not supported (supported: {', '.join(TASKS)})")


def training_batch(cfg: PaperConfig, seed: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` for ``seed``: the same for every attention and after a resume."""
    g = _generator("train", cfg.task, int(seed), int(step))
    points = curriculum_points(cfg, step)
    if cfg.task == "linear":
        x, y, _ = sample_linear(cfg.batch, points, generator=g)
    else:
        x, y = sample_every(cfg.batch, points, generator=g)
    return x, y


# ----------------------------------------------------------------------------- evaluation
def least_squares_affine(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Predict each ``y_i`` from the points before it by least squares on ``(x, 1)`` (the
    minimum-norm fit with one point, 0 with none), in float64: ``[N, k]`` -> ``[N, k]``.

    Prompts with the same ``x`` share their pseudo-inverses, which are computed once per
    distinct ``x`` (a linear grid cell is 100 functions on the same 64 prompts: 100x fewer
    SVDs, the same numbers bit for bit)."""
    x, y = x.double(), y.double()
    pred = torch.zeros_like(y)
    ux, inv = torch.unique(x, dim=0, return_inverse=True)
    design = torch.stack((ux, torch.ones_like(ux)), dim=-1)          # [U, k, 2]
    for i in range(1, x.shape[1]):
        w = torch.linalg.pinv(design[:, :i])[inv] @ y[:, :i, None]     # [N, 2, 1]
        pred[:, i] = (design[inv, i:i + 1] @ w)[:, 0, 0]
    return pred


def linear_eval_functions(cfg: PaperConfig, seed: int, sigma: float) -> torch.Tensor:
    """The grid's ``[functions, 2]`` ``(a, b) = σ·v``: the unit draws ``v`` depend on ``σ``
    (testoverxandy.py seeds them with σ) and not on ``σx``."""
    v = torch.randn(cfg.functions, 2, generator=_generator("linear-eval-f", int(seed), float(sigma)))
    return v * float(sigma)


def linear_eval_prompts(cfg: PaperConfig, seed: int, sigma_x: float, sigma: float,
                        outlier: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """One cell of the linear grid: ``[functions * prompts, eval_points]`` x and y.

    As testoverxandy.py: the prompts' unit draws are the same for every ``σx`` (x = σx·u),
    the functions' unit draws depend on ``σ`` only ((a, b) = σ·v), and every function is
    applied to all the prompts. With ``outlier``, ``x`` at ``outlier_position`` is
    ``outlier_value`` in every prompt (its y follows the function)."""
    u = torch.randn(cfg.eval_prompts, cfg.eval_points, generator=_generator("linear-eval-x", int(seed)))
    x = u * float(sigma_x)
    if outlier:
        x[:, cfg.outlier_position] = cfg.outlier_value
    a, b = linear_eval_functions(cfg, seed, sigma).unbind(1)
    y = a[:, None, None] * x[None] + b[:, None, None]                     # [F, P, K]
    return x.expand(cfg.functions, -1, -1).reshape(-1, cfg.eval_points), y.reshape(-1, cfg.eval_points)


def every_eval_prompts(cfg: PaperConfig, seed: int, length: int, sigma: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """One cell of the every grid: ``[eval_prompts, length]``. As testoverlandx.py the unit
    draws are the same for every ``σ`` (so are the labels) and a shorter prompt is the
    start of a longer one."""
    u = torch.randn(cfg.eval_prompts, max(cfg.every_lengths), generator=_generator("every-eval", int(seed)))
    x = u[:, :length] * float(sigma)
    return x, every_labels(x)


Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def evaluate_linear(predict: Predict, cfg: PaperConfig, seed: int, outlier: bool = False,
                    after_outlier: bool = False) -> List[List[float]]:
    """Mean squared error over the scored points, every function and prompt, per cell:
    ``[len(sigma_x)][len(sigma)]``. ``predict(x, y)`` returns the prediction of every ``y``.

    ``after_outlier`` (with ``outlier``) scores only the points after the outlier: over every
    scored point the outlier's own ``y = a·20000 + b`` dominates (a model whose outputs pass a
    LayerNorm cannot reach it), so that grid is ~``(a·20000)² / 6`` for any model; the points
    after it say whether the model recovers from the outlier in its context."""
    if after_outlier and not outlier:
        raise ValueError("after_outlier scores the points after the outlier: it needs outlier=True")
    first = cfg.outlier_position + 1 if after_outlier else cfg.eval_from
    grid = []
    for sx in cfg.sigma_x:
        row = []
        for s in cfg.sigma:
            x, y = linear_eval_prompts(cfg, seed, sx, s, outlier)
            err = (predict(x, y).double() - y.double())[:, first:].pow(2).mean()
            row.append(float(err))
        grid.append(row)
    return grid


def evaluate_every(predict: Predict, cfg: PaperConfig, seed: int) -> Dict[str, List[List[float]]]:
    """Per (length, σ): ``prompt_error`` (fraction of prompts with any wrong sign at the
    scored points: testoverlandx.py's count over its 64 prompts) and ``position_error``
    (fraction of wrong scored points)."""
    prompt_err, pos_err = [], []
    for length in cfg.every_lengths:
        prow, qrow = [], []
        for s in cfg.every_sigma:
            x, y = every_eval_prompts(cfg, seed, length, s)
            wrong = ((predict(x, y) > 0) != (y > 0))[:, cfg.every_from:]
            prow.append(float(wrong.any(dim=1).double().mean()))
            qrow.append(float(wrong.double().mean()))
        prompt_err.append(prow)
        pos_err.append(qrow)
    return {"prompt_error": prompt_err, "position_error": pos_err}


# ----------------------------------------------------------------------------- model
def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # GPT-2's gelu_new


class PaperModel(torch.nn.Module):
    """read-in (1 -> hidden) + learned positions -> TransformerBlock(our layer spec) -> read-out.

    GPT-2's sizes and parts in megatron-core: pre-LN layers with biases, a GELU-tanh MLP of 4×
    width, a final LayerNorm, normal(0, 0.02) initialisation with the output projections scaled
    by 1/sqrt(2·layers) (megatron's default, GPT-2's rule), no dropout, full multi-head
    attention (no grouped K/V)."""

    def __init__(self, cfg: PaperConfig, attention: str):
        super().__init__()
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.transformer_block import TransformerBlock

        from nemo_ssa.megatron.spec import layer_spec

        self.config = TransformerConfig(
            num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
            num_query_groups=cfg.heads, ffn_hidden_size=4 * cfg.hidden, activation_func=_gelu_tanh,
            add_bias_linear=True, layernorm_epsilon=1e-5, init_method_std=0.02, use_cpu_initialization=True,
            apply_rope_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
            masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
            hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
        self.read_in = torch.nn.Linear(1, cfg.hidden)
        self.max_tokens = 2 * cfg.n_positions
        self.wpe = None
        self.rope = None
        if cfg.positions == "learned":
            self.wpe = torch.nn.Embedding(self.max_tokens, cfg.hidden)
            torch.nn.init.normal_(self.wpe.weight, std=0.02)
        else:
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

            self.rope = RotaryEmbedding(kv_channels=cfg.hidden // cfg.heads, rotary_percent=1.0)
        name, options, policy = cfg.build(attention)
        self.block = TransformerBlock(self.config, layer_spec(self.config, name, attention_options=options,
                                                              policy=policy, fused_mlp=False))
        self.read_out = torch.nn.Linear(cfg.hidden, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, 2k, 1]`` -> predictions ``[B, k]`` read at the x tokens (the prediction of
        ``y_j`` sees ``x_1, y_1, ..., x_j`` and nothing after)."""
        t = tokens.shape[1]
        if t > self.max_tokens:
            raise ValueError(f"{t} tokens exceed the model's {self.max_tokens} positions (n_positions points)")
        h = self.read_in(tokens)                                           # [B, T, H]
        if self.wpe is not None:
            h = h + self.wpe.weight[:t]
        h = h.transpose(0, 1).contiguous()                                 # [T, B, H]
        rope = self.rope(t) if self.rope is not None else None
        h = self.block(h, attention_mask=None, rotary_pos_emb=rope)
        return self.read_out(h.float()).squeeze(-1).transpose(0, 1)[:, 0::2].float()


def model_predictor(model: PaperModel, cfg: PaperConfig, device: torch.device, chunk: int = 4096) -> Predict:
    """``predict(x, y)`` for the evaluation functions: the model on ``to_tokens(x, y)`` in chunks."""

    @torch.no_grad()
    def predict(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = []
        for i in range(0, x.shape[0], chunk):
            out.append(model(to_tokens(x[i:i + chunk], y[i:i + chunk]).to(device)).float().cpu())
        return torch.cat(out)

    return predict


# ----------------------------------------------------------------------------- attentions
def check_attentions(names: Sequence[str], cuda: Optional[bool] = None,
                     variants: Sequence[Variant] = ()) -> List[str]:
    """The requested names, refused with the known ones listed if any is neither in the
    attention table nor a ``--variant`` label; on a CPU, refused if it needs Triton kernels and
    the interpreter is off."""
    from nemo_ssa.config.attentions import ALIASES, ATTENTIONS
    from nemo_ssa.config.policy import resolve_attention

    names = [n.strip() for n in names if n.strip()]
    labels = {v.label: v.attention for v in variants}
    known = sorted(ATTENTIONS) + sorted(ALIASES) + sorted(labels)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"unknown attention(s) {bad or names}; known: {', '.join(known)}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        from nemo_ssa.ops.common.target import target

        runs_kernels = target(torch.device("cpu")).runs_kernels
        for n in names:
            impl = resolve_attention(labels.get(n, n), device="cpu").name
            if ATTENTIONS[impl].op_key[-1:] in (("triton",), ("elsa",)) and not runs_kernels:
                raise ValueError(f"attention={n} runs Triton kernels: on a CPU they run only under "
                                 f"TRITON_INTERPRET=1 (slow); softmax and ssa (ssa_reference on CPU) run without it")
    return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------- one run
def run_name(cfg: PaperConfig, attention: str, seed: int) -> str:
    return f"{cfg.task}-{attention}-s{seed}"


def _save_atomic(obj, path: str, torch_save: bool = False) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    if torch_save:
        torch.save(obj, tmp)
    else:
        with open(tmp, "w") as f:
            json.dump(obj, f)
    os.replace(tmp, path)


#: the linear task's grids: every scored point of clean prompts, of prompts with the outlier,
#: and only the points after the outlier (runs evaluated before that grid existed lack it)
LINEAR_GRIDS = ("clean", "outlier", "outlier_after")

#: eager steps at each new prompt length before its CUDA graph is captured (cuBLAS's
#: per-stream workspace, autograd's and Adam's lazily built state all exist by then)
GRAPH_WARMUP = 3


def _evaluate(model: "PaperModel", cfg: PaperConfig, seed: int, dev: torch.device) -> Dict:
    """The grids of the run's task (testoverxandy.py / testoverlandx.py, testcross.py's probe)."""
    model.eval()
    predict = model_predictor(model, cfg, dev)
    if cfg.task == "linear":
        ev = {"sigma_x": list(cfg.sigma_x), "sigma": list(cfg.sigma),
              "positions": list(range(cfg.eval_from, cfg.eval_points)),
              "outlier_at": {"position": cfg.outlier_position, "value": cfg.outlier_value}}
        for kind in LINEAR_GRIDS:
            how = {"outlier": kind != "clean", "after_outlier": kind == "outlier_after"}
            ev[kind] = {"model": evaluate_linear(predict, cfg, seed, **how),
                        "least_squares": evaluate_linear(least_squares_affine, cfg, seed, **how)}
    else:
        ev = {"lengths": list(cfg.every_lengths), "sigma": list(cfg.every_sigma), "from": cfg.every_from,
              **evaluate_every(predict, cfg, seed)}
        probe = torch.tensor([CROSS_PROBE_X])
        labels = every_labels(probe)
        logits = predict(probe, labels)[0]
        ev["cross_probe"] = {"x": list(CROSS_PROBE_X), "labels": labels[0].tolist(), "logits": logits.tolist(),
                             "correct": ((logits > 0) == (labels[0] > 0)).tolist()}
    return ev


class _Trainer:
    """One run in progress: its model, optimizer, step and loss window, advanced one step at
    a time by :func:`train_runs` (several of these can take turns in one process).

    On CUDA every piece of a run's work (building, steps, checkpoints, evaluation) is
    enqueued on the run's own stream, so the runs of one process overlap on the GPU, and a
    step makes the host wait for nothing: the batch is drawn on the CPU (the same draws as
    ever) and copied from pinned memory without blocking, and the loss stays on the device
    (window sums are read back at checkpoints, log lines and the end). With ``graphs`` the
    whole step (forward, backward, Adam, the loss sum) is one CUDA graph per prompt length,
    captured after ``GRAPH_WARMUP`` eager steps at that length and replayed from then on;
    Adam then runs fused with its step count on the device (``capturable``): the same update
    rule, one launch for all parameters. On CPU a step is exactly the loop it always was."""

    def __init__(self, cfg: PaperConfig, attention: str, seed: int, *, ckpt_path: Optional[str],
                 dev: torch.device, graphs: bool = False, log: Callable[[str], None] = print):
        from nemo_ssa.megatron.single import init_single_process

        init_single_process(seed)  # the model's initialisation is a function of the seed
        self.cfg, self.attention, self.seed, self.ckpt_path = cfg, attention, seed, ckpt_path
        self.dev, self.log = dev, log
        self.name = run_name(cfg, attention, seed)
        self.cuda = dev.type == "cuda"
        self.graphs = bool(graphs) and self.cuda
        self.stream = torch.cuda.Stream(device=dev) if self.cuda else None
        with self._on_stream():
            self.model = PaperModel(cfg, attention).to(dev)
            self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr,
                                        **({"capturable": True, "fused": True} if self.graphs else {}))
            self.start, self.curve, window, self.seconds = 0, [], [0.0, 0], 0.0
            if ckpt_path is not None and os.path.isfile(ckpt_path):
                state = torch.load(ckpt_path, map_location=dev, weights_only=True)
                if state.get("config") == run_identity(cfg, attention) and state.get("attention") == attention:
                    self.model.load_state_dict(state["model"])
                    self.opt.load_state_dict(state["optimizer"])
                    self.start, self.curve, window, self.seconds = (state["step"], state["curve"], state["window"],
                                                                    state["seconds"])
                    log(f"[icl_paper] {self.name}: resumed at step {self.start}/{cfg.steps} from {ckpt_path}")
                else:
                    log(f"[icl_paper] {self.name}: {ckpt_path} is another configuration's checkpoint; starting afresh")
            # the window's loss sum stays on the device: reading a loss every step would make
            # the host wait for the GPU every step
            self.acc = torch.tensor(float(window[0]), dtype=torch.float64, device=dev)
        self.count = window[1]
        self.step = self.start
        self.every = max(1, cfg.steps // CURVE_POINTS)  # the loss curve: means over windows of `every` steps
        self.pending: List[list] = []  # finished windows not read back yet: [step, sum on the device, count]
        self.graph = self.static_xy = self.last_loss = None
        self.graph_points, self.warm = None, 0
        self.t0 = self.t_log = time.time()
        self.s_log = self.start

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    @property
    def done(self) -> bool:
        return self.step >= self.cfg.steps

    def advance(self) -> None:
        """Train step ``self.step`` (on CUDA: enqueue it) and close the loss window if it ends there."""
        cfg = self.cfg
        with self._on_stream():
            x, y = training_batch(cfg, self.seed, self.step)
            xy = torch.stack((x, y))
            if self.cuda:
                xy = xy.pin_memory()  # copied without blocking (a copy from pageable memory waits for the GPU)
            if self.graphs and self._graph_ready():
                self.static_xy.copy_(xy, non_blocking=True)
                self.graph.replay()
            elif self.cuda:
                xy = xy.to(self.dev, non_blocking=True)
                self._eager_step(xy[0], xy[1])
            else:
                self._eager_step(x, y)
            self.count += 1
            self.step += 1
            if self.step % self.every == 0 or self.step == cfg.steps:
                self.pending.append([self.step, self.acc.clone(), self.count])
                self.acc.zero_()
                self.count = 0

    def _eager_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = task_loss(self.model(to_tokens(x, y)), y, self.cfg.task)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.acc += loss.detach().double()
        self.last_loss = loss.detach()

    def _graph_ready(self) -> bool:
        """Whether this step replays a graph: a new prompt length drops the old one, and the
        new one is captured after ``GRAPH_WARMUP`` eager steps at that length."""
        points = curriculum_points(self.cfg, self.step)
        if points != self.graph_points:
            self.graph = self.static_xy = None
            self.graph_points, self.warm = points, 0
        if self.graph is None:
            if self.warm < GRAPH_WARMUP:
                self.warm += 1
                return False
            self._capture(points)
        return self.graph is not None

    def _capture(self, points: int) -> None:
        cfg = self.cfg
        static_xy = torch.zeros((2, cfg.batch, points), device=self.dev)
        self.opt.zero_grad(set_to_none=True)  # .grad is then allocated in the graph: each replay writes it
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                x, y = static_xy[0], static_xy[1]
                loss = task_loss(self.model(to_tokens(x, y)), y, cfg.task)
                loss.backward()
                self.opt.step()
                self.acc += loss.detach().double()
        except Exception as e:  # capture runs nothing: the weights are untouched, the step runs eagerly
            self.graphs = False
            self.opt.zero_grad(set_to_none=True)
            self.log(f"[icl_paper] {self.name}: CUDA graph capture failed at {points} points "
                     f"({type(e).__name__}: {e}); this run continues without graphs")
            return
        self.graph, self.static_xy, self.last_loss = graph, static_xy, loss.detach()

    def maybe_log(self, log_every: int) -> None:
        done = self.step
        if log_every and done % log_every == 0:
            rate = (done - self.s_log) / max(time.time() - self.t_log, 1e-9)
            with self._on_stream():
                loss = float(self.last_loss)
            self.log(f"[icl_paper] {self.name} step {done}/{self.cfg.steps} points "
                     f"{curriculum_points(self.cfg, done - 1)} loss {loss:.4g} ({rate:.1f} steps/s)")
            self.t_log, self.s_log = time.time(), done

    def _read_curve(self) -> None:
        """The finished windows' means, read back (a host sync on CUDA)."""
        for step, total, count in self.pending:
            self.curve.append([step, float(total) / count])
        self.pending.clear()

    def checkpoint(self) -> None:
        with self._on_stream():
            self._read_curve()
            _save_atomic({"config": run_identity(self.cfg, self.attention), "attention": self.attention,
                          "seed": self.seed,
                          "step": self.step, "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                          "curve": self.curve, "window": [float(self.acc), self.count],
                          "seconds": self.seconds + time.time() - self.t0},
                         self.ckpt_path, torch_save=True)

    def finish(self) -> Dict:
        """Evaluate the trained model: the run's result."""
        from nemo_ssa.config.policy import kernels_chosen

        self.seconds += time.time() - self.t0
        self.graph = self.static_xy = None
        with self._on_stream():
            self._read_curve()
            t_eval = time.time()
            ev = _evaluate(self.model, self.cfg, self.seed, self.dev)
        return {"task": self.cfg.task, "attention": self.attention, "seed": self.seed, "steps": self.cfg.steps,
                "loss_curve": self.curve, "eval": ev, "train_seconds": self.seconds,
                "eval_seconds": time.time() - t_eval, "ssa_scalars": ssa_scalars(self.model),
                # which kernels this process chose (the backward schedule sets whether a rerun repeats
                # this one to the last bit); with --concurrent, every run of the process
                "kernels": kernels_chosen()}


def ssa_scalars(model: torch.nn.Module) -> Optional[Dict[str, List[float]]]:
    """n and b of every SSA layer at the end of training (layer order), None without SSA."""
    layers = [m for m in model.modules()
              if isinstance(getattr(m, "n", None), torch.Tensor) and isinstance(getattr(m, "b", None), torch.Tensor)]
    if not layers:
        return None
    return {k: [float(getattr(m, k).detach().float().mean()) for m in layers] for k in ("n", "b")}


def set_deterministic(on: bool) -> None:
    """torch's deterministic algorithms for the process when ``on`` (PaperConfig.deterministic);
    off leaves torch's setting alone. cuBLAS needs its workspace pinned before its first handle
    (set here when unset: a process that already ran a CUDA matmul must set it itself)."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an op without a deterministic kernel warns instead of stopping a run mid-way
    torch.use_deterministic_algorithms(True, warn_only=True)


def _training_device() -> Tuple[torch.device, Callable]:
    """The device runs train on, and the context they train in (megatron's CUDA placements
    redirected to the CPU where there is no CUDA)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), contextlib.nullcontext
    from nemo_ssa.megatron.cpu import cpu_device_shims

    return torch.device("cpu"), cpu_device_shims


def train_runs(cfg: PaperConfig, jobs: Sequence[Tuple[str, int]], *, ckpt_dir: str, concurrent: int = 1,
               graphs: bool = False, checkpoint_every: int = 1000, stop_after: Optional[int] = None,
               deadline: Optional[float] = None, log_every: int = 0, log: Callable[[str], None] = print,
               on_result: Optional[Callable[[str, int, Optional[Dict]], None]] = None,
               ckpt_paths: Optional[Dict[Tuple[str, int], str]] = None) -> Dict[Tuple[str, int], Optional[Dict]]:
    """Train (or resume) the runs ``jobs`` (``(attention, seed)`` pairs), up to ``concurrent``
    of them at once in this process, taking turns step by step (each on its own CUDA stream,
    see :class:`_Trainer`); a finished run makes room for the next. Each run is exactly what
    it is when trained alone: its own seed, batches and steps. Returns ``{job: result}``,
    None for a run the call ended early (``stop_after`` steps trained in this call, or
    ``deadline`` passed: the run's checkpoint in ``ckpt_dir`` then holds everything a later
    call resumes from) or never started (``deadline`` passed first). ``on_result(attention,
    seed, result)`` is called as each run ends. A run's checkpoint is
    ``<ckpt_dir>/<task>-<attention>-s<seed>.pt`` unless ``ckpt_paths[job]`` names another."""
    if concurrent < 1:
        raise ValueError(f"concurrent must be >= 1 (got {concurrent})")
    dev, context = _training_device()
    if graphs and dev.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device (run without --cuda-graphs on a CPU)")
    if cfg.tf32 and dev.type != "cuda":
        raise ValueError("tf32 is a CUDA matmul mode; on a CPU, run without --tf32")
    if dev.type == "cuda":
        # the run's precision is part of its configuration (PaperConfig.tf32), set for the whole process
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    set_deterministic(cfg.deterministic)
    results: Dict[Tuple[str, int], Optional[Dict]] = {}
    pending = list(dict.fromkeys((a, int(s)) for a, s in jobs))

    def end(job: Tuple[str, int], r: Optional[Dict]) -> None:
        results[job] = r
        if on_result is not None:
            on_result(job[0], job[1], r)

    with context():
        active: List[_Trainer] = []
        while pending or active:
            while pending and len(active) < concurrent and (deadline is None or time.time() < deadline):
                attention, seed = pending.pop(0)
                path = (ckpt_paths or {}).get((attention, seed)) or \
                    os.path.join(ckpt_dir, run_name(cfg, attention, seed) + ".pt")
                tr = _Trainer(cfg, attention, seed, ckpt_path=path, dev=dev, graphs=graphs, log=log)
                if tr.done:
                    end((attention, seed), tr.finish())
                else:
                    active.append(tr)
            if not active:
                if pending:  # the deadline passed before these started
                    for job in pending:
                        end(job, None)
                    pending = []
                continue
            for tr in list(active):
                tr.advance()
                tr.maybe_log(log_every)
                done, job = tr.step, (tr.attention, tr.seed)
                if done >= cfg.steps:
                    active.remove(tr)
                    end(job, tr.finish())
                elif (stop_after is not None and done - tr.start >= stop_after) or \
                        (deadline is not None and time.time() > deadline):
                    tr.checkpoint()
                    log(f"[icl_paper] {tr.name}: stopped at step {done}/{cfg.steps}; checkpoint {tr.ckpt_path}")
                    active.remove(tr)
                    end(job, None)
                elif checkpoint_every and done % checkpoint_every == 0:
                    tr.checkpoint()
    return results


def train_run(cfg: PaperConfig, attention: str, seed: int, *, ckpt_path: str, checkpoint_every: int = 1000,
              stop_after: Optional[int] = None, deadline: Optional[float] = None, log_every: int = 0,
              log: Callable[[str], None] = print, graphs: bool = False) -> Optional[Dict]:
    """Train (or resume) one run and evaluate it. Returns the result, or None when the call
    ended it early (``stop_after`` steps trained in this call, or ``deadline`` passed): the
    checkpoint at ``ckpt_path`` then holds everything a later call resumes from."""
    job = (attention, int(seed))
    return train_runs(cfg, [job], ckpt_dir=os.path.dirname(ckpt_path), ckpt_paths={job: ckpt_path}, graphs=graphs,
                      checkpoint_every=checkpoint_every, stop_after=stop_after, deadline=deadline,
                      log_every=log_every, log=log)[job]


def bench(cfg: PaperConfig, jobs: Sequence[Tuple[str, int]], *, steps: int, at: Sequence[int], graphs: bool = False,
          log: Callable[[str], None] = print) -> List[Dict]:
    """Time ``steps`` training steps of all ``jobs`` together (as ``--concurrent len(jobs)``
    trains them: one process, taking turns, each on its own stream) from each step in ``at``
    (the prompt length of that step), after warm-up (graphs captured). Fresh models, nothing
    read or written. Per start step: wall seconds, steps/s per run and in all, and the host's
    seconds per run-step (the time to enqueue, before waiting for the device)."""
    dev, context = _training_device()
    if graphs and dev.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device (run without --cuda-graphs on a CPU)")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    with context():
        for start in at:
            if not 0 <= start < cfg.steps - steps - GRAPH_WARMUP - 1:
                raise ValueError(f"bench at step {start}: {steps} steps and the warm-up must fit in {cfg.steps} steps")
            trainers = [_Trainer(cfg, a, s, ckpt_path=None, dev=dev, graphs=graphs, log=log) for a, s in jobs]
            for tr in trainers:
                tr.step = tr.start = start
            t_warm = time.perf_counter()
            for _ in range(GRAPH_WARMUP + 1):  # the eager steps and the capture
                for tr in trainers:
                    tr.advance()
            sync()
            t_warm = time.perf_counter() - t_warm
            t0 = time.perf_counter()
            for _ in range(steps):
                for tr in trainers:
                    tr.advance()
            host = time.perf_counter() - t0
            sync()
            wall = time.perf_counter() - t0
            row = {"step": start, "points": curriculum_points(cfg, start), "runs": len(trainers), "steps": steps,
                   "graphs": [tr.graph is not None for tr in trainers], "warmup_s": t_warm, "wall_s": wall,
                   "steps_per_s_per_run": steps / wall, "steps_per_s_all": steps * len(trainers) / wall,
                   "host_ms_per_step": 1e3 * host / (steps * len(trainers))}
            rows.append(row)
            on = "on" if all(row["graphs"]) else "off" if not any(row["graphs"]) else "partly"
            log(f"[icl_paper] bench {cfg.task} {','.join(f'{a}-s{s}' for a, s in jobs)} at step {start} "
                f"({row['points']} points, graphs {on}"
                f"{', tf32' if cfg.tf32 else ''}): {row['steps_per_s_per_run']:.3g} steps/s per run, "
                f"{row['steps_per_s_all']:.3g} in all; host {row['host_ms_per_step']:.2f} ms per run-step; "
                f"warm-up {t_warm:.1f} s")
            del trainers
    return rows


# ----------------------------------------------------------------------------- runs on disk
def run_path(out: str, cfg: PaperConfig, attention: str, seed: int) -> str:
    return os.path.join(out, "runs", run_name(cfg, attention, seed) + ".json")


def load_run(out: str, cfg: PaperConfig, attention: str, seed: int) -> Optional[Dict]:
    """A finished run with this exact configuration, else None (a changed setup retrains)."""
    path = run_path(out, cfg, attention, seed)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    return saved["result"] if saved.get("config") == run_identity(cfg, attention) else None


# ----------------------------------------------------------------------------- summary
def _mean_sd(vals: Sequence[float]) -> Tuple[float, Optional[float]]:
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def _fmt(vals: Sequence[float]) -> str:
    m, sd = _mean_sd(vals)
    return f"{m:.4g}" + (f" ± {sd:.2g}" if sd is not None else "")


def _grids(results: List[Dict], attention: str, key: Callable[[Dict], List[List[float]]]) -> Dict[int, List[List[float]]]:
    return {r["seed"]: key(r) for r in results if r["attention"] == attention}


def _cellwise(grids: Sequence[List[List[float]]], fn) -> List[List[float]]:
    rows, cols = len(grids[0]), len(grids[0][0])
    return [[fn([g[i][j] for g in grids]) for j in range(cols)] for i in range(rows)]


def _write_heatmap(path_base: str, grid: List[List[float]], rows: Sequence, cols: Sequence, row_name: str,
                   col_name: str, title: str, diverging: bool = False) -> List[str]:
    """``<path_base>.csv`` (first column the row values, header the column values) and, with
    matplotlib, ``<path_base>.png``. Returns the files written."""
    with open(path_base + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f"{row_name}\\{col_name}"] + list(cols))
        for r, vals in zip(rows, grid):
            w.writerow([r] + [f"{v:.6g}" for v in vals])
    written = [path_base + ".csv"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.colors as mcolors
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    data = torch.tensor(grid, dtype=torch.float64).numpy()
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 + 0.5 * len(cols)), max(3.5, 1.2 + 0.4 * len(rows))))
    finite = data[torch.isfinite(torch.from_numpy(data)).numpy()]
    if diverging:
        lim = float(abs(finite).max()) if finite.size else 1.0
        norm = mcolors.Normalize(vmin=-(lim or 1.0), vmax=lim or 1.0)  # white = no difference
        cmap = "coolwarm"
    else:
        pos = finite[finite > 0]
        norm = mcolors.LogNorm(vmin=float(pos.min()), vmax=float(pos.max())) if pos.size and pos.max() > pos.min() else None
        cmap = "viridis"
    im = ax.imshow(data, origin="lower", aspect="auto", cmap=cmap, norm=norm)
    if data.size <= 150:  # small grids carry their numbers (the CSV has them all)
        for (i, j), v in ((ij, data[ij]) for ij in itertools.product(range(len(rows)), range(len(cols)))):
            ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=6)
    ax.set_xticks(range(len(cols)), [f"{c:g}" for c in cols], fontsize=7)
    ax.set_yticks(range(len(rows)), [f"{r:g}" for r in rows], fontsize=7)
    ax.set_xlabel(col_name)
    ax.set_ylabel(row_name)
    ax.set_title(title, fontsize=8)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path_base + ".png", dpi=110)
    plt.close(fig)
    return written + [path_base + ".png"]


def _verdict_counts(a: Dict[int, List[List[float]]], b: Dict[int, List[List[float]]], names: Tuple[str, str]) -> Tuple[Dict[str, int], List]:
    """Seed-paired verdicts per cell (nemo_ssa.study.verdict's rule): how many cells each
    attention is lower in, beyond the seed spread, and how many show no difference."""
    from nemo_ssa.study.verdict import compare_pair

    flat = lambda g: [v for row in g for v in row]  # noqa: E731
    n = len(flat(next(iter(a.values()))))
    runs_a = {s: (list(range(n)), flat(g)) for s, g in a.items()}
    runs_b = {s: (list(range(n)), flat(g)) for s, g in b.items()}
    vs = compare_pair(runs_a, runs_b, [(i, i) for i in range(n)], names=names)
    counts = {f"{names[0]} lower": 0, f"{names[1]} lower": 0, "no difference": 0, "no verdict (one seed)": 0}
    for v in vs:
        if v.ci is None:
            counts["no verdict (one seed)"] += 1
        elif v.detected:
            counts[f"{names[0] if v.diff < 0 else names[1]} lower"] += 1
        else:
            counts["no difference"] += 1
    return counts, vs


def summarize(out: str, cfg: PaperConfig, results: List[Dict], names: List[str], missing: List[str]) -> str:
    """``icl_paper.json``, ``icl_paper.md`` and ``heatmaps/`` from the finished runs; returns the md text."""
    hm = os.path.join(out, "heatmaps")
    os.makedirs(hm, exist_ok=True)
    names = [n for n in names if any(r["attention"] == n for r in results)]
    lines = [f"# The SSA paper's in-context experiment: task `{cfg.task}`", "",
             f"Model: {cfg.layers} layers, {cfg.heads} heads, width {cfg.hidden}, {cfg.positions} positions, "
             f"{'fp32 with TF32 matrix products' if cfg.tf32 else 'fp32'}; "
             f"Adam lr {cfg.lr:g}, batch {cfg.batch}, {cfg.steps} steps; prompts of {cfg.points_start} points "
             f"+{cfg.points_inc} every {cfg.points_interval} steps up to {cfg.points_end}. "
             "The setup and how it follows the authors' code: docs/icl-paper-setup.md in the repository.", ""]
    seeds = sorted({r["seed"] for r in results})
    lines.append(f"Finished runs: {len(results)} ({', '.join(names) or 'none'}; seeds {seeds})."
                 + (f" Unfinished or missing: {', '.join(missing)}." if missing else ""))
    for v in cfg.variants:
        if v.label in names:
            opts = " ".join(f"{k}={val}" for k, val in v.options)
            lines.append(f"`{v.label}` = `{v.attention}` under policy={v.policy}" + (f", {opts}" if opts else "") + ".")
    lines.append("")
    files: List[str] = []
    if not results:
        text = "\n".join(lines) + "\n"
        _write_md(out, text)
        return text
    base = names[0]
    if cfg.task == "linear":
        rows, cols = cfg.sigma_x, cfg.sigma
        kinds = [k for k in LINEAR_GRIDS if all(k in r["eval"] for r in results)]
        ls = {kind: _cellwise([r["eval"][kind]["least_squares"] for r in results], statistics.fmean)
              for kind in kinds}
        lines += [f"Squared error over points {cfg.eval_from}…{cfg.eval_points - 1} of {cfg.eval_points}-point prompts, "
                  f"{cfg.functions} functions × {cfg.eval_prompts} prompts per cell; x ~ N(0, σx²), a, b ~ N(0, σ²); "
                  f"outlier: x at point {cfg.outlier_position} = {cfg.outlier_value:g} (`outlier_after`: only the "
                  f"points after it, {cfg.outlier_position + 1}…{cfg.eval_points - 1}"
                  + ("" if "outlier_after" in kinds else "; not in these runs, evaluated before that grid existed")
                  + "). Mean ± sd over seeds.", "",
                  "| attention | grid | σx=σ=1 | grid mean | worst cell | least squares (max cell) |", "|---|---|---|---|---|---|"]
        for kind in kinds:
            files += _write_heatmap(os.path.join(hm, f"linear-least-squares-{kind}"), ls[kind], rows, cols, "sigma_x",
                                    "sigma", f"least squares, {kind}")
            for n in names:
                g = _grids(results, n, lambda r: r["eval"][kind]["model"])
                mean = _cellwise(list(g.values()), statistics.fmean)
                files += _write_heatmap(os.path.join(hm, f"linear-{n}-{kind}"), mean, rows, cols, "sigma_x", "sigma",
                                        f"{n}: squared error ({kind}), mean over {len(g)} seed(s)")
                floor = _grids(results, n, lambda r: r["eval"][kind]["least_squares"])
                above = _cellwise([[[v - f for v, f in zip(rm, rf)] for rm, rf in zip(g[s], floor[s])] for s in g],
                                  statistics.fmean)
                files += _write_heatmap(os.path.join(hm, f"linear-{n}-minus-least-squares-{kind}"), above, rows, cols,
                                        "sigma_x", "sigma", f"{n} minus least squares ({kind})")
                flat = [statistics.fmean(v for row in gs for v in row) for gs in g.values()]
                worst = max((v, i, j) for i, row in enumerate(mean) for j, v in enumerate(row))
                lines.append(f"| {n} | {kind} | {_fmt([gs[0][0] for gs in g.values()])} | {_fmt(flat)} | "
                             f"{worst[0]:.4g} at σx={rows[worst[1]]:g}, σ={cols[worst[2]]:g} | "
                             f"{max(v for row in ls[kind] for v in row):.2g} |")
        lines.append("")
        for other in names[1:]:
            for kind in kinds:
                ga = _grids(results, base, lambda r: r["eval"][kind]["model"])
                gb = _grids(results, other, lambda r: r["eval"][kind]["model"])
                paired = [s for s in ga if s in gb]
                diffs = [[[va - vb for va, vb in zip(ra, rb)] for ra, rb in zip(ga[s], gb[s])] for s in paired]
                if not diffs:
                    continue
                tag = f"linear-{base}-minus-{other}-{kind}"
                files += _write_heatmap(os.path.join(hm, tag), _cellwise(diffs, statistics.fmean), rows, cols,
                                        "sigma_x", "sigma", f"{base} - {other} ({kind}), mean over {len(diffs)} seed(s)",
                                        diverging=True)
                if len(diffs) > 1:
                    files += _write_heatmap(os.path.join(hm, tag + "-sd"), _cellwise(diffs, statistics.stdev), rows,
                                            cols, "sigma_x", "sigma", f"sd over seeds of {base} - {other} ({kind})")
                counts, _ = _verdict_counts({s: ga[s] for s in paired}, {s: gb[s] for s in paired}, (base, other))
                lines.append(f"**{base} − {other}, {kind}** ({len(paired)} paired seeds; positive: {other} lower): "
                             f"σx=σ=1 {_fmt([d[0][0] for d in diffs])}; grid mean "
                             f"{_fmt([statistics.fmean(v for row in d for v in row) for d in diffs])}; cells by the "
                             f"study's verdict rule: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + ".")
                lines.append("")
    else:
        rows, cols = cfg.every_lengths, cfg.every_sigma
        lines += [f"Fraction of the {cfg.eval_prompts} prompts with any wrong sign at points {cfg.every_from} and later "
                  "(testoverlandx.py's count / prompts); x ~ N(0, σ²). Mean ± sd over seeds.", "",
                  f"| attention | length {rows[0]}, σ={cols[0]:g} | grid mean | worst cell | cross probe correct (per seed) |",
                  "|---|---|---|---|---|"]
        for n in names:
            g = _grids(results, n, lambda r: r["eval"]["prompt_error"])
            mean = _cellwise(list(g.values()), statistics.fmean)
            files += _write_heatmap(os.path.join(hm, f"every-{n}"), mean, rows, cols, "length", "sigma",
                                    f"{n}: prompts with an error, mean over {len(g)} seed(s)")
            worst = max((v, i, j) for i, row in enumerate(mean) for j, v in enumerate(row))
            probes = ["".join("✓" if c else "✗" for c in r["eval"]["cross_probe"]["correct"])
                      for r in results if r["attention"] == n]
            lines.append(f"| {n} | {_fmt([gs[0][0] for gs in g.values()])} | "
                         f"{_fmt([statistics.fmean(v for row in gs for v in row) for gs in g.values()])} | "
                         f"{worst[0]:.3g} at length {rows[worst[1]]}, σ={cols[worst[2]]:g} | {' '.join(probes)} |")
        lines.append("")
        for other in names[1:]:
            ga = _grids(results, base, lambda r: r["eval"]["prompt_error"])
            gb = _grids(results, other, lambda r: r["eval"]["prompt_error"])
            paired = [s for s in ga if s in gb]
            diffs = [[[va - vb for va, vb in zip(ra, rb)] for ra, rb in zip(ga[s], gb[s])] for s in paired]
            if not diffs:
                continue
            tag = f"every-{base}-minus-{other}"
            files += _write_heatmap(os.path.join(hm, tag), _cellwise(diffs, statistics.fmean), rows, cols, "length",
                                    "sigma", f"{base} - {other}, mean over {len(diffs)} seed(s)", diverging=True)
            if len(diffs) > 1:
                files += _write_heatmap(os.path.join(hm, tag + "-sd"), _cellwise(diffs, statistics.stdev), rows, cols,
                                        "length", "sigma", f"sd over seeds of {base} - {other}")
            counts, _ = _verdict_counts({s: ga[s] for s in paired}, {s: gb[s] for s in paired}, (base, other))
            lines.append(f"**{base} − {other}** ({len(paired)} paired seeds; positive: {other} lower): grid mean "
                         f"{_fmt([statistics.fmean(v for row in d for v in row) for d in diffs])}; cells by the "
                         "study's verdict rule: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + ".")
            lines.append("")
    scalars = [(n, [r["ssa_scalars"] for r in results if r["attention"] == n and r.get("ssa_scalars")]) for n in names]
    scalars = [(n, rs) for n, rs in scalars if rs]
    if scalars:
        lines += ["n and b per layer at the end of training (mean over seeds; layer 1 first):", "",
                  "| run | seeds | n | b |", "|---|---|---|---|"]
        for n, rs in scalars:
            per = {k: [statistics.fmean(r[k][i] for r in rs) for i in range(len(rs[0][k]))] for k in ("n", "b")}
            lines.append(f"| {n} | {len(rs)} | {' '.join(f'{v:.3f}' for v in per['n'])} | "
                         f"{' '.join(f'{v:.3f}' for v in per['b'])} |")
        lines.append("")
    lines += ["Heat maps (rows first in each name, CSV with the row values in the first column):", ""]
    lines += [f"- [{os.path.basename(p)}](heatmaps/{os.path.basename(p)})" for p in files if p.endswith(".csv")]
    text = "\n".join(lines) + "\n"
    _write_md(out, text)
    _save_atomic({"config": cfg.identity(), "results": results}, os.path.join(out, "icl_paper.json"))
    return text


def _write_md(out: str, text: str) -> None:
    path = os.path.join(out, "icl_paper.md")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=TASKS, default="linear")
    ap.add_argument("--attentions", default="softmax,ssa", help="names from the attention table, comma-separated")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1,
                    help="seeds first..first+seeds-1 (one process per attention/seed can share an --out)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (the authors': 500001)")
    ap.add_argument("--positions", choices=POSITIONS, default=None, help="learned (GPT-2's, default) or rope")
    ap.add_argument("--tf32", action="store_true",
                    help="TF32 matrix products (CUDA only; part of the run's configuration: fp32 runs are not reused)")
    ap.add_argument("--deterministic", action="store_true",
                    help="bit-exact reruns: torch's deterministic algorithms (the SSA backward without atomics; "
                         "a configuration of its own: runs without it are not reused)")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny model and grid (seconds on CPU)")
    ap.add_argument("--out", default=None, help="where runs, checkpoints and the summary go (required but with --bench-steps)")
    ap.add_argument("--ckpt-dir", default=None, help="where runs in progress checkpoint (default <out>/ckpt)")
    ap.add_argument("--checkpoint-every", type=int, default=1000)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop training (checkpointed) once this many seconds have passed in this call")
    ap.add_argument("--stop-after-steps", type=int, default=None,
                    help="train at most this many steps per run in this call, then checkpoint and stop")
    ap.add_argument("--log-every", type=int, default=None, help="progress line every N steps (default steps/10)")
    ap.add_argument("--summary-only", action="store_true", help="write the summary from the finished runs only")
    ap.add_argument("--concurrent", type=int, default=1,
                    help="train up to N of this call's runs at once in this process, taking turns step by step "
                         "(each on its own CUDA stream; pays with --cuda-graphs). Default 1: one after another")
    ap.add_argument("--variant", action="append", default=[], metavar='"LABEL=ATTENTION KEY=VALUE ..."',
                    help="an attention under its own policy and SSA options, run under LABEL (name it in "
                         "--attentions), e.g. \"ssa_nb=ssa policy=free learnable_b=true n_min=1.0\"; repeatable")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="CUDA only: each run's whole training step (forward, backward, fused Adam) as one CUDA graph "
                         "per prompt length, replayed")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: 1 with CUDA or --cpu-smoke, where the host's tensors are "
                         "tiny; else torch's default)")
    ap.add_argument("--bench-steps", type=int, default=None,
                    help="time N steps of the runs together (as --concurrent <all>) at each --bench-at step, "
                         "print steps/s and host ms per step, write nothing")
    ap.add_argument("--bench-at", default="0,14000,30000",
                    help="steps --bench-steps starts at (their prompt lengths: 11, 25 and 41 points)")
    args = ap.parse_args(argv)

    cfg = replace(CPU_SMOKE if args.cpu_smoke else PAPER, task=args.task)
    overrides = {k: v for k, v in (("steps", args.steps), ("positions", args.positions), ("tf32", args.tf32 or None),
                                   ("deterministic", args.deterministic or None)) if v is not None}
    if overrides:
        cfg = replace(cfg, **overrides)
    variants = [parse_variant(v) for v in args.variant]
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--variant labels given twice: {labels}")
    cfg = replace(cfg, variants=tuple(variants))
    names = check_attentions(args.attentions.split(","), variants=variants)
    unused = [v for v in labels if v not in names]
    if unused:
        raise ValueError(f"--variant {', '.join(unused)}: not in --attentions {args.attentions!r} (name it there)")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1 (got {args.seeds})")
    if args.concurrent < 1:
        raise ValueError(f"--concurrent must be >= 1 (got {args.concurrent})")
    cuda = torch.cuda.is_available()
    if (args.cuda_graphs or cfg.tf32) and not cuda and not args.summary_only:
        # a summary trains nothing: TF32 runs brought back from a GPU are summarised here under their own identity
        raise ValueError("--cuda-graphs and --tf32 need CUDA; on a CPU run without them (or with --summary-only)")
    threads = args.threads if args.threads is not None else (1 if cuda or args.cpu_smoke else None)
    if threads is not None:
        # CPU-only: matrices this small run ~50x slower when two threads fight over busy cores; with CUDA the
        # host only draws [64, 41] batches and enqueues work, and N processes x all cores oversubscribe
        torch.set_num_threads(max(1, threads))
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(a, s) for s in seeds for a in names]
    if args.bench_steps is not None:
        at = [int(v) for v in args.bench_at.split(",") if v.strip()]
        bench(cfg, jobs, steps=args.bench_steps, at=at, graphs=args.cuda_graphs, log=lambda m: print(m, flush=True))
        return 0
    if args.out is None:
        ap.error("--out is required (except with --bench-steps)")
    ckpt_dir = args.ckpt_dir or os.path.join(args.out, "ckpt")
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    os.makedirs(ckpt_dir, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.budget_s if args.budget_s is not None else None
    log_every = args.log_every if args.log_every is not None else max(cfg.steps // 10, 1)
    done: Dict[Tuple[str, int], Optional[Dict]] = {}
    for attention, seed in jobs:
        r = load_run(args.out, cfg, attention, seed)
        if r is not None:
            print(f"[icl_paper] {run_name(cfg, attention, seed)}: reused {run_path(args.out, cfg, attention, seed)}",
                  flush=True)
            done[(attention, seed)] = r
    to_train = [j for j in jobs if j not in done]

    def save(attention: str, seed: int, r: Optional[Dict]) -> None:
        done[(attention, seed)] = r
        if r is not None:
            _save_atomic({"config": run_identity(cfg, attention), "result": r},
                         run_path(args.out, cfg, attention, seed))
            ckpt = os.path.join(ckpt_dir, run_name(cfg, attention, seed) + ".pt")
            if os.path.isfile(ckpt):
                os.remove(ckpt)
        print(f"[icl_paper] {run_name(cfg, attention, seed)}: {'finished' if r is not None else 'unfinished'}; "
              f"{sum(v is not None for v in done.values())}/{len(jobs)} runs finished, {time.time() - t0:.0f} s",
              flush=True)

    if to_train and not args.summary_only and (deadline is None or time.time() < deadline):
        if args.concurrent == 1 and not args.cuda_graphs:
            for attention, seed in to_train:  # one at a time, as ever
                r = None
                if deadline is None or time.time() < deadline:
                    r = train_run(cfg, attention, seed,
                                  ckpt_path=os.path.join(ckpt_dir, run_name(cfg, attention, seed) + ".pt"),
                                  checkpoint_every=args.checkpoint_every, stop_after=args.stop_after_steps,
                                  deadline=deadline, log_every=log_every, log=lambda m: print(m, flush=True))
                save(attention, seed, r)
        else:
            train_runs(cfg, to_train, ckpt_dir=ckpt_dir, concurrent=args.concurrent, graphs=args.cuda_graphs,
                       checkpoint_every=args.checkpoint_every, stop_after=args.stop_after_steps, deadline=deadline,
                       log_every=log_every, log=lambda m: print(m, flush=True), on_result=save)
    results = [done[j] for j in jobs if done.get(j) is not None]
    missing = [run_name(cfg, a, s) for a, s in jobs if done.get((a, s)) is None]
    summarize(args.out, cfg, results, names, missing)
    print(f"[icl_paper] summary: {os.path.join(args.out, 'icl_paper.md')}"
          + (f"; unfinished: {', '.join(missing)} (call again to continue)" if missing else ""), flush=True)
    return EXIT_UNFINISHED if missing else 0


if __name__ == "__main__":
    sys.exit(main())
