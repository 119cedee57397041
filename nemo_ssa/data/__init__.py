"""Data utilities: a deterministic, cached, offline corpus builder (tokenizer + Megatron indexed dataset)."""

from nemo_ssa.data.corpus import (
    BUILDER_VERSION,
    EOD_TOKEN,
    PAD_TOKEN,
    CorpusError,
    CorpusInfo,
    DEFAULT_VOCAB_SIZE,
    build_corpus,
    NAMED_SOURCES,
    build_corpus_locked,
    default_corpus_dir,
)

__all__ = [
    "BUILDER_VERSION",
    "EOD_TOKEN",
    "PAD_TOKEN",
    "CorpusError",
    "CorpusInfo",
    "DEFAULT_VOCAB_SIZE",
    "build_corpus",
    "build_corpus_locked",
    "default_corpus_dir",
    "NAMED_SOURCES",
]
