"""The command line: training output, loss that falls, checkpoints, generation, bad input."""
import json
import os
import subprocess
import sys

import pytest

from minipar.__main__ import main
from minipar.parallel.planner import default_profile_path

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4"]


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "minipar", *args], capture_output=True, text=True, timeout=timeout)


def test_train_json_lines_and_checkpoint(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "3", "--json", "--eval-interval", "0", "--out", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert all({"loss", "lr", "tokens_per_s", "ms", "grad_norm"} <= set(r) for r in lines)
    assert all(r["comm_bytes"] == 0 for r in lines)  # one process sends nothing
    assert os.path.exists(tmp_path / "model.safetensors") and os.path.exists(tmp_path / "config.json")

    assert main(["generate", "--ckpt", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.slow  # the fast subset keeps under 3 minutes; the module has faster tests
def test_loss_falls_on_default_corpus(capsys):
    args = ["train", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
            "--steps", "120", "--lr", "3e-3", "--warmup", "10", "--json", "--eval-interval", "0"]
    assert main(args) == 0
    losses = [json.loads(line)["loss"] for line in capsys.readouterr().out.splitlines()]
    assert losses[0] > 5.0  # ≈ ln 256 = 5.55 at initialization
    assert sum(losses[-10:]) / 10 < 3.0


def test_gradient_accumulation_equals_full_batch(capsys):
    """--microbatches 4 must give the same losses as one batch (float64)."""
    outs = []
    for m in ("1", "4"):
        assert main(["train", *TINY, "--steps", "4", "--dtype", "float64", "--microbatches", m, "--json",
                     "--eval-interval", "0"]) == 0
        outs.append([json.loads(line)["loss"] for line in capsys.readouterr().out.splitlines()])
    assert outs[0] == pytest.approx(outs[1], rel=1e-12)


def test_text_progress_line():
    out = run_cli("train", *TINY, "--steps", "2", "--eval-interval", "0")
    assert out.returncode == 0, out.stderr
    step_lines = [line for line in out.stdout.splitlines() if line.startswith("step")]
    assert len(step_lines) == 2 and "loss" in step_lines[0] and "tok/s" in step_lines[0] and "ms" in step_lines[0]


@pytest.mark.parametrize("args,message", [
    (["train", "--n-embd", "30", "--n-head", "4"], "divisible by n_head"),
    (["train", "--data", "/no/such/file"], "data file not found"),
    (["train", "--data", "/"], "--data / is a directory: pass one text file"),
    (["train", "--batch-size", "6", "--microbatches", "4"], "not divisible by --dp·--microbatches"),
    (["train", "--steps", "0"], "--steps must be positive"),
    (["train", "--eval-batches", "0"], "--eval-batches must be positive, got 0"),
    (["train", "--log-interval", "0"], "--log-interval must be positive"),
    (["train", "--lr=-1e-3"], "--lr must be >= 0, got -0.001"),
    (["train", "--min-lr", "-1"], "--min-lr must be >= 0"),
    (["train", "--warmup", "-5"], "--warmup must be >= 0"),
    (["train", "--steps", "12", "--warmup", "20"], "--warmup 20 is longer than the schedule (12 steps, --steps)"),
    (["train", "--steps", "12", "--decay-steps", "0"], "--decay-steps must be positive, got 0"),
    (["train", "--steps", "6", "--decay-steps", "12", "--warmup", "13"], "(12 steps, --decay-steps)"),
    (["train", "--grad-clip", "-1"], "--grad-clip must be >= 0"),
    (["train", "--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["train", "--eval-interval", "-1"], "--eval-interval must be >= 0"),
    (["train", "--keep-last", "2"], "--keep-last prunes the checkpoints of --save"),
    (["train", "--block-size", "100000"], "GB is available on the cpu: reduce --block-size"),
    (["train", "--no-such-flag"], "unrecognized arguments"),
    (["train", "--n-lay", "2"], "unrecognized arguments"),  # no abbreviations: flags are matched exactly
    (["generate", "--ckpt", "/no/such/dir"], "no config.json"),
    (["train", "--min-lr", "0.1"], "--min-lr 0.1 is above --lr 0.002: the cosine schedule would raise the rate"),
    (["train", "--lr", "1e-4", "--min-lr", "2e-4"], "--min-lr 0.0002 is above --lr 0.0001"),
    (["train", "--precision", "fp16-mixed", "--loss-scale=-1"], "--loss-scale must be positive, got -1"),
    (["train", "--loss-scale", "1024"], "--loss-scale has no effect here: it needs --precision fp16-mixed"),
    (["train", "--capacity-factor", "2"], "--capacity-factor has no effect here: it needs --n-expert"),
    (["train", "--expert-top-k", "1"], "--expert-top-k has no effect here: it needs --n-expert"),
    (["train", "--topk-ratio", "0.1"], "--topk-ratio has no effect here: it needs --compression topk"),
    (["train", "--compression", "topk", "--powersgd-rank", "2"], "--powersgd-rank has no effect here: it needs "
                                                                  "--compression powersgd"),
    (["train", "--staleness", "1"], "--staleness has no effect here: it needs --local-sgd"),
    (["train", "--compression", "topk", "--topk-ratio", "1.5"], "--topk-ratio must be in (0, 1], got 1.5"),
    (["train", "--compression", "powersgd", "--powersgd-rank", "0"], "--powersgd-rank must be >= 1, got 0"),
    (["train", "--local-sgd", "2", "--staleness", "-1"], "--local-sgd and --staleness must be >= 0"),
    (["train", "--outer-lr", "1"], "--outer-lr has no effect here: it needs --local-sgd"),
    (["train", "--cp-kind", "ulysses"], "--cp-kind has no effect here: it needs --cp 2 or more"),
    (["train", "--zero", "1", "--no-prefetch"], "--no-prefetch has no effect here: it needs --zero 3"),
    (["train", "--save-interval", "5"], "--save-interval has no effect here: it needs --save"),
    (["train", "--auto", "--tp", "1"], "--auto chooses the layout itself: drop --tp"),
    (["train", "--auto", "--check", "2", "--check-steps", "2"], "--check-steps must be >= 4 (the first half are warm-up)"),
    (["train", "--comm-timeout", "-1"], "--comm-timeout must be >= 0"),
    (["plan", "--world", "0"], "--world must be positive, got 0"),
    (["plan", "--batch-size", "0"], "--batch-size must be positive, got 0"),
    (["train", "--out", "/etc/passwd/model"], "--out /etc/passwd/model: cannot write there (Not a directory)"),
    (["train", "--save", "/etc/passwd/ckpt"], "--save /etc/passwd/ckpt: cannot write there (Not a directory)"),
    (["train", "--trace", "/etc/passwd/t.json"], "--trace /etc/passwd/t.json: cannot write there (Not a directory)"),
    (["train", "--log-file", "/etc/passwd/run.jsonl"], "--log-file /etc/passwd/run.jsonl: cannot write there"),
    (["train", "--trace", "/"], "--trace / is a directory: name a file"),
])
def test_bad_input_is_one_clear_error(args, message):
    out = run_cli(*args)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr
    if "unrecognized" not in message:  # argparse's own errors come with the usage text
        assert len(out.stderr.strip().splitlines()) == 1


def test_the_memory_check_honours_an_address_space_limit():
    """Under ``ulimit -v 3 GB`` a run that needs 23 GB is refused in one line before building anything (reading
    MemAvailable alone, it started and died in a MemoryError traceback)."""
    import resource

    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # noqa: E731
    out = subprocess.run([sys.executable, "-m", "minipar", "train", "--n-layer", "2", "--block-size", "4096",
                          "--steps", "1"], capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert out.returncode == 2 and "GB is available on the cpu" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_every_mode_flag_is_refused_without_its_mode():
    """Each flag of cli.FLAG_NEEDS, written alone, is refused naming the mode it needs, and accepted with it."""
    from minipar.__main__ import build_parser, explicit_flags
    from minipar.cli import FLAG_NEEDS, validate

    given = {"loss_scale": ["1024"], "expert_top_k": ["1"], "capacity_factor": ["2"], "aux_loss_coef": ["0.1"],
             "topk_ratio": ["0.1"], "powersgd_rank": ["2"], "outer_lr": ["1"], "outer_momentum": ["0.5"],
             "staleness": ["1"], "cp_kind": ["ulysses"], "cp_split": ["contiguous"], "no_prefetch": [],
             "save_interval": ["5"], "n_kv_head": ["2"], "n_inner": ["64"], "rope_theta": ["500"], "tie_embeddings": [],
             "fp8_recipe": ["rowwise"], "fp8_block": ["16"], "q_lora_rank": ["8"], "kv_lora_rank": ["8"],
             "qk_nope_head_dim": ["4"], "qk_rope_head_dim": ["4"], "v_head_dim": ["4"], "mtp_depth": ["1"],
             "mtp_weight": ["0.1"], "moe_inner": ["8"], "n_shared_expert": ["1"], "first_dense_layers": ["1"],
             "router": ["sigmoid"], "norm_topk_prob": ["false"], "routed_scaling": ["2.5"], "expert_groups": ["2"],
             "topk_groups": ["1"], "bias_update": ["0.001"], "n_head_dim": ["8"], "no_moe_overlap": [],
             "local_save": ["shm"], "local_save_interval": ["2"], "sync_save": [], "check": ["2"], "check_steps": ["4"]}
    mode = {"loss_scale": ["--precision", "fp16-mixed"], "topk_ratio": ["--compression", "topk"],
            "powersgd_rank": ["--compression", "powersgd"], "cp_kind": ["--cp", "2"], "cp_split": ["--cp", "2"],
            "no_prefetch": ["--zero", "3"], "save_interval": ["--save", "ckpt"], "sync_save": ["--save", "ckpt"],
            "local_save": ["--local-save-interval", "2"], "local_save_interval": ["--local-save", "shm"],
            "check": ["--auto"], "check_steps": ["--auto", "--check", "2"],
            **dict.fromkeys(("expert_top_k", "capacity_factor", "aux_loss_coef", "moe_inner", "n_shared_expert",
                             "first_dense_layers", "router", "norm_topk_prob", "routed_scaling", "expert_groups",
                             "topk_groups", "bias_update"), ["--n-expert", "4"]),
            **dict.fromkeys(("outer_lr", "outer_momentum", "staleness"), ["--local-sgd", "4"]),
            **dict.fromkeys(("n_kv_head", "n_inner", "rope_theta", "tie_embeddings"), ["--arch", "llama"]),
            **dict.fromkeys(("fp8_recipe", "fp8_block"), ["--precision", "fp8"]), "n_head_dim": ["--arch", "qwen3"], "no_moe_overlap": ["--ep", "2"],
            **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                             "mtp_depth", "mtp_weight"), ["--arch", "deepseek"])}
    assert set(given) == set(FLAG_NEEDS) == set(mode)

    def has_effect(argv):
        args = build_parser().parse_args(["train", *argv])
        args.explicit = explicit_flags(argv)
        return FLAG_NEEDS[name][1](args) if name in args.explicit else None

    for name, value in given.items():
        flag = ["--" + name.replace("_", "-"), *value]
        assert has_effect(flag) is False and has_effect([*flag, *mode[name]]) is True, name
        args = build_parser().parse_args(["train", *flag])
        args.explicit = explicit_flags(flag)
        with pytest.raises(ValueError, match=f"{flag[0]} has no effect here: it needs"):
            validate(args, 1, None)


def test_the_floor_of_the_cosine_schedule_defaults_to_a_tenth_of_the_peak():
    from minipar.__main__ import build_parser
    from minipar.cli import validate

    args = build_parser().parse_args(["train", "--lr", "3e-3"])
    validate(args, 1, None)
    assert args.min_lr == 3e-3 / 10


def test_memory_available_under_an_address_space_limit_is_what_is_left_of_it():
    """RLIMIT_AS set to what the process maps (/proc/self/statm's size, in pages) + 256 MiB: 256 MiB are left,
    within the pages mapped between the two readings."""
    code = ("import os, resource; from minipar.backend import memory_available; "
            "mapped = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE'); "
            "resource.setrlimit(resource.RLIMIT_AS, (mapped + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1])); "
            "print(mapped, memory_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    mapped, available = map(float, out.stdout.split())
    assert mapped > 64 << 20 and abs(available - (256 << 20)) < 16 << 20, out.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_a_closed_stdout_ends_the_run_quietly(as_json):
    """``minipar train | head -1``: when the reader goes away the run stops at that step's end, exit 141 (128 +
    SIGPIPE) as a shell pipeline expects, without a traceback or "Broken pipe"."""
    command = [sys.executable, "-m", "minipar", "train", *TINY, "--steps", "100000", *(["--json"] if as_json else [])]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()
    proc.stdout.close()  # as head does after its line
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "Broken pipe" not in err and "rror" not in err, err


def test_data_too_short_names_the_split(tmp_path):
    tiny = tmp_path / "ten.txt"
    tiny.write_bytes(b"0123456789")
    out = run_cli("train", *TINY, "--data", str(tiny))
    assert out.returncode == 2 and "ten.txt has 10 tokens: its training split (the first 90%, 9 tokens)" in out.stderr
    enough = tmp_path / "short.txt"
    enough.write_bytes(b"x" * 40)  # trains (36 tokens) but the validation split (4) is too short: said once
    out = run_cli("train", *TINY, "--data", str(enough), "--steps", "1")
    assert out.returncode == 0 and "note: the validation split of" in out.stdout and "no validation loss" in out.stdout


def test_help_shows_defaults():
    out = run_cli("train", "--help")
    assert out.returncode == 0 and "--microbatches" in out.stdout and "--dtype" in out.stdout
    text = " ".join(out.stdout.split())
    assert "(default: 0.002)" in text and "(default: 300)" in text and "--staleness STALENESS local SGD: apply each " \
        "round's average τ rounds later (default: 0)" in text and "(default: None)" not in text


def test_progress_log_interval_eta_log_file_and_summary(tmp_path):
    log = tmp_path / "run.jsonl"
    out = run_cli("train", *TINY, "--steps", "6", "--log-interval", "4", "--eval-interval", "3", "--eval-batches", "1",
                  "--log-file", str(log), "--out", str(tmp_path / "model"))
    assert out.returncode == 0, out.stderr
    step_lines = [line for line in out.stdout.splitlines() if line.startswith("step")]
    assert [line.split("/")[0].split()[-1] for line in step_lines] == ["4", "6"]  # every 4th step and the last
    assert all("elapsed, eta" in line for line in step_lines)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]  # the file has every step
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert records[-2]["eta_s"] == 0.0 and all(r["elapsed_s"] > 0 for r in records if "loss" in r)
    best = min(r["val_loss"] for r in records if "val_loss" in r)
    summary = out.stdout[out.stdout.index("done: 6 steps"):]
    assert "tokens/s on average" in summary and f"best val loss {best:.4f}" in summary
    assert f"wrote model: {tmp_path / 'model'}/" in summary and f"wrote step records: {log}" in summary


def test_resume_refuses_model_flags_that_disagree(tmp_path):
    save = str(tmp_path / "save")
    assert run_cli("train", *TINY, "--steps", "2", "--save", save, "--eval-interval", "0").returncode == 0
    out = run_cli("train", *TINY, "--steps", "4", "--resume", save, "--n-embd", "32")
    assert out.returncode == 2 and "--n-embd 32 disagrees with the checkpoint" in out.stderr and "n_embd=16" in out.stderr
    again = run_cli("train", *TINY, "--steps", "3", "--resume", save, "--eval-interval", "0")  # the same flags: fine
    assert again.returncode == 0, again.stderr


@pytest.mark.slow  # 7 s: the full suite runs it (the fast subset stays under 3 minutes)
def test_a_resumed_run_follows_the_schedule_of_decay_steps(tmp_path):
    """--decay-steps is the schedule's length (default --steps): a first leg given the final length resumes into
    the same rates bit for bit; a first leg without it was trained on another schedule, and the resumed run says
    so. The warm-up defaults to 30 steps, or the whole schedule when that is shorter."""
    def losses(*args):
        out = run_cli("train", *TINY, "--eval-interval", "0", "--json", *args)
        assert out.returncode == 0, out.stderr
        return {r["step"]: (r["loss"], r["lr"]) for r in map(json.loads, out.stdout.splitlines())}, out.stderr

    whole, _ = losses("--steps", "8")
    assert whole[8][1] == 2e-3 and whole[4][1] == 2e-3 * 4 / 8  # warm-up over the whole 8-step schedule
    losses("--steps", "4", "--decay-steps", "8", "--save", str(tmp_path / "a"))
    resumed, note = losses("--steps", "8", "--resume", str(tmp_path / "a"))
    assert resumed == {s: whole[s] for s in range(5, 9)} and "another learning-rate schedule" not in note
    losses("--steps", "4", "--save", str(tmp_path / "b"))
    _, note = losses("--steps", "8", "--resume", str(tmp_path / "b"))
    assert ("was trained on another learning-rate schedule: --warmup 4 there, 8 here, --decay-steps 4 there, 8 here "
            "(the rate changes from step 5)") in note
    longer, _ = losses("--steps", "40")
    assert longer[30][1] == 2e-3 and longer[29][1] == 2e-3 * 29 / 30  # 30 warm-up steps by default


def test_keep_last_and_generate_from_a_save_directory(tmp_path):
    save = tmp_path / "save"
    out = run_cli("train", *TINY, "--steps", "5", "--save", str(save), "--save-interval", "1", "--keep-last", "2",
                  "--eval-interval", "0")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in save.iterdir()) == ["latest", "step_000004", "step_000005"]
    gen = run_cli("generate", "--ckpt", str(save), "--prompt", "def ", "--max-new-tokens", "5")
    assert gen.returncode == 0 and gen.stdout.startswith("def "), gen.stderr


def test_dp_is_inferred_from_the_world_size():
    from minipar.testing import run_command

    out = run_command(4, [sys.executable, "-m", "minipar", "train", *TINY, "--tp", "2", "--steps", "1", "--json",
                          "--eval-interval", "0"], timeout=120)
    record = json.loads([line for line in out.splitlines() if line.startswith("{")][0])
    assert record["world"] == 4 and record["comm_formula_bytes"] > 0  # dp = 4 / 2: a data-parallel all-reduce ran


@pytest.mark.slow  # the fast subset keeps under 3 minutes; the module has faster tests
def test_plan_calibrates_when_no_profile_exists_and_auto_saves_its_calibration(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    plan = subprocess.run([sys.executable, "-m", "minipar", "plan", "--world", "2", "--top", "2"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert plan.returncode == 0, plan.stderr
    rows = [line for line in plan.stdout.splitlines() if line.strip()[:1].isdigit() and "·tp" in line]
    assert "measuring it" in plan.stderr and len(rows) == 2  # which layouts rank first depends on the measurement
    assert os.path.isfile(default_profile_path(2).replace(os.path.expanduser("~"), str(tmp_path)))
    huge = subprocess.run([sys.executable, "-m", "minipar", "plan", "--world", "4096", "--preset", "gpt3-175b",
                           "--top", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert huge.returncode == 0 and "using --profile a100-80gb" in huge.stderr, huge.stderr
    auto = subprocess.run([sys.executable, "-m", "minipar", "train", *TINY, "--auto", "--steps", "1",
                           "--eval-interval", "0"], capture_output=True, text=True, timeout=300, env=env)
    assert auto.returncode == 0, auto.stderr
    assert os.path.isfile(default_profile_path(1).replace(os.path.expanduser("~"), str(tmp_path)))
    assert "calibrated" in auto.stdout
