"""Hugging Face interop: GPT-2's BPE against the `tokenizers` package, every config field honored or
refused, dtypes, sharded weight directories and strict safetensors parsing."""
import json
import os
import sys

import numpy as np
import pytest

from minipar.data import BPETokenizer, default_corpus
from minipar.models.gpt import GPT, GPTConfig, hf_config
from minipar.safetensors_io import INDEX_NAME, WEIGHTS_NAME, encode_safetensors, read_hf_weights, read_safetensors

TINY = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, dtype="float64")

SAMPLES = [
    "a_b __init__ self._x = 1_000",                     # underscores (the old pattern deleted them)
    "def f(x):\n\tif x² > ½: return Ⅻ  # ok\n\n",       # number characters that are not digits
    "ctrl \x1c\x1d\x1e\x1f end\x00\x07",                # control characters (not whitespace in GPT-2)
    "naïve café — 東京 🙂 مرحبا Ωμέγα",                 # letters of many scripts, emoji
    "I'm we'll they'd it's  spaces   \n  trailing  ",   # contractions, whitespace runs
    "3.14159 1e-9 0x1F 42nd ٣٤",                         # numbers, Arabic-Indic digits
]


@pytest.fixture(scope="module")
def trained_bpe(tmp_path_factory):
    """A byte-level BPE trained by `tokenizers` on a slice of the default corpus, saved as vocab.json + merges.txt."""
    tokenizers = pytest.importorskip("tokenizers", reason="the BPE reference needs `pip install minipar[test]`")
    directory = tmp_path_factory.mktemp("bpe")
    reference = tokenizers.ByteLevelBPETokenizer(add_prefix_space=False)
    text = default_corpus()[:200_000].decode("utf-8", errors="replace")
    reference.train_from_iterator([text, *SAMPLES], vocab_size=600, min_frequency=2, show_progress=False)
    reference.save_model(str(directory))
    return str(directory), reference


def test_bpe_matches_tokenizers_reference(trained_bpe):
    directory, reference = trained_bpe
    ours = BPETokenizer.from_dir(directory)
    corpus_slice = default_corpus()[300_000:340_000].decode("utf-8", errors="replace")
    for text in [*SAMPLES, corpus_slice]:
        ids = ours.encode(text)
        assert ids.tolist() == reference.encode(text).ids, repr(text[:60])
        assert ours.decode(ids) == text


def test_bpe_on_long_words_matches_tokenizers(trained_bpe):
    """Pre-tokens of thousands of symbols (letters, digits, punctuation without a space) — where the heap of the
    O(n log n) merge loop holds many equal-ranked pairs and many stale entries — encode as `tokenizers` does."""
    directory, reference = trained_bpe
    ours = BPETokenizer.from_dir(directory)
    text = default_corpus()[:400_000].decode("utf-8", errors="replace")
    for keep in (str.isalpha, str.isdigit, lambda ch: not ch.isspace() and not ch.isalnum()):
        word = "".join(ch for ch in text if keep(ch))[:8000]
        assert len(word) >= 2000
        assert ours.encode(word).tolist() == reference.encode(word).ids
    assert ours.encode("a" * 5001).tolist() == reference.encode("a" * 5001).ids  # one pair, ranked equal throughout


def test_special_tokens_are_split_out_first(tmp_path):
    """<|endoftext|> — and any token the tokenizer files list as added or special — is one id wherever it stands,
    even inside a word, as `tokenizers` encodes it; without the listing, "<|pad|>" is ordinary text."""
    tokenizers = pytest.importorskip("tokenizers", reason="the BPE reference needs `pip install minipar[test]`")
    reference = tokenizers.ByteLevelBPETokenizer(add_prefix_space=False)
    reference.train_from_iterator([default_corpus()[:100_000].decode("utf-8", errors="replace")], vocab_size=400,
                                  min_frequency=2, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False)
    reference.save_model(str(tmp_path))
    text = "def f():<|endoftext|>return 1 <|pad|>x<|endoftext|><|endoftext|> end<|endoftext"
    plain = BPETokenizer.from_dir(str(tmp_path))
    ids = plain.encode(text).tolist()
    assert ids.count(plain.encoder["<|endoftext|>"]) == 3 and plain.encoder["<|pad|>"] not in ids
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(plain.encoder["<|pad|>"]): {"content": "<|pad|>", "special": True}}}))
    listed = BPETokenizer.from_dir(str(tmp_path))
    assert listed.encode(text).tolist() == reference.encode(text).ids
    assert listed.decode(listed.encode(text)) == text


