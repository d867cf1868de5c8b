"""Sharded checkpoints: kill and resume continues the identical loss trajectory; a checkpoint saved
in one layout resumes in another; export to Hugging Face from any layout; damaged checkpoints fail
clearly before training starts."""
import hashlib
import json
import shutil
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minipar.checkpoint import load_checkpoint
from minipar.safetensors_io import read_safetensors
from minipar.models.gpt import GPT
from minipar.testing import RANK_ENV, mpiexec, run_command

MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
         "--eval-interval", "0", "--json", "--lr", "3e-3", "--warmup", "2", "--dtype", "float64"]


def launch(ranks, args):
    command = [sys.executable, "-m", "minipar", "train", *MODEL, *args]
    return command if ranks == 1 else [mpiexec(), "-n", str(ranks), *command]


def train(ranks, args):
    if ranks == 1:
        proc = subprocess.run(launch(1, args), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        text = proc.stdout
    else:
        text = run_command(ranks, launch(1, args), timeout=300)
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]  # notes go to stderr
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_kill_and_resume_gives_the_identical_trajectory(tmp_path):
    steps, save = 100, str(tmp_path / "ckpt")
    reference = train(2, ["--dp", "2", "--steps", str(steps)])
    proc = subprocess.Popen(launch(2, ["--dp", "2", "--steps", str(steps), "--save", save, "--save-interval", "5"]),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            env={**os.environ, **RANK_ENV})
    try:
        for line in proc.stdout:  # past step 10, and the writer thread has completed a checkpoint
            if json.loads(line)["step"] >= 10 and os.path.exists(os.path.join(save, "latest")):
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no clean shutdown: whatever was mid-write stays half-written
        proc.wait()
    resumed_from = load_checkpoint(save).step
    assert 5 <= resumed_from < steps, "the run must have been killed between checkpoints"
    resumed = train(2, ["--dp", "2", "--steps", str(steps), "--resume", save])
    assert min(resumed) == resumed_from + 1 and max(resumed) == steps
    assert all(resumed[s] == reference[s] for s in resumed), "resumed losses must equal the uninterrupted run's"


@pytest.fixture(scope="module")
def saved_dp2_tp2(tmp_path_factory):
    """10 steps with dp2·tp2 + ZeRO-1, checkpointed at step 5."""
    root = tmp_path_factory.mktemp("ckpt")
    train(4, ["--dp", "2", "--tp", "2", "--zero", "1", "--steps", "10", "--save", str(root / "c"), "--save-interval", "5"])
    return root


@pytest.mark.parametrize("ranks,layout", [(1, []), (4, ["--tp", "4"]), (4, ["--pp", "2", "--dp", "2"]),
                                          (2, ["--dp", "2", "--zero", "3"]),
                                          (4, ["--pp", "2", "--dp", "2", "--zero", "3", "--schedule", "zb-h1",
                                               "--microbatches", "4"])])
def test_resume_in_another_layout(saved_dp2_tp2, tmp_path, ranks, layout):
    single = train(1, ["--steps", "10", "--out", str(tmp_path / "single")])
    resumed = train(ranks, [*layout, "--steps", "10", "--resume", str(saved_dp2_tp2 / "c" / "step_000005"),
                            "--out", str(tmp_path / "resumed")])
    assert sorted(resumed) == list(range(6, 11))
    np.testing.assert_allclose([resumed[s] for s in range(6, 11)], [single[s] for s in range(6, 11)], rtol=1e-9)
    final, expected = (read_safetensors(str(tmp_path / d / "model.safetensors"))[0] for d in ("resumed", "single"))
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def test_export_to_hugging_face_from_a_sharded_layout(saved_dp2_tp2, tmp_path):
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "minipar", "export", "--ckpt", str(saved_dp2_tp2 / "c"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "step 10 (dp2·tp2·pp1 zero1 m1)" in proc.stdout
    model, ckpt = GPT.from_hf(str(out)), load_checkpoint(str(saved_dp2_tp2 / "c"))
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, ckpt.params[name])
    assert ckpt.params["transformer.wte.weight"].shape == (256, 16)  # tp padding stripped


