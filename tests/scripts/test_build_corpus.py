"""Tests for nemo_ssa.data.corpus / scripts/build_corpus.py (CPU, tiny inputs, no downloads)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from nemo_ssa.data import CorpusError, CorpusInfo, build_corpus, default_corpus_dir  # noqa: E402

VOCAB = 1024
# A few real stdlib modules (~150 KB): small enough to train in well under a second.
_STDLIB_FILES = ["textwrap.py", "json/__init__.py", "json/decoder.py", "json/encoder.py", "colorsys.py", "bisect.py"]


def _sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _hashes(info: CorpusInfo):
    return {
        "bin": _sha(info.prefix + ".bin"),
        "idx": _sha(info.prefix + ".idx"),
        "tokenizer_json": _sha(os.path.join(info.tokenizer_dir, "tokenizer.json")),
    }


def _make_src(dst: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in _STDLIB_FILES:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stdlib / rel, dst / rel)
    (dst / "zz_unicode.txt").write_text("Grüße, 世界! 🚀 tabs\tand\r\nCRLF  trailing spaces   \n", encoding="utf-8")
    (dst / "empty.txt").write_bytes(b"")  # skipped
    (dst / "blob.bin").write_bytes(b"\x00\x01\x02binary")  # skipped (NUL byte)
    (dst / ".hidden").write_text("not read")  # skipped (hidden)
    return dst


def _expected_texts(src: Path):
    files = sorted((p for p in src.rglob("*") if p.is_file()), key=lambda p: p.relative_to(src).as_posix())
    out = []
    for p in files:
        if p.name.startswith("."):
            continue
        data = p.read_bytes()
        if not data or b"\x00" in data:
            continue
        out.append(data.decode("utf-8"))
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return _make_src(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def built(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("out_a")
    return build_corpus(out, source=str(src), vocab_size=VOCAB, quiet=True)


def test_build_and_read_back(built, src):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    texts = _expected_texts(src)
    assert built.num_documents == len(texts) == len(_STDLIB_FILES) + 1
    assert built.eod_id == 0
    assert built.vocab_size <= VOCAB and built.vocab_size > 258
    assert not built.reused

    ds = IndexedDataset(built.prefix)
    assert len(ds) == built.num_documents
    assert ds.index.dtype.__name__ == "uint16"
    tok = Tokenizer.from_file(os.path.join(built.tokenizer_dir, "tokenizer.json"))
    total = 0
    for i, text in enumerate(texts):
        ids = ds[i]
        total += len(ids)
        assert ids[-1] == built.eod_id
        assert built.eod_id not in ids[:-1].tolist()
        assert tok.decode(ids[:-1].tolist(), skip_special_tokens=False) == text  # byte-level BPE is lossless
    assert total == built.num_tokens

    m = json.loads(Path(built.manifest_path).read_text())
    assert m["num_tokens"] == built.num_tokens and m["num_documents"] == built.num_documents
    assert m["inputs"]["count"] == len(texts)
    assert m["inputs"]["total_bytes"] == sum(len(t.encode()) for t in texts)
    assert m["outputs"]["sha256"] == _hashes(built)
    assert m["options"]["vocab_size"] == VOCAB and m["builder_version"]


def test_deterministic_across_processes_via_cli(built, src, tmp_path):
    """Same inputs and options, built again in a fresh process through the CLI: identical bytes."""
    out = tmp_path / "out_b"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_corpus.py"), "--out", str(out),
         "--source", str(src), "--vocab-size", str(VOCAB)],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dataset prefix:" in r.stdout and "tokenizer dir:" in r.stdout and "tokens" in r.stdout
    info_b = json.loads((out / "manifest.json").read_text())
    assert info_b["outputs"]["sha256"] == _hashes(built)
    assert (out / "tokenizer" / "tokenizer_config.json").read_bytes() == (
        Path(built.tokenizer_dir) / "tokenizer_config.json"
    ).read_bytes()


def test_different_inputs_give_different_hashes(built, src, tmp_path):
    src2 = tmp_path / "src2"
    shutil.copytree(src, src2)
    with open(src2 / "textwrap.py", "a", encoding="utf-8") as fh:
        fh.write("\n# one more line makes a different corpus\n")
    info = build_corpus(tmp_path / "out", source=str(src2), vocab_size=VOCAB, quiet=True)
    m1 = json.loads(Path(built.manifest_path).read_text())
    m2 = json.loads(Path(info.manifest_path).read_text())
    assert m1["inputs"]["sha256"] != m2["inputs"]["sha256"]
    assert _hashes(info)["bin"] != _hashes(built)["bin"]
    assert _hashes(info)["idx"] != _hashes(built)["idx"]


def test_cache_reused_and_force_rebuilds(src, tmp_path, capsys):
    out = tmp_path / "out"
    a = build_corpus(out, source=str(src), vocab_size=512, quiet=True)
    bin_path = Path(a.prefix + ".bin")
    mtime = bin_path.stat().st_mtime_ns
    os.utime(bin_path, ns=(mtime - 10**9, mtime - 10**9))  # so a rewrite would surely change it
    mtime = bin_path.stat().st_mtime_ns

    b = build_corpus(out, source=str(src), vocab_size=512)
    assert b.reused and "reusing" in capsys.readouterr().out
    assert bin_path.stat().st_mtime_ns == mtime
    assert (b.prefix, b.num_tokens, b.vocab_size) == (a.prefix, a.num_tokens, a.vocab_size)

    c = build_corpus(out, source=str(src), vocab_size=512, force=True, quiet=True)
    assert not c.reused and bin_path.stat().st_mtime_ns != mtime
    assert c.num_tokens == a.num_tokens

    # Different options (vocab size) do not reuse the cache.
    d = build_corpus(out, source=str(src), vocab_size=600, quiet=True)
    assert not d.reused


def test_an_earlier_builds_tokenizer_gives_its_tokens_byte_for_byte(built, src, tmp_path, capsys):
    """tokenizer_from: the sweep's device calls build the corpus afresh on every machine, and the
    tokenizer's training is the single-threaded part; carrying an earlier build's tokenizer must
    give that build's dataset exactly, and the manifest must say which tokenizer was used."""
    out = tmp_path / "from_tok"
    info = build_corpus(out, source=str(src), vocab_size=VOCAB, tokenizer_from=built.tokenizer_dir)
    log = capsys.readouterr().out
    assert "not trained" in log and "training byte-level BPE" not in log
    assert _hashes(info) == _hashes(built)  # .bin, .idx and the saved tokenizer.json
    m = json.loads(Path(info.manifest_path).read_text())
    assert m["options"]["tokenizer_from_sha256"] == _hashes(built)["tokenizer_json"]
    assert "tokenizer_from_sha256" not in json.loads(Path(built.manifest_path).read_text())["options"]
    # the file itself works as well as its directory, and the second call reuses the build
    again = build_corpus(out, source=str(src), vocab_size=VOCAB, quiet=True,
                         tokenizer_from=os.path.join(built.tokenizer_dir, "tokenizer.json"))
    assert again.reused
    # a different tokenizer gives different tokens (the tokens depend on it, not on the inputs alone)
    other = build_corpus(tmp_path / "other_tok", source=str(src), vocab_size=512, quiet=True)
    diff = build_corpus(tmp_path / "from_other", source=str(src), vocab_size=VOCAB, quiet=True,
                        tokenizer_from=other.tokenizer_dir)
    assert _hashes(diff)["bin"] != _hashes(built)["bin"] and diff.vocab_size == other.vocab_size