def test_the_byte_alphabet_is_gpt2s():
    """GPT-2's reversible byte map: printable bytes stand for themselves, the other 68 for the next free characters —
    the 256 characters `tokenizers` calls the byte-level alphabet."""
    from minipar.data import _byte_to_unicode

    tokenizers = pytest.importorskip("tokenizers", reason="the reference needs `pip install minipar[test]`")
    chars = _byte_to_unicode()
    assert sorted(chars.values()) == sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert chars[ord("A")] == "A" and chars[255] == "ÿ" and chars[ord(" ")] == "Ġ"


def test_bpe_keeps_every_underscore(trained_bpe):
    ours = BPETokenizer.from_dir(trained_bpe[0])
    code = default_corpus()[:125_000].decode("utf-8", errors="replace")
    assert ours.decode(ours.encode(code)) == code
    assert ours.decode(ours.encode("a_b __init__")) == "a_b __init__"


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    cfg = json.load(open(path))
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    json.dump(cfg, open(path, "w"))


def _scaled_queries(model, factor_of_layer):
    """A copy of ``model``'s weights with layer i's query columns multiplied by factor_of_layer(i)."""
    state = {k: v.copy() for k, v in model.state_dict().items()}
    C = model.config.n_embd
    for i in range(model.config.n_layer):
        state[f"transformer.h.{i}.attn.c_attn.weight"][:, :C] *= factor_of_layer(i)
        state[f"transformer.h.{i}.attn.c_attn.bias"][:C] *= factor_of_layer(i)
    return state


@pytest.mark.parametrize("field,factor", [("scale_attn_weights", lambda i, D: np.sqrt(D)),
                                          ("scale_attn_by_inverse_layer_idx", lambda i, D: 1.0 / (i + 1))])
def test_attention_scale_options_are_honored(tmp_path, field, factor):
    """Unscaled scores with weights W = scaled scores with W's query columns times √D (and 1/(i+1) likewise):
    the loaded model must compute exactly the first."""
    model = GPT(GPTConfig(**TINY), seed=3)
    model.save_hf(str(tmp_path))
    _edit_config(str(tmp_path), **{field: field == "scale_attn_by_inverse_layer_idx"})
    loaded = GPT.from_hf(str(tmp_path))
    assert getattr(loaded.config, field) is (field == "scale_attn_by_inverse_layer_idx")
    D = model.config.head_dim
    reference = GPT(GPTConfig(**TINY))
    reference.load_state_dict(_scaled_queries(model, lambda i: factor(i, D)))
    idx = np.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    np.testing.assert_allclose(loaded(idx)[0].data, reference(idx)[0].data, rtol=1e-12, atol=1e-14)
    assert not np.allclose(loaded(idx)[0].data, model(idx)[0].data)  # the option really changes the function
    loaded.save_hf(str(tmp_path / "again"))  # and survives a round trip
    assert getattr(hf_config(str(tmp_path / "again")), field) is (field == "scale_attn_by_inverse_layer_idx")


@pytest.mark.parametrize("changes,message", [
    (dict(activation_function="relu"), "activation_function='relu'"),
    (dict(n_inner=100), "n_inner=100"),
    (dict(add_cross_attention=True), "add_cross_attention"),
    (dict(model_type="llama"), "model_type='llama'"),
    (dict(rotary_dim=4), "'rotary_dim'"),
    (dict(n_layer=...), "'n_layer'"),
])
def test_unsupported_config_fields_are_refused(tmp_path, changes, message):
    GPT(GPTConfig(**TINY)).save_hf(str(tmp_path))
    _edit_config(str(tmp_path), **changes)
    with pytest.raises(ValueError, match=message):
        GPT.from_hf(str(tmp_path))


def test_hub_style_config_loads(tmp_path):
    """The fields of the published gpt2 config.json (dropouts, summary_*, task_specific_params) load."""
    GPT(GPTConfig(**TINY)).save_hf(str(tmp_path))
    _edit_config(str(tmp_path), attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1, summary_type="cls_index",
                 summary_use_proj=True, summary_activation=None, summary_proj_to_labels=True,
                 summary_first_dropout=0.1, task_specific_params={"text-generation": {"max_length": 50}},
                 minipar=..., dtype=..., torch_dtype=...)
    assert hf_config(str(tmp_path)).dtype == "float64"  # no dtype key: the weights' own (F64) headers decide


