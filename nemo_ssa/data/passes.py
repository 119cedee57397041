"""How many times a run reads its training split: tokens a run consumes over the tokens the
split holds. Past one pass the held-out loss measures memorization as much as learning (the
embedded corpus is 7.9M tokens; the recipe's 1,000 steps read 32.8M), so the launcher and the
study say it before a user reads a comparison off such runs."""

from __future__ import annotations

import os
import struct
from typing import Optional

__all__ = ["TRAIN_FRACTION", "RECORD", "corpus_tokens", "training_passes", "passes_note", "passes_record"]

#: what the launcher writes into a run directory (read by the study)
RECORD = "data.json"

#: the training share of the recipe's document split ("990,8,2", recipes/nemotron_114m.py)
TRAIN_FRACTION = 0.99

_MAGIC = b"MMIDIDX\x00\x00"
# Megatron's indexed-dataset dtype codes (megatron/core/datasets/indexed_dataset.py)
_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}


def corpus_tokens(prefix: str) -> int:
    """Tokens in a Megatron indexed dataset ``<prefix>.bin`` / ``.idx`` (the .bin's size over
    the item size the .idx header names)."""
    with open(prefix + ".idx", "rb") as f:
        head = f.read(len(_MAGIC) + 8 + 1)
    if len(head) < len(_MAGIC) + 9 or head[:len(_MAGIC)] != _MAGIC:
        raise ValueError(f"{prefix}.idx is not a Megatron indexed dataset index (bad header)")
    code = head[len(_MAGIC) + 8]
    if code not in _ITEMSIZE:
        raise ValueError(f"{prefix}.idx names dtype code {code} (supported: {sorted(_ITEMSIZE)})")
    return os.path.getsize(prefix + ".bin") // _ITEMSIZE[code]


def training_passes(prefix: str, *, max_steps: int, global_batch_size: int, seq_length: int,
                    train_fraction: float = TRAIN_FRACTION) -> float:
    """Tokens the run reads over the tokens of its training split."""
    split = corpus_tokens(prefix) * train_fraction
    return (int(max_steps) * int(global_batch_size) * int(seq_length)) / max(split, 1.0)


def passes_note(prefix: str, **run) -> Optional[str]:
    """One line when the run reads its training split more than once, else ``None``."""
    try:
        p = training_passes(prefix, **run)
    except (OSError, ValueError):
        return None  # a dataset this cannot read is not this note's to judge
    if p <= 1.0:
        return None
    tokens = int(run["max_steps"]) * int(run["global_batch_size"]) * int(run["seq_length"])
    return (f"this run reads {tokens / 1e6:.1f}M tokens from a training split of "
            f"{corpus_tokens(prefix) * run.get('train_fraction', TRAIN_FRACTION) / 1e6:.1f}M: {p:.1f} passes; "
            f"past the first, the held-out loss measures memorization too (more data: data.source=<dir> or "
            f"data.prefix=...)")


def passes_record(prefix: str, **run) -> dict:
    """``{"prefix", "corpus_tokens", "tokens_read", "passes"}`` for a run directory's
    :data:`RECORD` (``None`` values where the dataset cannot be read)."""
    tokens_read = int(run["max_steps"]) * int(run["global_batch_size"]) * int(run["seq_length"])
    try:
        total, passes = corpus_tokens(prefix), training_passes(prefix, **run)
    except (OSError, ValueError):
        total = passes = None
    return {"prefix": prefix, "corpus_tokens": total, "tokens_read": tokens_read, "passes": passes}