def test_a_bad_tokenizer_from_is_refused_by_name(built, src, tmp_path):
    with pytest.raises(CorpusError, match="no tokenizer.json there"):
        build_corpus(tmp_path / "a", source=str(src), vocab_size=VOCAB, quiet=True, tokenizer_from=tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CorpusError, match="not a tokenizers JSON file"):
        build_corpus(tmp_path / "b", source=str(src), vocab_size=VOCAB, quiet=True, tokenizer_from=bad)
    from tokenizers import Tokenizer, models

    plain = Tokenizer(models.BPE())  # no special tokens
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(CorpusError, match="lacks the special token"):
        build_corpus(tmp_path / "c", source=str(src), vocab_size=VOCAB, quiet=True,
                     tokenizer_from=tmp_path / "plain.json")
    with pytest.raises(CorpusError, match="more than vocab_size=300"):
        build_corpus(tmp_path / "d", source=str(src), vocab_size=300, quiet=True, tokenizer_from=built.tokenizer_dir)


def test_cli_takes_tokenizer_from(built, src, tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_corpus.py"), "--out", str(out), "--source", str(src),
         "--vocab-size", str(VOCAB), "--tokenizer-from", built.tokenizer_dir],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["outputs"]["sha256"] == _hashes(built)


def test_jsonl_source(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    texts = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i + 1) for i in range(20)]
    texts.append("ünïcödé 🙂 and \"quotes\"\n\tindented")
    path = tmp_path / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t, "meta": 1}) + "\n")
        fh.write("\n")  # blank line: skipped
        fh.write(json.dumps({"text": ""}) + "\n")  # empty document: skipped
    info = build_corpus(tmp_path / "out", source=str(path), vocab_size=512, quiet=True)
    assert info.num_documents == len(texts)
    ds = IndexedDataset(info.prefix)
    tok = Tokenizer.from_file(os.path.join(info.tokenizer_dir, "tokenizer.json"))
    for i, t in enumerate(texts):
        assert ds[i][-1] == info.eod_id
        assert tok.decode(ds[i][:-1].tolist(), skip_special_tokens=False) == t