def _damage(step_dir, how):
    shard = os.path.join(step_dir, "pp0-tp1.safetensors")
    if how == "missing":
        os.remove(shard)
    elif how == "corrupted":
        blob = bytearray(open(shard, "rb").read())
        blob[-3] ^= 0xFF
        open(shard, "wb").write(bytes(blob))
    elif how == "truncated":
        blob = open(shard, "rb").read()
        open(shard, "wb").write(blob[:-10])
    elif how == "interrupted":
        os.remove(os.path.join(step_dir, "manifest.json"))
    elif how == "tokenizer":  # one byte of the vocabulary changed: the data would encode differently
        vocab = os.path.join(step_dir, "vocab.json")
        text = open(vocab, encoding="utf-8").read()
        open(vocab, "w", encoding="utf-8").write(text.replace('": 97', '": 98', 1))


@pytest.mark.parametrize("how,message", [("missing", "step_000005/pp0-tp1.safetensors is missing"),
                                         ("corrupted", "pp0-tp1.safetensors is corrupted (sha256 differs from"),
                                         ("truncated", "(truncated?)"),
                                         ("interrupted", "step_000005/manifest.json is missing: the save was interrupted")])
def test_damaged_step_is_one_clear_error(saved_dp2_tp2, tmp_path, how, message):
    """Naming one damaged step refuses it: every rank finds the same fault, rank 0 reports it once."""
    copy = tmp_path / "c"
    shutil.copytree(saved_dp2_tp2 / "c", copy)
    _damage(str(copy / "step_000005"), how)
    with pytest.raises(AssertionError) as err:
        run_command(2, launch(1, ["--dp", "2", "--steps", "10", "--resume", str(copy / "step_000005")]), timeout=60)
    assert str(err.value).count(message) == 1 and "Traceback" not in str(err.value) and "exit 2" in str(err.value)


@pytest.mark.slow  # 2.6 s: the fast subset detects damage in test_damaged_step_is_one_clear_error; launch's tests too
@pytest.mark.parametrize("how", ["interrupted", "corrupted", "unreadable-manifest", "tokenizer"])
def test_damaged_newest_checkpoint_falls_back(saved_dp2_tp2, tmp_path, how):
    """Resuming from a --save directory skips a damaged newest step, says so, and takes the last complete one."""
    copy = tmp_path / "c"
    shutil.copytree(saved_dp2_tp2 / "c", copy)
    if how == "unreadable-manifest":
        (copy / "step_000010" / "manifest.json").write_text('{"format": "minipar-checkpoint-1", "step": ')
    else:
        _damage(str(copy / "step_000010"), how)
    os.remove(copy / "latest")  # and a missing `latest` is no obstacle: the steps are scanned
    loaded = load_checkpoint(str(copy))
    assert loaded.step == 5 and len(loaded.skipped) == 1 and "step_000010" in loaded.skipped[0]
    if how == "unreadable-manifest":
        assert "step_000010/manifest.json: unreadable (JSONDecodeError" in loaded.skipped[0]
    if how == "tokenizer":
        assert "step_000010/vocab.json is corrupted (sha256 differs from the manifest)" in loaded.skipped[0]
    out = run_command(2, launch(1, ["--dp", "2", "--steps", "6", "--resume", str(copy)]), timeout=60)
    assert "skipped damaged checkpoint" in out and "resumed from" in out and "step_000005" in out


def test_no_complete_checkpoint_is_an_error(tmp_path):
    (tmp_path / "step_000003").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint; .*step_000003.*manifest.json is missing"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no checkpoint here"):
        load_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        load_checkpoint(str(tmp_path / "nowhere"))