def test_untied_head_is_refused_or_checked(tmp_path):
    model = GPT(GPTConfig(**TINY), seed=1)
    model.save_hf(str(tmp_path))
    _edit_config(str(tmp_path), tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tie_word_embeddings is false but there is no lm_head"):
        GPT.from_hf(str(tmp_path))
    state = model.state_dict()
    model.save_hf(str(tmp_path), {**state, "lm_head.weight": state["transformer.wte.weight"]})
    _edit_config(str(tmp_path), tie_word_embeddings=False)
    assert np.array_equal(GPT.from_hf(str(tmp_path)).transformer.wte.weight.data, state["transformer.wte.weight"])


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_float64_dtype_from_either_key(tmp_path, key):
    """transformers 5 writes "dtype", earlier versions "torch_dtype"."""
    GPT(GPTConfig(**TINY)).save_hf(str(tmp_path))
    _edit_config(str(tmp_path), **{"minipar": ..., "dtype": ..., "torch_dtype": ..., key: "float64"})
    loaded = GPT.from_hf(str(tmp_path))
    assert loaded.config.dtype == "float64" and loaded.transformer.wte.weight.data.dtype == np.float64


@pytest.mark.parametrize("shard_bytes", [None, 2000])
def test_dtype_from_the_weights_when_the_config_has_none(tmp_path, shard_bytes):
    """A float64 checkpoint whose config.json carries no dtype key loads as float64 (its safetensors headers say
    F64; it loaded as float32), in one file or sharded; float32 weights without the key stay float32."""
    for dtype in ("float64", "float32"):
        GPT(GPTConfig(**{**TINY, "dtype": dtype})).save_hf(str(tmp_path), **({"max_shard_bytes": shard_bytes}
                                                                            if shard_bytes else {}))
        _edit_config(str(tmp_path), minipar=..., dtype=..., torch_dtype=...)
        assert GPT.from_hf(str(tmp_path)).transformer.wte.weight.data.dtype == np.dtype(dtype)


def test_gradient_checkpointing_in_a_config_is_accepted(tmp_path):
    """Fine-tuned GPT-2 configs often carry gradient_checkpointing, a training-time setting (minipar's is
    --recompute): it does not change what the weights compute, so the checkpoint loads."""
    GPT(GPTConfig(**TINY)).save_hf(str(tmp_path))
    _edit_config(str(tmp_path), gradient_checkpointing=True)
    assert GPT.from_hf(str(tmp_path)).config == hf_config(str(tmp_path))


def test_the_tokenizer_travels_with_the_model(tmp_path, trained_bpe):
    """save_hf writes the tokenizer: a 256-token model's byte tokenizer as a byte-level BPE with no merges (which
    encodes exactly as the bytes), a model given BPE files those files (bos/eos = its <|endoftext|>, or null), and
    no files for a vocabulary that is neither; BPETokenizer reads back what was written."""
    from minipar.data import ByteTokenizer

    text = "def naïve(x):\n    return x  # café ✓"
    GPT(GPTConfig(**{**TINY, "vocab_size": 256})).save_hf(str(tmp_path / "bytes"))
    assert BPETokenizer.from_dir(str(tmp_path / "bytes")).encode(text).tolist() == ByteTokenizer().encode(text).tolist()
    assert json.load(open(tmp_path / "bytes" / "config.json"))["eos_token_id"] is None
    directory, reference = trained_bpe
    vocab = json.load(open(os.path.join(directory, "vocab.json")))
    GPT(GPTConfig(**{**TINY, "vocab_size": len(vocab)})).save_hf(str(tmp_path / "bpe"), tokenizer=directory)
    assert BPETokenizer.from_dir(str(tmp_path / "bpe")).encode(text).tolist() == reference.encode(text).ids
    assert json.load(open(tmp_path / "bpe" / "config.json"))["eos_token_id"] == vocab.get("<|endoftext|>")
    GPT(GPTConfig(**TINY)).save_hf(str(tmp_path / "none"))
    assert not os.path.exists(tmp_path / "none" / "vocab.json")


@pytest.mark.slow  # three CLI runs (5 s): the full suite; the fast subset loads a tokenizer with its model above
def test_init_from_trains_with_the_directorys_tokenizer_and_precision(tmp_path, trained_bpe):
    """train --init-from DIR encodes the corpus with DIR's BPE (it trained on raw bytes, an IndexError below 256
    tokens), in the asked precision (bf16-mixed: 2-byte parameters; it trained in float32), and --save, --out,
    generate and export carry that tokenizer on; a directory of fewer than 256 tokens without one is refused."""
    from minipar.checkpoint import load_checkpoint
    from minipar.testing import run_command

    directory, reference = trained_bpe
    n_vocab = len(json.load(open(os.path.join(directory, "vocab.json"))))
    cfg = GPTConfig(vocab_size=n_vocab, block_size=16, n_layer=2, n_head=2, n_embd=16)
    GPT(cfg, seed=0).save_hf(str(tmp_path / "init"), tokenizer=directory)
    save, out, log = tmp_path / "save", tmp_path / "out", tmp_path / "run.jsonl"
    text = run_command(1, [sys.executable, "-m", "minipar", "train", "--init-from", str(tmp_path / "init"), "--steps",
                           "2", "--batch-size", "4", "--eval-interval", "0", "--precision", "bf16-mixed", "--save",
                           str(save), "--out", str(out), "--log-file", str(log)], timeout=300)
    corpus = default_corpus().decode("utf-8", errors="replace")
    assert f"{len(BPETokenizer.from_dir(directory).encode(corpus)):,} tokens" in text and "bf16-mixed" in text
    record = json.loads(open(log).readline())
    assert record["model_state_bytes"]["params"] == 2 * cfg.num_parameters()  # bfloat16 parameters
    for place in (out, load_checkpoint(str(save)).path):
        assert json.load(open(os.path.join(place, "vocab.json"))) == json.load(open(os.path.join(directory, "vocab.json")))
    sample = run_command(1, [sys.executable, "-m", "minipar", "generate", "--ckpt", str(save), "--prompt", "def x",
                             "--max-new-tokens", "3"], timeout=120)
    assert sample.startswith("def x")
    GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=1, n_head=2, n_embd=8)).save_hf(str(tmp_path / "small"))
    with pytest.raises(AssertionError, match="vocab_size 100 < 256 cannot hold byte tokens"):
        run_command(1, [sys.executable, "-m", "minipar", "train", "--init-from", str(tmp_path / "small"), "--steps",
                        "1", "--batch-size", "4"], timeout=120)


