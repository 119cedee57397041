"""The README's parallel-layout overrides compose with every train config (hydra refuses a
key a config does not list: ``train.num_gpus_per_node=2`` failed with "Key not in struct"
until the keys were listed), and ``train=auto`` keeps them when it resolves."""

import os

import pytest
from hydra import compose, initialize_config_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = ["train.num_nodes=2", "train.num_gpus_per_node=4", "train.tensor_parallel=2", "train.sequence_parallel=true",
          "train.context_parallel=2", "train.distributed_optimizer=true"]


def _pretrain():
    from nemo_ssa.cli import pretrain

    return pretrain


@pytest.mark.parametrize("train", sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "nemo_ssa", "configs", "train"))))
def test_layout_overrides_compose(train):
    with initialize_config_dir(config_dir=os.path.join(REPO, "nemo_ssa", "configs"), version_base=None):
        cfg = compose("config", overrides=[f"train={train}"] + LAYOUT)
    assert cfg.train.tensor_parallel == 2 and cfg.train.sequence_parallel is True
    assert cfg.train.context_parallel == 2 and cfg.train.num_gpus_per_node == 4 and cfg.train.num_nodes == 2
    if train == "auto":  # resolves to cpu_smoke here; the layout overrides survive the merge
        t = _pretrain()._train_cfg(cfg, False)
        assert (t.tensor_parallel, t.sequence_parallel, t.context_parallel, t.num_gpus_per_node) == (2, True, 2, 4)
        assert t.seq_length == 128  # cpu_smoke's own value where nothing was overridden

def test_defaults_are_one_process():
    with initialize_config_dir(config_dir=os.path.join(REPO, "nemo_ssa", "configs"), version_base=None):
        for train in ("cpu_smoke", "gpu_9min"):
            t = compose("config", overrides=[f"train={train}"]).train
            assert (t.num_nodes, t.num_gpus_per_node, t.tensor_parallel, t.sequence_parallel, t.context_parallel) \
                == (1, 1, 1, False, 1)
