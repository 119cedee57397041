#!/usr/bin/env python
"""Build (or reuse) the local training corpus: a byte-level BPE tokenizer + a Megatron indexed dataset.

    python scripts/build_corpus.py --out data/stdlib-corpus                  # stdlib sources, vocab 50,000
    python scripts/build_corpus.py --out /tmp/c --source my_texts/ --vocab-size 2048
    python scripts/build_corpus.py --out /tmp/c --source docs.jsonl --max-bytes 5000000 --force

Nothing is downloaded. Same inputs and options give byte-identical outputs; a second run with
the same options and inputs reuses the existing build (see <out>/manifest.json).
"""

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from nemo_ssa.data.corpus import CorpusError, build_corpus, default_corpus_dir  # noqa: E402


def _max_bytes(value: str):
    if value.lower() in ("all", "none", "0"):
        return None
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}
    v = value.strip().lower().rstrip("b")
    if v and v[-1] in mult:
        return int(float(v[:-1]) * mult[v[-1]])
    return int(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=f"output directory (default for a named source: "
                                                 f"{default_corpus_dir().replace('stdlib', '<source>')})")
    ap.add_argument("--source", default="stdlib", help="'stdlib', 'site-packages' (this Python's installed packages' "
                                                       "sources, 8x stdlib's tokens), a directory of text files, or a .jsonl file")
    ap.add_argument("--vocab-size", type=int, default=50_257, help="BPE vocab size (default 50257, as nemo_ssa/configs/data/stdlib.yaml; pads to 50,304)")
    ap.add_argument("--max-bytes", type=_max_bytes, default=None,
                    help="cap on total input bytes, e.g. 5000000 or 5M; 'all' (default) = no cap")
    ap.add_argument("--name", default="corpus", help="dataset name: <out>/<name>_text_document.{bin,idx}")
    ap.add_argument("--force", action="store_true", help="rebuild even if the manifest matches")
    ap.add_argument("--tokenizer-from", default=None, metavar="PATH",
                    help="use this trained tokenizer (tokenizer.json or a directory holding one, e.g. an earlier "
                         "build's tokenizer/) instead of training one")
    ap.add_argument("--quiet", action="store_true", help="print only the final prefix and tokenizer dir")
    args = ap.parse_args(argv)

    try:
        out = args.out or default_corpus_dir(args.source)
        info = build_corpus(out, source=args.source, vocab_size=args.vocab_size, max_bytes=args.max_bytes,
                            name=args.name, force=args.force, quiet=args.quiet, tokenizer_from=args.tokenizer_from)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.quiet:
        print(f"dataset prefix: {info.prefix}")
        print(f"tokenizer dir:  {info.tokenizer_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