def test_sharded_save_and_load(tmp_path):
    model = GPT(GPTConfig(**TINY), seed=2)
    model.save_hf(str(tmp_path), max_shard_bytes=2000)
    files = sorted(os.listdir(tmp_path))
    shards = [f for f in files if f.startswith("model-")]
    assert INDEX_NAME in files and WEIGHTS_NAME not in files and len(shards) > 2
    index = json.load(open(tmp_path / INDEX_NAME))
    assert set(index["weight_map"]) == set(model.state_dict()) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in model.state_dict().values())
    loaded = GPT.from_hf(str(tmp_path))
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name], value)
    model.save_hf(str(tmp_path))  # unsharded again: the old shards and index go
    assert sorted(f for f in os.listdir(tmp_path) if "safetensors" in f) == [WEIGHTS_NAME]
    model.save_hf(str(tmp_path), max_shard_bytes=2000)
    os.remove(tmp_path / shards[0])
    with pytest.raises(FileNotFoundError, match=f"lists {shards[0]}, which is missing"):
        read_hf_weights(str(tmp_path))


def _write(path, header, data):
    head = json.dumps(header).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + data)


def test_safetensors_refuses_inconsistent_files(tmp_path):
    path = tmp_path / "bad.safetensors"
    _write(path, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(ValueError, match=r"bad.safetensors: tensor w is F32 \[3\] \(12 bytes\) but its data_offsets span 8"):
        read_safetensors(str(path))
    _write(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12))
    with pytest.raises(ValueError, match="bad.safetensors: 4 trailing bytes after the last tensor"):
        read_safetensors(str(path))
    _write(path, {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                  "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, bytes(3))
    with pytest.raises(ValueError, match="tensor b starts at byte 1"):
        read_safetensors(str(path))
    _write(path, {"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(ValueError, match="tensor w has unsupported dtype C64"):
        read_safetensors(str(path))
    path.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    with pytest.raises(ValueError, match="unreadable safetensors header"):
        read_safetensors(str(path))
    path.write_bytes(b"".join(encode_safetensors({"x": np.arange(3.0)})))  # and a good one still reads
    np.testing.assert_array_equal(read_safetensors(str(path))[0]["x"], np.arange(3.0))


def test_a_broken_index_is_refused_and_stored_dtypes_reads_every_header(tmp_path):
    from minipar.safetensors_io import stored_dtypes

    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}}))
    with pytest.raises(ValueError, match=f"{INDEX_NAME}: not a safetensors index"):
        read_hf_weights(str(tmp_path))
    assert stored_dtypes(str(tmp_path)) == set()  # unreadable: no answer rather than an error
    os.remove(tmp_path / INDEX_NAME)
    # every tensor's code, whatever its name sorts like ("Wte" before "__metadata__", "wpe" after)
    path = tmp_path / WEIGHTS_NAME
    path.write_bytes(b"".join(encode_safetensors({"Wte": np.ones(2, np.float32), "wpe": np.ones(2)}, {"k": "v"})))
    assert stored_dtypes(str(tmp_path)) == {"F32", "F64"}
    _write(path, {"w": {"shape": [1], "data_offsets": [0, 4]}}, bytes(4))  # an entry without its dtype
    assert stored_dtypes(str(tmp_path)) == set()


