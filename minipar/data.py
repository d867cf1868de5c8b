"""Tokens and batches.

* Byte-level tokenizer: token = byte (vocab 256), so any text file is data, with no files to fetch.
* GPT-2's byte-pair tokenizer, for checkpoints that ship ``vocab.json`` + ``merges.txt``.
* The default corpus is this Python's own standard library source (the top-level ``*.py`` files,
  a few MB of real code), read at run time: present on every machine, nothing to download.
* Batches are a pure function of (seed, step): the global batch at step s is the same whatever
  the number of ranks, and data-parallel rank r takes rows [r·B/dp, (r+1)·B/dp). That is what
  makes "parallel training = single-process training" testable to the last bit.
"""
from __future__ import annotations

import functools
import glob
import heapq
import json
import os
import sysconfig

import numpy as np
import regex

from minipar.safetensors_io import atomic_write


# ------------------------------------------------------------------------------------ tokenizers


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (spaces become 'Ġ', ...)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# GPT-2's pre-tokenizer pattern, verbatim. It needs Unicode's letter and number classes \p{L} and \p{N},
# which the ``regex`` package implements and Python's ``re`` lacks (an imitation with \w and \d
# drops "_" and misfiles characters such as "²" or "\x1c").
_PRETOKEN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


END_OF_TEXT = "<|endoftext|>"


def _listed_special_tokens(directory: str) -> list[str]:
    """The added and special tokens transformers' tokenizer files name: tokenizer_config.json's added_tokens_decoder
    and its *_token entries, special_tokens_map.json, added_tokens.json (whichever exist)."""
    found: list[str] = []
    for name in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if name == "added_tokens.json":
            found += list(data)
            continue
        found += [t["content"] for t in data.get("added_tokens_decoder", {}).values() if isinstance(t, dict)]
        for key, value in data.items():
            if key.endswith("_token"):
                found += [value["content"] if isinstance(value, dict) else value] if value else []
    return [t for t in found if isinstance(t, str)]


