"""Deterministic, cached, offline corpus builder.

Text comes from files every machine has (by default the running Python's standard-library
sources), from a user directory of text files, or from a ``.jsonl`` file with a ``"text"``
field. The builder

1. collects documents in a stable sorted order (one file or one jsonl line = one document;
   the text is used as is, nothing is normalised; empty documents are skipped),
2. trains a byte-level BPE tokenizer locally with HF ``tokenizers`` (special tokens
   ``<|endoftext|>`` = end of document / eos / bos / unk, and ``<|pad|>``) and saves it as a
   directory that ``transformers.AutoTokenizer`` and NeMo's ``AutoTokenizer`` load offline,
3. tokenizes every document, appends the end-of-document id and writes a Megatron indexed
   dataset ``<out>/<name>_text_document.{bin,idx}``,
4. writes ``<out>/manifest.json`` (inputs, options, sizes and sha256 of every output).

Same inputs and options give byte-identical ``.bin``/``.idx``/``tokenizer.json``: the BPE
trainer runs single-threaded (``TOKENIZERS_PARALLELISM=false`` while training); encoding is
deterministic and may use threads. A second call with the same options and inputs reuses the
existing output (``force=True`` rebuilds).

This module imports ``megatron.core`` lazily (only when it writes a dataset) and never NeMo.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

BUILDER_VERSION = "1"

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN)  # ids 0 and 1

MANIFEST_NAME = "manifest.json"
TOKENIZER_SUBDIR = "tokenizer"
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens
MIN_FREQUENCY = 2  # a merge must be seen at least twice

# Directory names never read from the standard library: installed third-party packages
# (they differ from machine to machine) and byte-code caches. The regression test suites
# (Lib/test, ...) are kept: they are ordinary Python text and more than double the corpus
# (CPython 3.11: ~12 MB without them, ~31 MB with them), which also lets the BPE reach a
# 50k vocabulary; where a distribution ships no test suite the corpus is just smaller.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_PURELIB_SKIP_DIRS = frozenset({"__pycache__", "tests", "test", "testing"})
_ENCODE_CHUNK = 256  # documents per encode_batch call

__all__ = [
    "CorpusInfo",
    "CorpusError",
    "build_corpus",
    "build_corpus_locked",
    "default_corpus_dir",
    "NAMED_SOURCES",
    "DEFAULT_VOCAB_SIZE",
    "EOD_TOKEN",
    "PAD_TOKEN",
    "BUILDER_VERSION",
]


class CorpusError(ValueError):
    """Bad corpus source or options (missing path, no usable documents, bad jsonl, ...)."""


@dataclass(frozen=True)
class CorpusInfo:
    prefix: str  # path prefix of the .bin/.idx (no extension)
    tokenizer_dir: str
    vocab_size: int  # tokenizer's real vocab size
    eod_id: int
    num_tokens: int
    num_documents: int
    manifest_path: str
    reused: bool = False  # True when an existing build was returned from the cache


def _repo_root() -> Optional[Path]:
    """The checkout this package runs from; None for an installed package (a wheel)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "nemo_ssa" / "__init__.py").is_file() else None


#: the embedded default's options (configs/data/stdlib.yaml: 50,257 tokens pad to 50,304)
DEFAULT_VOCAB_SIZE = 50_257


#: the named sources: documents collected from this Python's own files, nothing downloaded
NAMED_SOURCES = ("stdlib", "site-packages")


def default_corpus_dir(source: str = "stdlib") -> str:
    """``<repo>/data/<source>-corpus`` in a checkout, ``./data/<source>-corpus`` (the current
    directory, beside ``runs/``) for an installed package; the env var ``NEMO_SSA_DATA_DIR``
    replaces ``<repo>/data`` or ``./data``. ``source``: a named source (each gets its own
    directory, so building one never overwrites another); a path source has no default."""
    if source not in NAMED_SOURCES:
        raise CorpusError(f"corpus source {source!r} is a path: give data.dir (an output directory) for it; "
                          f"named sources with a default directory: {', '.join(NAMED_SOURCES)}")
    root = _repo_root()
    parent = os.environ.get("NEMO_SSA_DATA_DIR") or (str(root / "data") if root else "data")
    return os.path.join(os.path.abspath(os.path.expanduser(parent)), f"{source}-corpus")


# --------------------------------------------------------------------------------------
# Collecting documents
# --------------------------------------------------------------------------------------