def test_latest_points_at_a_complete_step(saved_dp2_tp2):
    root = saved_dp2_tp2 / "c"
    assert open(root / "latest").read().strip() == "step_000010"
    manifest = json.load(open(root / "step_000010" / "manifest.json"))
    from minipar.parallel.layout import Layout

    assert manifest["layout"] == Layout(dp=2, tp=2, zero=1).as_dict()  # the whole layout it was written under
    assert sorted(f["file"] for f in manifest["files"]) == ["pp0-tp0.safetensors", "pp0-tp1.safetensors"]
    tokenizer = {f["file"]: f for f in manifest["extra_files"]}  # the byte tokenizer's files, checksummed too
    assert sorted(tokenizer) == ["merges.txt", "tokenizer_config.json", "vocab.json"]
    for name, entry in tokenizer.items():
        blob = open(root / "step_000010" / name, "rb").read()
        assert entry == {"file": name, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    assert not [f for f in os.listdir(root / "step_000010") if ".tmp-" in f]


def test_step_directories_are_found_by_number(tmp_path):
    """Newest first by step number, past six digits too; nothing else in the directory is mistaken for a step."""
    from minipar.checkpoint import step_dirs

    for name in ("step_000009", "step_099999", "step_100000", "step_1000000", "step_notes", "backup_000123", "latest"):
        os.makedirs(tmp_path / name)
    assert [os.path.basename(d) for d in step_dirs(str(tmp_path))] == ["step_1000000", "step_100000", "step_099999",
                                                                      "step_000009"]


@pytest.mark.slow  # 4 s: the fast subset resumes bit for bit in test_kill_and_resume and test_resume_restores_every_state
def test_one_process_saves_a_complete_checkpoint_and_resumes_it_bit_for_bit(tmp_path):
    """One rank writes every shard, the manifest and `latest` itself; 4 steps equal 2 + 2 resumed, to the bit."""
    whole = train(1, ["--steps", "4"])
    train(1, ["--steps", "2", "--decay-steps", "4", "--save", str(tmp_path / "ckpt")])
    assert os.path.isfile(tmp_path / "ckpt" / "step_000002" / "manifest.json")
    assert open(tmp_path / "ckpt" / "latest").read().strip() == "step_000002"
    resumed = train(1, ["--steps", "4", "--resume", str(tmp_path / "ckpt")])
    assert resumed == {3: whole[3], 4: whole[4]}


@pytest.mark.slow  # the fast subset keeps under 3 minutes; the module has faster tests
def test_a_checkpoint_from_before_the_layout_record_still_loads(tmp_path):
    """Manifests written before the Layout record stored only dp, ep, cp, tp, pp and zero: such a checkpoint loads,
    its other layout fields at their defaults, and resumes as a new one does."""
    from minipar.parallel.layout import Layout

    whole = train(1, ["--steps", "4"])
    train(1, ["--steps", "2", "--decay-steps", "4", "--save", str(tmp_path / "ckpt")])
    manifest_path = tmp_path / "ckpt" / "step_000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["layout"] = {"dp": 1, "ep": 1, "cp": 1, "tp": 1, "pp": 1, "zero": 0}  # the old record
    manifest_path.write_text(json.dumps(manifest))
    assert load_checkpoint(str(tmp_path / "ckpt")).layout == Layout()
    assert train(1, ["--steps", "4", "--resume", str(tmp_path / "ckpt")]) == {3: whole[3], 4: whole[4]}


@pytest.mark.slow  # the fast subset keeps under 3 minutes; the module has faster tests
def test_resume_takes_the_step_latest_names(tmp_path):
    """A step directory newer than `latest` — another run's, here with another model — is never resumed from."""
    train(1, ["--steps", "4", "--save", str(tmp_path / "run"), "--save-interval", "2"])
    train(1, ["--steps", "2", "--n-embd", "32", "--save", str(tmp_path / "other")])
    shutil.move(str(tmp_path / "other" / "step_000002"), str(tmp_path / "run" / "step_000009"))
    assert load_checkpoint(str(tmp_path / "run")).path.endswith("step_000004")
    os.remove(tmp_path / "run" / "latest")  # without it: every step directory, newest first
    assert load_checkpoint(str(tmp_path / "run")).path.endswith("step_000009")


STATEFUL = [(1, ["--dtype", "float32", "--precision", "fp16-mixed", "--n-embd", "32", "--n-head", "2"]),
            (2, ["--dp", "2", "--compression", "topk", "--topk-ratio", "0.05"]),
            (2, ["--dp", "2", "--compression", "int8"]), (2, ["--dp", "2", "--compression", "bf16"]),
            (2, ["--dp", "2", "--compression", "powersgd", "--powersgd-rank", "2"]),
            (2, ["--dp", "2", "--dtype", "float32", "--precision", "fp16-mixed", "--compression", "powersgd",
                 "--loss-scale", str(2.0**24)]),
            (2, ["--dp", "2", "--local-sgd", "4"]), (3, ["--dp", "3", "--batch-size", "6", "--local-sgd", "2", "--staleness", "1"]),
            (2, ["--dp", "2", "--dtype", "float32", "--precision", "bf16-mixed", "--local-sgd", "4"])]


@pytest.mark.parametrize("ranks,extra", STATEFUL)
def test_resume_restores_every_state_bit_for_bit(tmp_path, ranks, extra):
    """12 steps = 6 saved + 6 resumed, to the bit, where state beyond parameters and moments decides the
    trajectory: the fp16 loss scale and its counter (one process overflows at step 5 from 2^16 and continues at
    2^15; a resumed run at 2^16 would overflow again), top-k's and PowerSGD's error feedback and PowerSGD's warm
    start, and local SGD's replicas (saved mid-round at H = 4; with staleness 1 a round is in flight), all of
    which differ per rank (each rank writes its own file). The casting compressors hold no state."""
    whole = train(ranks, ["--steps", "12", *extra])
    save = tmp_path / "ckpt"
    train(ranks, ["--steps", "6", "--decay-steps", "12", "--save", str(save), *extra])
    resumed = train(ranks, ["--steps", "12", "--resume", str(save), *extra])
    assert resumed == {step: whole[step] for step in range(7, 13)}
    ckpt = load_checkpoint(str(save))
    if "fp16-mixed" in extra:  # an overflow backed the scale off before the save
        assert ckpt.training["loss_scale"] < (float(extra[extra.index("--loss-scale") + 1]) if "--loss-scale" in extra
                                              else 2.0**16)
    if "topk" in extra or "powersgd" in extra or "--local-sgd" in extra:
        assert sorted(ckpt.rank_files) == list(range(ranks))
        states = [ckpt.rank_state(r) for r in range(ranks)]
        assert states[0].keys() == states[1].keys() and states[0]
        assert any((states[0][k] != states[1][k]).any() for k in states[0])  # error feedback is the rank's own
    else:
        assert not ckpt.rank_files


def test_staged_bytes_are_the_safetensors_file():
    """encode_into (one buffer, reused) writes exactly the bytes encode_safetensors' chunks make — bfloat16, a
    transposed (non-contiguous) array and integers included — and reuses a buffer of the right size."""
    import ml_dtypes

    from minipar.safetensors_io import encode_into, encode_safetensors

    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4).astype(ml_dtypes.bfloat16),
               "c": np.arange(4.0).reshape(2, 2).T, "d": np.arange(3, dtype=np.int64)}
    staged = encode_into(tensors, {"k": "v"})
    assert staged.tobytes() == b"".join(encode_safetensors(tensors, {"k": "v"}))
    assert encode_into(tensors, {"k": "v"}, staged) is staged
    assert encode_into({"a": tensors["a"]}, None, staged) is not staged  # another size: a new buffer


