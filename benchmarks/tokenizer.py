"""BPE encoding speed: minipar's BPETokenizer against the `tokenizers` package, on the same vocabulary.

    python benchmarks/tokenizer.py                 # a byte-level BPE of 8,192 symbols trained on the corpus
    python benchmarks/tokenizer.py --vocab 32768

Trains a GPT-2-style byte-level BPE with `tokenizers` (an optional dependency: pip install minipar[test]) on the
first 2 MB of the default corpus, saves vocab.json + merges.txt, and times three encodings with each tokenizer,
best of --repeat: the whole default corpus (MB/s; minipar's word cache starts empty every time), one 8,000-letter
word without a space (the case that is quadratic without a heap), and the same word as digits. Both tokenizers
must produce the same ids; the script says so or stops. The CPU model is printed with the numbers.

Deep dive, with measurements: docs/speed.md.
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time

from minipar.data import BPETokenizer, default_corpus


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import tokenizers

    corpus = default_corpus().decode("utf-8", errors="replace")
    directory = tempfile.mkdtemp(prefix="minipar_bpe_")
    reference = tokenizers.ByteLevelBPETokenizer(add_prefix_space=False)
    reference.train_from_iterator([corpus[:2_000_000]], vocab_size=args.vocab, min_frequency=2, show_progress=False)
    reference.save_model(directory)
    letters = "".join(ch for ch in corpus[:400_000] if ch.isalpha())[:8000]
    digits = "".join(str(ord(ch) % 10) for ch in letters)
    print(f"BPE of {args.vocab} symbols on {cpu_model()}; corpus {len(corpus.encode()) / 1e6:.2f} MB; best of "
          f"{args.repeat}")
    print(f"{'input':<22}{'minipar s':>11}{'tokenizers s':>14}{'minipar MB/s':>14}")
    for name, text in (("default corpus", corpus), ("8,000 letters", letters), ("8,000 digits", digits)):
        ours_ids = BPETokenizer.from_dir(directory).encode(text).tolist()
        if ours_ids != reference.encode(text).ids:
            raise SystemExit(f"{name}: the ids differ from tokenizers'")
        ours = best_of(args.repeat, lambda: BPETokenizer.from_dir(directory).encode(text))  # a cold word cache
        theirs = best_of(args.repeat, lambda: reference.encode(text))
        print(f"{name:<22}{ours:>11.3f}{theirs:>14.3f}{len(text.encode()) / 1e6 / ours:>14.2f}")
    print("same ids from both tokenizers on every input")


if __name__ == "__main__":
    main()
