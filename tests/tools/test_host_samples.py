"""host_samples on a synthetic py-spy speedscope record: the training thread, the warm-up cut,
the hook table and the ms-per-step arithmetic."""

import json

import pytest

from nemo_ssa.tools.host_samples import load_speedscope, main, steady_samples, summarize

SP = "/usr/lib/python3.12/site-packages/"
FRAMES = [
    ("fit", SP + "lightning/pytorch/trainer/trainer.py", 538),                   # 0
    ("_TrainingEpochLoop.advance", SP + "lightning/pytorch/loops/training_epoch_loop.py", 233),  # 1
    ("_call_callback_hooks", SP + "lightning/pytorch/trainer/call.py", 193),     # 2
    ("MetricsCallback.on_train_batch_end", "/repo/nemo_ssa/nemo/callbacks.py", 123),  # 3
    ("_call_strategy_hook", SP + "lightning/pytorch/trainer/call.py", 302),      # 4
    ("MegatronStrategy.training_step", SP + "nemo/lightning/pytorch/strategies/megatron_strategy.py", 772),  # 5
    ("CUDAGraph.replay", SP + "torch/cuda/graphs.py", 120),                      # 6
    ("compile", SP + "triton/compiler/compiler.py", 300),                         # 7
    ("_EvaluationLoop.run", SP + "lightning/pytorch/loops/evaluation_loop.py", 100),  # 8
    ("_TrainingEpochLoop.on_advance_end", SP + "lightning/pytorch/loops/training_epoch_loop.py", 300),  # 9
    ("bg", "/repo/x.py", 3),                                                     # 10
]


def _record(tmp_path, main_samples, rate=1000.0):
    frames = [{"name": n, "file": f, "line": ln, "col": None} for n, f, ln in FRAMES]
    profiles = [
        {"type": "sampled", "name": 'Thread 1 "bg"', "unit": "seconds", "startValue": 0, "endValue": 1,
         "samples": [[10]] * 50, "weights": [1 / rate] * 50},
        {"type": "sampled", "name": 'Thread 2 ""', "unit": "seconds", "startValue": 0, "endValue": 1,
         "samples": main_samples, "weights": [1 / rate] * len(main_samples)},
    ]
    path = tmp_path / "host.json"
    path.write_text(json.dumps({"shared": {"frames": frames}, "profiles": profiles}))
    return str(path)


def _samples():
    # warm-up: a compile inside the first step, then a steady step's worth of samples
    warm = [[0, 1, 4, 5, 7]] * 30 + [[0, 9]] * 5  # the first step ends outside advance
    steady = ([[0, 1, 4, 5, 6]] * 60 + [[0, 1, 2, 3]] * 30 + [[0, 1]] * 10) * 3
    val = [[0, 9, 8]] * 40  # validation after a step: outside advance, and OTHER anyway
    return warm + steady + val


def test_the_training_thread_and_the_warm_up_cut(tmp_path):
    split = steady_samples(load_speedscope(_record(tmp_path, _samples())))
    assert split["thread"] == 'Thread 2 ""'
    assert split["warm_loop"] == 30  # the step's samples up to the compile's last
    assert len(split["steady"]) == 300
    assert split["steady_s"] == pytest.approx(0.3)


def test_hooks_and_ms_per_step(tmp_path):
    out = summarize(load_speedscope(_record(tmp_path, _samples())), step_ms=20.0)
    rows = {line.split("|")[3].strip(): line for line in out.splitlines() if line.startswith("|") and "---" not in line}
    train = rows["MegatronStrategy.training_step (nemo/lightning/pytorch/strategies/megatron_strategy.py)"]
    assert train.split("|")[1].strip() == "60.0" and float(train.split("|")[2]) == pytest.approx(12.0)
    cb = rows["MetricsCallback.on_train_batch_end (nemo_ssa/nemo/callbacks.py)"]  # the checkout shortened
    assert cb.split("|")[1].strip() == "30.0" and float(cb.split("|")[2]) == pytest.approx(6.0)
    assert rows["(not inside a Lightning hook)"].split("|")[1].strip() == "10.0"
    # innermost: the graph replay line, with its file shortened below site-packages
    assert "CUDAGraph.replay (torch/cuda/graphs.py:120)" in rows
    # the loop frames every sample shares are not rows
    assert not any(k.startswith("fit (") for k in rows)


def test_not_a_training_record_is_a_clear_error(tmp_path):
    path = _record(tmp_path, [[10]] * 5)
    with pytest.raises(ValueError, match="no thread has a sample inside"):
        main([path])


def test_steady_work_under_dynamo_disable_and_a_checkpoint_check_is_not_cut(tmp_path):
    """torch.optim's fused step runs under a dynamo-disable wrapper every step and ModelCheckpoint
    decides not to save every step: both are the step's, only a save is left out."""
    global FRAMES
    extra = [("DisableContext.__call__.<locals>._fn", SP + "torch/_dynamo/eval_frame.py", 838),   # 11
             ("ModelCheckpoint.on_train_batch_end", SP + "lightning/pytorch/callbacks/model_checkpoint.py", 300),  # 12
             ("ModelCheckpoint._save_checkpoint", SP + "lightning/pytorch/callbacks/model_checkpoint.py", 400)]  # 13
    saved, FRAMES = FRAMES, FRAMES + extra
    try:
        samples = [[0, 1, 4, 5, 7]] * 5 + [[0, 1, 4, 11]] * 20 + [[0, 1, 2, 12]] * 10 + [[0, 1, 2, 12, 13]] * 7
        split = steady_samples(load_speedscope(_record(tmp_path, samples)))
    finally:
        FRAMES = saved
    assert split["warm_loop"] == 5 and split["other"] == 7 and len(split["steady"]) == 30