def test_errors(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        build_corpus(tmp_path / "o1", source=str(tmp_path / "missing"), vocab_size=512, quiet=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match="no usable documents"):
        build_corpus(tmp_path / "o2", source=str(empty), vocab_size=512, quiet=True)
    (empty / "a.txt").write_bytes(b"")
    with pytest.raises(CorpusError, match="no usable documents"):
        build_corpus(tmp_path / "o3", source=str(empty), vocab_size=512, quiet=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2"):
        build_corpus(tmp_path / "o4", source=str(bad), vocab_size=512, quiet=True)
    bad.write_text('{"text": "ok"}\n{"text": "lone \\ud800 surrogate"}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: .*not valid Unicode"):
        build_corpus(tmp_path / "o4", source=str(bad), vocab_size=512, quiet=True)
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(CorpusError, match="directory or a .jsonl"):
        build_corpus(tmp_path / "o5", source=str(other), vocab_size=512, quiet=True)
    with pytest.raises(ValueError, match="vocab_size"):
        build_corpus(tmp_path / "o6", source=str(other), vocab_size=100, quiet=True)
    # The CLI reports the error and exits non-zero.
    import importlib.util

    spec = importlib.util.spec_from_file_location("_build_corpus_cli", REPO / "scripts" / "build_corpus.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--out", str(tmp_path / "o7"), "--source", str(tmp_path / "missing"), "--quiet"]) == 2


def test_max_bytes_and_default_dir(src, tmp_path, monkeypatch):
    texts = _expected_texts(src)
    cap = len(texts[0].encode()) + len(texts[1].encode())
    info = build_corpus(tmp_path / "out", source=str(src), vocab_size=512, max_bytes=cap, quiet=True)
    assert info.num_documents == 2

    assert default_corpus_dir() == str(REPO / "data" / "stdlib-corpus")
    monkeypatch.setenv("NEMO_SSA_DATA_DIR", str(tmp_path))
    assert default_corpus_dir() == str(tmp_path / "stdlib-corpus")


def test_tokenizer_loads_with_transformers_and_nemo(built, src):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = AutoTokenizer.from_pretrained(built.tokenizer_dir)
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert len(hf) == built.vocab_size
    assert hf.eos_token == hf.bos_token == hf.unk_token == "<|endoftext|>"
    assert hf.eos_token_id == built.eod_id
    assert hf.pad_token == "<|pad|>" and hf.pad_token_id != built.eod_id
    text = _expected_texts(src)[-1]
    ids = hf(text, add_special_tokens=True)["input_ids"]
    assert built.eod_id not in ids  # no implicit bos/eos: the builder appends eod itself
    assert hf.decode(ids) == text

    # NeMo's wrapper (importing nemo.collections.common costs ~15 s: the only test that does).
    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer as NemoAutoTokenizer

    nt = NemoAutoTokenizer(pretrained_model_name=built.tokenizer_dir)
    assert nt.vocab_size == built.vocab_size
    assert nt.eos_id == nt.eod == built.eod_id
    assert nt.ids_to_text(nt.text_to_ids(text)) == text


def test_site_packages_source_reads_installed_sources_without_their_tests(tmp_path, monkeypatch):
    """``source="site-packages"``: the ``*.py`` files under this Python's purelib, test
    directories, caches and hidden directories left out, in sorted order; its own default
    directory beside the stdlib one, which it never overwrites."""
    site = tmp_path / "site"
    files = {"alpha/__init__.py": "A = 1\n", "alpha/core.py": "def f():\n    return 2\n",
             "beta/util.py": "X = 'beta'\n", "alpha/tests/test_core.py": "assert False\n",
             "alpha/test/t.py": "skip\n", "alpha/__pycache__/core.py": "skip\n", ".hidden/h.py": "skip\n",
             "alpha/data.json": '{"not": "python"}\n'}
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    real = sysconfig.get_paths

    def paths(*a, **k):
        return dict(real(*a, **k), purelib=str(site))

    monkeypatch.setattr(sysconfig, "get_paths", paths)
    info = build_corpus(str(tmp_path / "out"), source="site-packages", vocab_size=300, quiet=True)
    assert info.num_documents == 3  # alpha/__init__, alpha/core, beta/util
    m = json.loads(Path(info.manifest_path).read_text())
    assert m["options"]["source"] == "site-packages"
    monkeypatch.setenv("NEMO_SSA_DATA_DIR", str(tmp_path / "d"))
    assert default_corpus_dir("site-packages") == str(tmp_path / "d" / "site-packages-corpus")
    assert default_corpus_dir() == str(tmp_path / "d" / "stdlib-corpus")
    with pytest.raises(CorpusError, match="give data.dir"):
        default_corpus_dir(str(tmp_path / "my_texts"))