def test_shards_fill_up_to_the_limit_in_order(tmp_path):
    """Three 8-byte tensors under a 16-byte limit: the first two fill a shard exactly, the third starts the next; a
    tensor over the limit goes alone."""
    from minipar.safetensors_io import write_hf_weights

    tensors = {name: np.full(2, i, np.float32) for i, name in enumerate("abc")}
    names = write_hf_weights(str(tmp_path), tensors, max_shard_bytes=16)
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_NAME]
    assert json.load(open(tmp_path / INDEX_NAME))["weight_map"] == {"a": names[0], "b": names[0], "c": names[1]}
    assert len(write_hf_weights(str(tmp_path), {**tensors, "big": np.zeros(5, np.float32)}, max_shard_bytes=16)) == 4


def test_a_failed_atomic_write_leaves_nothing_and_raises_its_own_error(tmp_path):
    from minipar.safetensors_io import atomic_write

    def interrupted():
        yield b"half"
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        atomic_write(str(tmp_path / "x.json"), interrupted())
    with pytest.raises(FileNotFoundError) as err:
        atomic_write(str(tmp_path / "no-such-dir" / "x.json"), [b"{}"])
    assert err.value.__context__ is None  # open's own error, not one raised cleaning up a file never made
    assert err.value.filename == str(tmp_path / "no-such-dir" / "x.json")  # the file asked for, not the temporary
    assert os.listdir(tmp_path) == []  # neither file nor temporary


def test_a_write_past_the_file_size_limit_names_the_file(tmp_path):
    """A full disk seen through RLIMIT_FSIZE (Python ignores SIGXFSZ, so write raises EFBIG): f.write's error names
    no file; atomic_write's names the one asked for, and leaves nothing behind."""
    import errno
    import resource

    from minipar.safetensors_io import atomic_write

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limits[1]))
    try:
        with pytest.raises(OSError) as err:
            atomic_write(str(tmp_path / "big.bin"), [b"x" * 4000])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert err.value.errno == errno.EFBIG and err.value.filename == str(tmp_path / "big.bin")
    assert os.listdir(tmp_path) == []


def test_generate_keeps_a_float64_checkpoint_float64(tmp_path, capsys):
    from minipar.__main__ import main

    GPT(GPTConfig(**{**TINY, "vocab_size": 256}), seed=0).save_hf(str(tmp_path))
    _edit_config(str(tmp_path), minipar=..., torch_dtype=...)
    assert hf_config(str(tmp_path)).dtype == "float64"
    assert main(["generate", "--ckpt", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("ab")


def test_tokenizer_and_profile_parse_errors_name_the_file(tmp_path):
    from minipar.parallel.planner import Profile

    (tmp_path / "vocab.json").write_text("{not json")
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    with pytest.raises(ValueError, match="vocab.json: not a GPT-2 vocabulary"):
        BPETokenizer.from_dir(str(tmp_path))
    (tmp_path / "vocab.json").write_text('{"a": 0, "b": 1, "ab": 2}')
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nabc\n")
    with pytest.raises(ValueError, match="merges.txt: merge 2 is not two symbols"):
        BPETokenizer.from_dir(str(tmp_path))
    (tmp_path / "profile.json").write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="profile.json: not a minipar hardware profile"):
        Profile.load(str(tmp_path / "profile.json"))