def test_an_asynchronous_save_waits_only_for_the_copy(tmp_path, monkeypatch):
    """With the writer slowed to 0.5 s a file, save_checkpoint returns at once, before any file or the manifest
    exists; what it writes is the tensors as they were when it was called (training changes them right after);
    the next save waits for the previous one and reuses its staging buffer."""
    from minipar.checkpoint import WRITE_DELAY_ENV, CheckpointWriter, save_checkpoint
    from minipar.comm import Communicator
    from minipar.models.gpt import GPTConfig
    from minipar.parallel.layout import Layout

    monkeypatch.setenv(WRITE_DELAY_ENV, "0.5")
    weight = np.arange(6.0)
    state = {"param": {"w": weight}, "exp_avg": {"w": np.zeros(6)}, "exp_avg_sq": {"w": np.ones(6)}}
    mesh, writer, root = Layout().mesh(Communicator()), CheckpointWriter(), str(tmp_path / "c")
    started = time.monotonic()
    save_checkpoint(root, 1, state, mesh, GPTConfig(), Layout(), 1, writer=writer)
    assert time.monotonic() - started < 0.4 and not os.path.exists(os.path.join(root, "step_000001", "manifest.json"))
    weight[:] = -1.0  # the next step changes the live tensor
    buffer = writer.buffers["pp0-tp0.safetensors"]
    save_checkpoint(root, 2, state, mesh, GPTConfig(), Layout(), 2, writer=writer)  # waits for step 1's write
    assert os.path.isfile(os.path.join(root, "step_000001", "manifest.json"))
    assert writer.buffers["pp0-tp0.safetensors"] is buffer
    writer.wait()
    assert np.array_equal(load_checkpoint(os.path.join(root, "step_000001")).params["w"], np.arange(6.0))
    assert np.array_equal(load_checkpoint(root).params["w"], np.full(6, -1.0))
    assert not [n for n in os.listdir(os.path.join(root, "step_000002")) if n.startswith(".entry-")]