class BPETokenizer:
    """GPT-2 byte-pair encoding: split into words, map bytes to symbols, merge the best-ranked pair until none applies."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], special: tuple[str, ...] = ()):
        """``special``: added tokens (``<|endoftext|>``, ...) that are split out of the text before pre-tokenization
        and map to their one id each, as `tokenizers` does; those not in ``vocab`` are ignored."""
        self.special = {t: vocab[t] for t in special if t in vocab}
        self._special_split = regex.compile("(" + "|".join(regex.escape(t) for t in sorted(self.special, key=len, reverse=True))
                                            + ")") if self.special else None
        self.encoder = vocab
        self.decoder = {i: s for s, i in vocab.items()}
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.vocab_size = len(vocab)
        self.byte_chars = _byte_to_unicode()
        self.char_bytes = {c: b for b, c in self.byte_chars.items()}

    @classmethod
    def from_dir(cls, directory: str) -> BPETokenizer:
        vocab_path, merges_path = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
        try:
            with open(vocab_path, encoding="utf-8") as f:
                vocab = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{vocab_path}: not a GPT-2 vocabulary ({e})") from None
        with open(merges_path, encoding="utf-8") as f:
            lines = [ln for ln in f.read().split("\n") if ln and not ln.startswith("#version")]
        merges = [tuple(ln.split(" ")) for ln in lines]
        bad = next((n for n, pair in enumerate(merges, 1) if len(pair) != 2), None)
        if bad is not None:
            raise ValueError(f"{merges_path}: merge {bad} is not two symbols separated by a space")
        return cls(vocab, merges, (END_OF_TEXT, *_listed_special_tokens(directory)))

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one tokenizer per process): a word cache
    def _bpe(self, word: str) -> tuple[str, ...]:
        """Merge the adjacent pair of lowest rank — the leftmost of equals — until no pair has a rank: GPT-2's rule.

        In O(n log n) for n symbols (the reference implementations' way): the symbols form a linked list, every
        adjacent pair sits in a heap keyed (rank, position), and a merge pushes only the two pairs it creates;
        an entry whose pair has since changed is skipped when it surfaces (ranks are unique per pair, so an
        entry is current exactly when its pair still has its rank). Rescanning every pair after each merge, as
        GPT-2's encoder.py does, is O(n²): 8,000 characters without a space took minutes (benchmarks/tokenizer.py).
        """
        parts: list[str | None] = list(word)
        n, ranks = len(parts), self.ranks
        after, before = list(range(1, n)) + [-1], list(range(-1, n - 1))
        heap = [(ranks[pair], i) for i, pair in enumerate(zip(word, word[1:])) if pair in ranks]
        heapq.heapify(heap)
        while heap:
            rank, i = heapq.heappop(heap)
            j = after[i]
            if parts[i] is None or j < 0 or ranks.get((parts[i], parts[j])) != rank:
                continue  # stale: its pair was merged away or changed
            parts[i], parts[j] = parts[i] + parts[j], None
            after[i] = after[j]
            if after[i] >= 0:
                before[after[i]] = i
            for left, right in ((before[i], i), (i, after[i])):
                if left >= 0 and right >= 0 and (parts[left], parts[right]) in ranks:
                    heapq.heappush(heap, (ranks[parts[left], parts[right]], left))
        return tuple(p for p in parts if p is not None)

    def encode(self, text: str) -> np.ndarray:
        ids = []
        pieces = self._special_split.split(text) if self._special_split else [text]
        for k, piece in enumerate(pieces):  # odd pieces are special tokens, split out first
            if k % 2:
                ids.append(self.special[piece])
                continue
            for word in _PRETOKEN.findall(piece):
                symbols = "".join(self.byte_chars[b] for b in word.encode("utf-8"))
                ids.extend(self.encoder[s] for s in self._bpe(symbols))
        return np.array(ids, dtype=np.int64)

    def decode(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.char_bytes[c] for c in text).decode("utf-8", errors="replace")




TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")  # what save_tokenizer writes


def save_tokenizer(directory: str, vocab_size: int, block_size: int, source: str | None = None) -> int | None:
    """Write a model's tokenizer beside its weights as transformers' GPT-2 tokenizer files (vocab.json, merges.txt,
    tokenizer_config.json), so that ``AutoTokenizer`` loads it and encodes as minipar does; returns the id of
    ``<|endoftext|>`` (the config's bos/eos), or None when the vocabulary has none.

    ``source``'s BPE files when the model came with them; else, for a 256-token model, the byte tokenizer written
    exactly as a GPT-2 byte-level BPE — the 256 byte symbols at their byte values, no merges; else nothing."""
    if source and os.path.isfile(os.path.join(source, "vocab.json")) and os.path.isfile(os.path.join(source, "merges.txt")):
        tokenizer = BPETokenizer.from_dir(source)
        vocab, merges = tokenizer.encoder, [f"{a} {b}" for (a, b), _ in sorted(tokenizer.ranks.items(), key=lambda kv: kv[1])]
    elif vocab_size == 256:
        chars = _byte_to_unicode()
        vocab, merges = {chars[b]: b for b in range(256)}, []
    else:
        return None
    special = END_OF_TEXT if END_OF_TEXT in vocab else None
    texts = (json.dumps(vocab, ensure_ascii=False), "\n".join(["#version: 0.2", *merges]) + "\n",
             json.dumps({"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "bos_token": special,
                         "eos_token": special, "unk_token": special, "model_max_length": block_size}, indent=2))
    for name, text in zip(TOKENIZER_FILES, texts):
        atomic_write(os.path.join(directory, name), [text.encode("utf-8")])
    return vocab[special] if special else None


def tokenizer_for(directory: str | None, vocab_size: int):
    """The checkpoint's own BPE tokenizer when it ships one, else bytes (which need vocab_size >= 256)."""
    if directory and os.path.isfile(os.path.join(directory, "vocab.json")) and os.path.isfile(os.path.join(directory, "merges.txt")):
        return BPETokenizer.from_dir(directory)
    if vocab_size < 256:
        raise ValueError(f"vocab_size {vocab_size} < 256 cannot hold byte tokens and no vocab.json/merges.txt was found")
    return ByteTokenizer()


# ----------------------------------------------------------------------------------------- corpus


def default_corpus() -> bytes:
    """The top-level ``*.py`` files of this Python's standard library, sorted by name and concatenated."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if not files:
        raise FileNotFoundError(f"no standard-library sources under {stdlib}; pass --data PATH")
    chunks = []
    for path in files:
        with open(path, "rb") as f:
            chunks.append(f.read())
    return b"\n".join(chunks)


def load_tokens(path: str | None = None, tokenizer: ByteTokenizer | BPETokenizer | None = None) -> np.ndarray:
    """The tokens of ``path`` (any file), or of the default corpus when ``path`` is None: its bytes, or — with a
    BPE ``tokenizer`` (a checkpoint's own) — the ids it encodes the text (UTF-8) into."""
    if path is None:
        raw = default_corpus()
    else:
        if os.path.isdir(path):
            raise IsADirectoryError(f"--data {path} is a directory: pass one text file")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data file not found: {path}")
        with open(path, "rb") as f:
            raw = f.read()
    if isinstance(tokenizer, BPETokenizer):
        return tokenizer.encode(raw.decode("utf-8", errors="replace"))
    return np.frombuffer(raw, dtype=np.uint8)


class Batches:
    """Random windows of a token array: ``batches(step)`` -> (x, y), each int64 (batch_size, block_size).

    A window is T + 1 consecutive tokens (T = block_size): x its first T, y its last T (x shifted by one);
    N tokens hold N − T windows, each equally likely, the last one included. Offsets come from
    ``default_rng((seed, step))``, so a step's batch never depends on what ran before it (resuming and
    re-sharding give the same data).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int = 0):
        if len(tokens) < self.tokens_needed(block_size):
            raise ValueError(f"data has {len(tokens)} tokens; block_size {block_size} needs at least "
                             f"{self.tokens_needed(block_size)}")
        self.tokens, self.batch_size, self.block_size, self.seed = tokens, batch_size, block_size, seed

    @staticmethod
    def tokens_needed(block_size: int) -> int:
        """One window: T inputs and the token after the last, the last target."""
        return block_size + 1

    def __call__(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)
        window = starts[:, None] + np.arange(self.block_size + 1)
        chunk = self.tokens[window].astype(np.int64)
        return chunk[:, :-1], chunk[:, 1:]


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last ``val_fraction`` of the tokens is held out."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def shard_rows(x: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rows [rank·B/world, (rank+1)·B/world) of a global batch (B must divide evenly)."""
    if len(x) % world:
        raise ValueError(f"global batch {len(x)} is not divisible by {world} data-parallel ranks")
    n = len(x) // world
    return x[rank * n:(rank + 1) * n]