@dataclass
class _Docs:
    kind: str  # "stdlib" | "site-packages" | "dir" | "jsonl"
    root: str
    texts: List[str]
    num_inputs: int  # files (or jsonl lines) used as documents
    total_bytes: int  # utf-8 bytes of the documents used
    sha256: str  # over the list of inputs (relative names) and their bytes
    skipped: Dict[str, int]


def _walk_sorted(root: Path, skip_dir: Callable[[str], bool], exclude: Optional[Path]) -> Iterator[Path]:
    """Every regular file under ``root`` in a stable order (sorted relative posix paths)."""
    found: List[Tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dp = Path(dirpath)
        keep = []
        for d in dirnames:
            sub = dp / d
            if skip_dir(d) or (exclude is not None and sub.resolve() == exclude):
                continue
            keep.append(d)
        dirnames[:] = sorted(keep)
        for f in filenames:
            p = dp / f
            if p.is_file():
                found.append((p.relative_to(root).as_posix(), p))
    found.sort(key=lambda t: t[0])
    for _, p in found:
        yield p


def _collect_files(
    kind: str,
    root: Path,
    paths: Iterator[Path],
    max_bytes: Optional[int],
) -> _Docs:
    h = hashlib.sha256()
    texts: List[str] = []
    total = 0
    skipped = {"empty": 0, "not_utf8_or_binary": 0, "over_max_bytes": 0}
    capped = False
    for p in paths:
        if capped:
            skipped["over_max_bytes"] += 1
            continue
        data = p.read_bytes()
        if not data:
            skipped["empty"] += 1
            continue
        if b"\x00" in data:
            skipped["not_utf8_or_binary"] += 1
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8_or_binary"] += 1
            continue
        if max_bytes is not None and total + len(data) > max_bytes:
            capped = True  # stop at the first document that does not fit: a prefix of the order
            skipped["over_max_bytes"] += 1
            continue
        rel = p.relative_to(root).as_posix().encode("utf-8")
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
        texts.append(text)
        total += len(data)
    return _Docs(kind, str(root), texts, len(texts), total, h.hexdigest(), skipped)


def _collect_jsonl(path: Path, max_bytes: Optional[int]) -> _Docs:
    h = hashlib.sha256()
    texts: List[str] = []
    total = 0
    skipped = {"empty": 0, "blank_lines": 0, "over_max_bytes": 0}
    capped = False
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                skipped["blank_lines"] += 1
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CorpusError(f"{path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise CorpusError(f'{path}:{lineno}: expected a JSON object with a string "text" field')
            text = obj["text"]
            if not text:
                skipped["empty"] += 1
                continue
            if capped:
                skipped["over_max_bytes"] += 1
                continue
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError as e:  # lone surrogates from "\ud800"-style escapes
                raise CorpusError(f'{path}:{lineno}: "text" is not valid Unicode ({e})') from None
            if max_bytes is not None and total + len(data) > max_bytes:
                capped = True
                skipped["over_max_bytes"] += 1
                continue
            h.update(len(data).to_bytes(8, "little") + data)
            texts.append(text)
            total += len(data)
    return _Docs("jsonl", str(path), texts, len(texts), total, h.hexdigest(), skipped)


def _collect(source: str, max_bytes: Optional[int], out_dir: Path) -> _Docs:
    if source in NAMED_SOURCES:
        # stdlib: the standard library without its tests; site-packages: the installed
        # packages' sources without test directories (254 MB in the CPU lock's environment,
        # 8x stdlib's tokens)
        key, skip = ("stdlib", _STDLIB_SKIP_DIRS) if source == "stdlib" else ("purelib", _PURELIB_SKIP_DIRS)
        root = Path(sysconfig.get_paths()[key]).resolve()
        paths = (
            p
            for p in _walk_sorted(root, lambda d: d in skip or d.startswith("."), out_dir.resolve())
            if p.suffix == ".py"
        )
        docs = _collect_files(source, root, paths, max_bytes)
    else:
        p = Path(os.path.expanduser(str(source)))
        if not p.exists():
            raise CorpusError(f"corpus source does not exist: {source!r} (use 'stdlib', 'site-packages', a directory "
                              f"or a .jsonl file)")
        p = p.resolve()
        if p.is_dir():
            # Hidden files/dirs are skipped, and so is the output directory if it lies inside.
            paths = (
                q
                for q in _walk_sorted(p, lambda d: d.startswith("."), out_dir.resolve())
                if not q.name.startswith(".")
            )
            docs = _collect_files("dir", p, paths, max_bytes)
        elif p.suffix == ".jsonl":
            docs = _collect_jsonl(p, max_bytes)
        else:
            raise CorpusError(f"corpus source must be 'stdlib', 'site-packages', a directory or a .jsonl file, "
                              f"got file {str(p)!r}")
    if not docs.texts:
        raise CorpusError(
            f"corpus source {source!r} has no usable documents (skipped: {docs.skipped}"
            + (f", max_bytes={max_bytes}" if max_bytes is not None else "")
            + ")"
        )
    return docs


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _tokenizers_version() -> str:
    import tokenizers

    return tokenizers.__version__


def _options(source: str, vocab_size: int, max_bytes: Optional[int], name: str) -> dict:
    return {
        "source": source if source in NAMED_SOURCES else "path",
        "vocab_size": int(vocab_size),
        "max_bytes": None if max_bytes is None else int(max_bytes),
        "name": name,
        "special_tokens": list(SPECIAL_TOKENS),
        "min_frequency": MIN_FREQUENCY,
        "builder_version": BUILDER_VERSION,
        "tokenizers_version": _tokenizers_version(),
    }


def _info_from_manifest(out: Path, m: dict, reused: bool) -> CorpusInfo:
    return CorpusInfo(
        prefix=str(out / m["outputs"]["prefix"]),
        tokenizer_dir=str(out / m["outputs"]["tokenizer_dir"]),
        vocab_size=int(m["vocab_size"]),
        eod_id=int(m["eod_id"]),
        num_tokens=int(m["num_tokens"]),
        num_documents=int(m["num_documents"]),
        manifest_path=str(out / MANIFEST_NAME),
        reused=reused,
    )


def _try_reuse(out: Path, options: dict, input_sha: str) -> Optional[dict]:
    mpath = out / MANIFEST_NAME
    if not mpath.is_file():
        return None
    try:
        m = json.loads(mpath.read_text())
        if m.get("options") != options or m.get("inputs", {}).get("sha256") != input_sha:
            return None
        o = m["outputs"]
        files = {
            "bin": str(out / (o["prefix"] + ".bin")),
            "idx": str(out / (o["prefix"] + ".idx")),
            "tokenizer_json": str(out / o["tokenizer_dir"] / "tokenizer.json"),
        }
        for key, path in files.items():
            if not os.path.isfile(path) or os.path.getsize(path) != o["sizes"][key]:
                return None
        # .idx and tokenizer.json are small: check their contents too.
        if _sha256_file(files["idx"]) != o["sha256"]["idx"]:
            return None
        if _sha256_file(files["tokenizer_json"]) != o["sha256"]["tokenizer_json"]:
            return None
        return m
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def _train_tokenizer(texts: List[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Single-threaded training: the BPE trainer's parallel word counting / merge updates are
    # the only place where thread scheduling could leak into the result. tokenizers reads the
    # variable at each call (not only at import), so setting it around the call is enough, and
    # encoding afterwards may still use every core.
    with _env(TOKENIZERS_PARALLELISM="false"):
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _tokenizer_file(path) -> Path:
    """``path`` (a tokenizer.json or a directory holding one) as the file, or CorpusError."""
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise CorpusError(f"tokenizer_from={path!r}: no tokenizer.json there (give the file, or the directory "
                          f"holding it, e.g. an earlier build's tokenizer/)")
    return p


def _load_tokenizer(path: Path, vocab_size: int):
    """A trained tokenizer from ``path``; CorpusError when it is unreadable, lacks the special
    tokens the dataset and the model rely on, or is larger than ``vocab_size``."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own Exception types
        raise CorpusError(f"tokenizer_from: {path} is not a tokenizers JSON file ({type(e).__name__}: {e})") from None
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise CorpusError(f"tokenizer_from: {path} lacks the special token(s) {missing}; the dataset ends documents "
                          f"with {EOD_TOKEN!r} and pads with {PAD_TOKEN!r}")
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise CorpusError(f"tokenizer_from: {path} has {size} tokens, more than vocab_size={vocab_size}")
    return tok


def _save_tokenizer(tok, tok_dir: Path) -> None:
    """Save what ``PreTrainedTokenizerFast.save_pretrained`` would, without importing transformers."""
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"), pretty=True)
    added = {}
    for t in SPECIAL_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    special = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN, "unk_token": EOD_TOKEN}
    config = {
        "added_tokens_decoder": added,
        **special,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (tok_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------
# Main entry
# --------------------------------------------------------------------------------------


def build_corpus(
    out_dir,
    *,
    source="stdlib",
    vocab_size=50_000,
    max_bytes=None,
    name="corpus",
    force=False,
    quiet=False,
    tokenizer_from=None,
) -> CorpusInfo:
    """Build (or reuse) a tokenized Megatron indexed dataset plus its tokenizer in ``out_dir``.

    Args:
        out_dir: output directory (created if missing).
        source: ``"stdlib"`` (the running Python's standard-library ``*.py`` sources, test
            suites excluded), ``"site-packages"`` (the ``*.py`` sources of the packages
            installed for the running Python, test directories excluded: 8x stdlib's tokens
            in the CPU lock's environment), a directory (every non-hidden UTF-8 text file under it, one
            file = one document) or a ``.jsonl`` file (one ``{"text": ...}`` per line).
        vocab_size: BPE vocabulary size requested, special tokens included. The real size can
            be smaller on a small corpus; ``CorpusInfo.vocab_size`` is the real one.
        max_bytes: cap on the total UTF-8 bytes of the documents (whole documents are kept,
            in sorted order, up to the first one that does not fit). ``None`` = everything.
        name: dataset name; files are ``<out_dir>/<name>_text_document.{bin,idx}``.
        force: rebuild even when ``<out_dir>/manifest.json`` matches.
        quiet: print nothing.
        tokenizer_from: a trained tokenizer to use instead of training one: a
            ``tokenizer.json`` (HF tokenizers) or a directory holding one, e.g. an earlier
            build's ``tokenizer/``. It must hold the special tokens (``<|endoftext|>``,
            ``<|pad|>``). The tokens then depend on it: the manifest records its sha256, and
            an earlier build's own tokenizer gives that build's tokens byte for byte -- which
            is what it is for: the tokenizer's training is the single-threaded part of a
            build (98 of 173 s for the device image's site-packages), and a machine that
            builds the corpus afresh for every job can carry the 2-3 MB file instead.

    Raises:
        CorpusError (a ``ValueError``): missing path, unsupported file, no usable documents,
            bad jsonl line, bad options.
    """
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        if not quiet:
            print(f"[build_corpus {time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    vocab_size = int(vocab_size)
    if vocab_size < MIN_VOCAB_SIZE:
        raise CorpusError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + special tokens), got {vocab_size}")
    if max_bytes is not None and int(max_bytes) <= 0:
        raise CorpusError(f"max_bytes must be positive or None, got {max_bytes}")
    if not name or any(c in name for c in "/\\") or name.startswith("."):
        raise CorpusError(f"bad dataset name {name!r}")
    source = str(source)
    out = Path(os.path.abspath(os.path.expanduser(str(out_dir))))

    docs = _collect(source, max_bytes, out)
    log(
        f"read {docs.num_inputs} documents, {docs.total_bytes / 1e6:.2f} MB from {docs.kind} {docs.root}"
        + (f" (skipped {', '.join(f'{k}={v}' for k, v in docs.skipped.items() if v)})" if any(docs.skipped.values()) else "")
    )
    options = _options(source, vocab_size, max_bytes, name)
    given_tok = None
    if tokenizer_from is not None:
        given_tok = _tokenizer_file(tokenizer_from)
        options["tokenizer_from_sha256"] = _sha256_file(str(given_tok))

    if not force:
        m = _try_reuse(out, options, docs.sha256)
        if m is not None:
            info = _info_from_manifest(out, m, reused=True)
            log(f"reusing existing build in {out} (same options and inputs; force=True / --force rebuilds)")
            log(f"dataset prefix: {info.prefix}")
            log(f"tokenizer dir:  {info.tokenizer_dir}")
            return info

    out.mkdir(parents=True, exist_ok=True)
    mpath = out / MANIFEST_NAME
    if mpath.exists():
        mpath.unlink()  # the manifest is written last: its presence marks a complete build

    # 1. tokenizer
    t_tok = time.perf_counter()
    if given_tok is not None:
        tok = _load_tokenizer(given_tok, vocab_size)
        log(f"tokenizer from {given_tok} (sha256 {options['tokenizer_from_sha256'][:12]}), not trained")
    else:
        log(f"training byte-level BPE tokenizer (vocab_size={vocab_size}, single-threaded) ...")
        tok = _train_tokenizer(docs.texts, vocab_size)
    real_vocab = tok.get_vocab_size(with_added_tokens=True)
    eod_id = tok.token_to_id(EOD_TOKEN)
    pad_id = tok.token_to_id(PAD_TOKEN)
    tok_dir = out / TOKENIZER_SUBDIR
    _save_tokenizer(tok, tok_dir)
    log(f"tokenizer trained in {time.perf_counter() - t_tok:.1f}s: vocab {real_vocab}, eod id {eod_id} -> {tok_dir}")

    # 2. indexed dataset
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(real_vocab)
    prefix_name = f"{name}_text_document"
    prefix = out / prefix_name
    bin_path, idx_path = str(prefix) + ".bin", str(prefix) + ".idx"
    log(f"tokenizing {docs.num_inputs} documents -> {prefix}.bin/.idx (dtype {np.dtype(dtype).name})")
    t_enc = time.perf_counter()
    builder = IndexedDatasetBuilder(bin_path, dtype=dtype)
    # encode_batch_fast skips the character offsets we do not need (tokenizers >= 0.21).
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    num_tokens = 0
    n = len(docs.texts)
    next_report = max(1, n // 4)
    for start in range(0, n, _ENCODE_CHUNK):
        chunk = docs.texts[start : start + _ENCODE_CHUNK]
        for enc in encode(chunk, add_special_tokens=False):
            ids = np.empty(len(enc.ids) + 1, dtype=dtype)
            ids[:-1] = enc.ids
            ids[-1] = eod_id
            builder.add_document(ids, [ids.size])
            num_tokens += ids.size
        done = min(n, start + _ENCODE_CHUNK)
        if done >= next_report or done == n:
            log(f"  {done}/{n} documents, {num_tokens:,} tokens")
            next_report = done + max(1, n // 4)
    builder.finalize(idx_path)
    log(f"wrote {num_tokens:,} tokens in {n} documents in {time.perf_counter() - t_enc:.1f}s")

    # 3. manifest
    tok_json = str(tok_dir / "tokenizer.json")
    manifest = {
        "builder": "nemo_ssa.data.corpus",
        "builder_version": BUILDER_VERSION,
        "options": options,
        "inputs": {
            "kind": docs.kind,
            "root": docs.root,
            "count": docs.num_inputs,
            "total_bytes": docs.total_bytes,
            "sha256": docs.sha256,
            "skipped": docs.skipped,
            "python_version": sys.version.split()[0],
        },
        "vocab_size": real_vocab,
        "requested_vocab_size": vocab_size,
        "eod_id": eod_id,
        "pad_id": pad_id,
        "eod_token": EOD_TOKEN,
        "pad_token": PAD_TOKEN,
        "num_tokens": num_tokens,
        "num_documents": n,
        "dtype": np.dtype(dtype).name,
        "outputs": {
            "prefix": prefix_name,
            "tokenizer_dir": TOKENIZER_SUBDIR,
            "sizes": {
                "bin": os.path.getsize(bin_path),
                "idx": os.path.getsize(idx_path),
                "tokenizer_json": os.path.getsize(tok_json),
            },
            "sha256": {
                "bin": _sha256_file(bin_path),
                "idx": _sha256_file(idx_path),
                "tokenizer_json": _sha256_file(tok_json),
            },
        },
        "build_seconds": round(time.perf_counter() - t0, 2),
    }
    tmp = mpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, mpath)
    log(f"done in {time.perf_counter() - t0:.1f}s; manifest {mpath}")
    log(f"dataset prefix: {prefix}")
    log(f"tokenizer dir:  {tok_dir}")
    return _info_from_manifest(out, manifest, reused=False)


def build_corpus_locked(out_dir, **options) -> CorpusInfo:
    """:func:`build_corpus` under an exclusive lock on ``<out_dir>.lock``: the first of several
    processes (the ranks of one node) builds, the others then reuse it. Several nodes on a
    shared file system: build once beforehand (``scripts/build_corpus.py``)."""
    import fcntl

    out = os.path.abspath(os.fspath(out_dir))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out.rstrip("/") + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_corpus(out, **options)
