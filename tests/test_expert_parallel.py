"""Expert parallelism: the mesh's ep groups; one MoE layer across ep ranks against the single-process
layer (outputs, balancing loss, gradients, the rows and bytes exchanged); training with --ep equal to
single-process training (float64, 20 steps, losses and final parameters, with and without dropped
tokens, with --tp and --zero); experts under a pipeline and on sequence pieces (--cp, --sp); checkpoints across ep; bad layouts refused before communicating."""
import sys

import numpy as np
import pytest

from minipar.checkpoint import load_checkpoint
from minipar.testing import assert_same_training, run_command, run_ranks, train_cli

L, C, E, T, B = 2, 16, 4, 8, 8


def model(capacity):
    return ["--n-layer", str(L), "--n-head", "2", "--n-embd", str(C), "--block-size", str(T), "--batch-size", str(B),
            "--n-expert", str(E), "--capacity-factor", str(capacity), "--steps", "20", "--eval-interval", "0",
            "--json", "--lr", "3e-3", "--warmup", "5", "--dtype", "float64"]


def train(args, ranks, tmp_path, name):
    """(records, final parameters) of a run, the parameters read back from its --save checkpoint."""
    save = str(tmp_path / name)
    records, _ = train_cli([*args, "--save", save], ranks)
    return records, load_checkpoint(save).params


# ------------------------------------------------------------------------------------- mesh

def _mesh_groups(dp, ep, cp, tp):
    from minipar.comm import Communicator
    from minipar.parallel.mesh import Mesh

    world = Communicator()
    mesh = Mesh(world, dp=dp, tp=tp, cp=cp, ep=ep)
    members = {name: sorted(int(r) for r in getattr(mesh, name).all_gather(np.array([world.rank])))
               for name in ("ep_comm", "expert_grad_comm", "grad_comm")}
    pp, dp_rank, cp_rank, tp_rank = mesh.coordinates(world.rank)
    replica = dp_rank * cp + cp_rank  # ep is carved out of the dp·cp replicas, ep fastest
    rank_of = lambda q: q * tp + tp_rank  # noqa: E731  (pp = 1: replica q, this tp coordinate)
    first = replica - replica % ep
    assert members["ep_comm"] == [rank_of(q) for q in range(first, first + ep)]
    assert members["expert_grad_comm"] == [rank_of(q) for q in range(replica % ep, dp * cp, ep)]
    assert members["grad_comm"] == [rank_of(q) for q in range(dp * cp)]
    assert mesh.ep_comm.rank == mesh.ep_rank == replica % ep


@pytest.mark.parametrize("dp,ep,cp,tp", [(4, 2, 1, 2), (4, 4, 2, 1), (6, 3, 1, 1), (1, 2, 2, 2), (3, 2, 2, 1)])
def test_mesh_ep_groups(dp, ep, cp, tp):
    run_ranks(dp * cp * tp, _mesh_groups, dp, ep, cp, tp)


# ------------------------------------------------------------------------------- one layer

def _layer_across_ranks(n_expert, top_k, factor):
    """Every rank routes its own tokens; the ep-parallel layer must give what the full layer gives on them."""
    from minipar.autograd import Tensor
    from minipar.comm import Communicator
    from minipar.models.moe import MoEMLP, route
    from minipar.parallel.expert_parallel import expert_parallel

    from closed_forms import expert_capacity

    comm = Communicator()
    ep, rank, width = comm.size, comm.rank, 6
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(p.shape) * 0.5
              for p in MoEMLP(width, n_expert, top_k, factor, "float64").parameters()]
    inputs = [rng.standard_normal((2, 5, width)) for _ in range(ep)]
    upstream = [rng.standard_normal((2, 5, width)) for _ in range(ep)]

    def layer():
        moe = MoEMLP(width, n_expert, top_k, factor, "float64")
        for p, v in zip(moe.parameters(), values):
            p.data[...] = v
        return moe

    # the reference: the full layer on every rank's tokens (loss Σ_r <y_r, u_r> + aux_r)
    reference, outputs, loads = layer(), [], []
    for x, u in zip(inputs, upstream):
        y = reference(Tensor(x, requires_grad=True))
        ((y * Tensor(u)).sum() + reference.aux_loss).backward()
        outputs.append(y.data)
        probs = x.reshape(-1, width) @ values[0]
        probs = np.exp(probs - probs.max(1, keepdims=True))
        capacity = expert_capacity(factor, top_k, 10, n_expert)
        _, slot, _ = route(probs / probs.sum(1, keepdims=True), top_k, capacity)
        loads.append(np.bincount(slot[slot >= 0] // capacity, minlength=n_expert))
    parallel = layer()
    expert_parallel(parallel, comm)
    x = Tensor(inputs[rank], requires_grad=True)
    y = parallel(x)
    np.testing.assert_allclose(y.data, outputs[rank], rtol=1e-12, atol=1e-14)
    ((y * Tensor(upstream[rank])).sum() + parallel.aux_loss).backward()
    mine = slice(rank * n_expert // ep, (rank + 1) * n_expert // ep)
    experts = [(name, p) for name, p in parallel.named_parameters() if p.placement.experts]
    assert len(experts) == 4  # c_fc and c_proj, weights and biases
    for name, p in experts:  # the owner's gradient sums every rank's tokens' contributions
        full = dict(reference.named_parameters())[name].grad
        np.testing.assert_allclose(p.grad, full[mine], rtol=1e-10, atol=1e-13, err_msg=name)
    # rows and bytes: to other ranks' experts, and from other ranks to mine
    owner = np.repeat(np.arange(ep), n_expert // ep)
    rows_out = int(loads[rank][owner != rank].sum())
    rows_in = int(sum(loads[s][mine].sum() for s in range(ep) if s != rank))
    assert (parallel.tally["rows_out"], parallel.tally["rows_in"]) == (rows_out, rows_in)
    # the all-to-all volumes: E/ep int64 counts to each other rank; dispatch sends my rows to other ranks' experts
    # and combine returns the rows I computed for them, both again in backward (DeepSpeed-MoE §4)
    expected = {"ep_counts": (ep - 1) * (n_expert // ep) * 8, "ep_forward": (rows_out + rows_in) * width * 8,
                "ep_backward": (rows_in + rows_out) * width * 8}
    assert {k: comm.stats[k].bytes for k in expected} == expected


@pytest.mark.parametrize("ep,n_expert,top_k,factor", [(2, 4, 2, 4.0), (2, 4, 2, 0.5), (3, 6, 1, 1.0), (4, 4, 3, 0.75)])
def test_layer_equals_the_full_layer(ep, n_expert, top_k, factor):
    run_ranks(ep, _layer_across_ranks, n_expert, top_k, factor)


# ------------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """Single-process references, routing the same token groups as dp ranks do: --microbatches dp."""
    cache = {}

    def get(capacity, dp):
        if (capacity, dp) not in cache:
            cache[capacity, dp] = train([*model(capacity), "--microbatches", str(dp)], 1,
                                        tmp_path_factory.mktemp("single"), "save")
        return cache[capacity, dp]
    return get


CASES = ([(capacity, ep, dp, []) for capacity in (4.0, 0.5) for ep, dp in ((2, 2), (2, 4), (4, 4), (4, 8))]
         + [(0.5, ep, dp, extra) for ep, dp, extra in ((2, 2, ["--tp", "2"]), (2, 4, ["--zero", "1"]),
                                                        (2, 4, ["--zero", "2"]), (2, 2, ["--zero", "3"]),
                                                        (2, 2, ["--zero", "3", "--tp", "2"]),
                                                        (2, 4, ["--zero", "3", "--shard-group", "2"]),
                                                        (2, 4, ["--zero", "1", "--shard-group", "2"]),
                                                        (2, 2, ["--recompute", "full"]),
                                                        (2, 2, ["--zero", "3", "--recompute", "full"]))])


@pytest.mark.parametrize("capacity,ep,dp,extra", CASES)
def test_matches_single_process(tmp_path, singles, capacity, ep, dp, extra):
    """capacity 4: nothing drops; 0.5: tokens drop (identically in both runs). Each layer's exchanges send what
    the rows say; a fully recomputed layer exchanges its counts and rows once more, as "ep_recompute"."""
    tp = int(extra[extra.index("--tp") + 1]) if "--tp" in extra else 1
    result = train([*model(capacity), "--dp", str(dp), "--ep", str(ep), *extra], dp * tp, tmp_path, "ep")
    reference = singles(capacity, dp)
    assert_same_training(result, reference)
    for record, ref in zip(result[0], reference[0]):
        moe = record["experts"]
        assert moe["dropped_fraction"] == ref["experts"]["dropped_fraction"]
        assert (moe["dropped_fraction"] > 0) == (capacity < 1)
        counted = record["comm_bytes_by_op"]
        assert counted["ep_counts"] == L * (ep - 1) * (E // ep) * 8
        assert counted["ep_forward"] == counted["ep_backward"] == (moe["rows_out"] + moe["rows_in"]) * C * 8
        assert moe["rows_out"] > 0 and moe["rows_in"] > 0
        again = L * (ep - 1) * (E // ep) * 8 + (moe["rows_out"] + moe["rows_in"]) * C * 8 if "full" in extra else 0
        assert counted.get("ep_recompute", 0) == again


@pytest.mark.parametrize("dp,ep,extra", [(1, 1, []), (1, 1, ["--schedule", "zb-h1"]), (2, 2, ["--zero", "1"]),
                                         (1, 1, ["--schedule", "gpipe", "--eval-interval", "10"]),
                                         (1, 1, ["--schedule", "zb-h1", "--recompute", "full"])])
def test_experts_under_a_pipeline(tmp_path, singles, dp, ep, extra):
    """--pp 2, 2 microbatches: each stage hangs its layers' balancing loss on its output, so the routers of both
    stages get the single-process gradient; the loss, drops and loads are summed over the stages."""
    result = train([*model(0.5), "--pp", "2", "--microbatches", "2", "--dp", str(dp), "--ep", str(ep), *extra],
                   2 * dp, tmp_path, "pp")
    reference = singles(0.5, 2 * dp)  # the same routing groups: dp·m microbatches of B/(dp·m) rows
    assert_same_training(result, reference)
    for record, ref in zip((r for r in result[0] if "loss" in r), reference[0]):
        assert record["experts"]["dropped_fraction"] == ref["experts"]["dropped_fraction"] > 0
        assert (record["experts"]["expert_load_min"], record["experts"]["expert_load_max"]) == \
            (ref["experts"]["expert_load_min"], ref["experts"]["expert_load_max"])
    if "--eval-interval" in extra:
        evaluated = train_cli([*model(0.5), "--microbatches", str(2 * dp), "--eval-interval", "10"], 1)[0]
        val = lambda records: [r["val_loss"] for r in records if "val_loss" in r]  # noqa: E731
        np.testing.assert_allclose(val(result[0]), val(evaluated), rtol=1e-9)


SEQUENCE_CASES = [(2, ["--cp", "2"]), (2, ["--cp", "2", "--cp-kind", "ulysses"]),
                  (4, ["--cp", "4", "--cp-split", "contiguous"]), (2, ["--tp", "2", "--sp"]),
                  (4, ["--cp", "2", "--tp", "2", "--sp"]), (4, ["--cp", "2", "--dp", "2", "--ep", "2"]),
                  (4, ["--cp", "2", "--pp", "2", "--microbatches", "2", "--schedule", "zb-h1"]),
                  (4, ["--cp", "2", "--dp", "2", "--ep", "2", "--zero", "2", "--shard-group", "2"]),
                  (2, ["--cp", "2", "--ep", "2"]), (4, ["--cp", "2", "--tp", "2", "--sp", "--ep", "2", "--zero", "1"])]


@pytest.mark.parametrize("ranks,extra", SEQUENCE_CASES)
def test_experts_on_sequence_pieces(tmp_path, singles, ranks, extra):
    """--cp: the cp ranks route their sequences' pieces as one group (capacity, priority and balancing loss over
    the whole sequences); --sp: the MoE MLP runs whole on the gathered sequence. With tokens dropped, equal to one
    process routing dp·m microbatches of whole sequences; the exchanges send exactly the stated bytes."""
    flag = lambda name: int(extra[extra.index(name) + 1]) if name in extra else 1  # noqa: E731
    dp, m, cp, tp, top_k = flag("--dp"), flag("--microbatches"), flag("--cp"), flag("--tp"), 2
    result = train([*model(0.5), *extra], ranks, tmp_path, "seq")
    reference = singles(0.5, dp * m)
    assert_same_training(result, reference)
    for record, ref in zip(result[0], reference[0]):
        rank_own = ("rows_out", "rows_in", "exposed_all_to_all_ms")  # what this rank's exchanges did (timing too)
        assert record["experts"] == {**ref["experts"], **{k: record["experts"][k] for k in rank_own
                                                           if k in record["experts"]}}
        assert record["experts"]["dropped_fraction"] > 0
        counted = record["comm_bytes_by_op"]
        rows, layers = B // (dp * m), L // flag("--pp")  # per microbatch and layer this rank holds
        assert counted.get("cp_moe_route", 0) == layers * m * (cp - 1) * rows * (T // cp) * top_k * 8
        sp_bytes = layers * m * (tp - 1) * rows * (T // cp // tp) * C * 8 if "--sp" in extra else 0
        assert counted.get("sp_moe_forward", 0) == counted.get("sp_moe_backward", 0) == sp_bytes


@pytest.mark.slow  # 6 s: the full suite runs it (the fast subset stays under 3 minutes)
def test_checkpoints_reshard_across_ep(tmp_path, singles):
    """Saved at step 10 with ep 2 (dp 2), resumed with ep 1 (dp 2) and on one process: the same trajectory."""
    save = str(tmp_path / "save")
    train_cli([*model(0.5), "--ep", "2", "--save", save, "--save-interval", "10"], 2)
    reference = singles(0.5, 2)
    expected = [{"loss": r["loss"]} for r in reference[0][10:]]
    for ranks, flags in ((2, ["--ep", "1"]), (1, ["--microbatches", "2"])):
        records, params = train([*model(0.5), *flags, "--resume", f"{save}/step_000010"], ranks, tmp_path, f"r{ranks}")
        assert [r["step"] for r in records] == list(range(11, 21))
        assert_same_training(([{"loss": r["loss"]} for r in records], params), (expected, reference[1]))
    assert str(load_checkpoint(save).layout) == "dp2·tp1·pp1·ep2 zero0 m1"


def test_hybrid_sharding_groups_for_experts():
    """--shard-group with --ep: the experts of an ep rank shard within a shard group over equal groups of ranks —
    accepted exactly when every (shard group, ep rank) pair present counts as many dp·cp replicas (enumerated
    here independently of Layout); the mesh's expert shard and replica groups then tile expert_grad_comm."""
    from minipar.models.gpt import GPTConfig
    from minipar.parallel.layout import Layout

    cfg = GPTConfig(vocab_size=64, block_size=12, n_layer=2, n_head=2, n_embd=8, n_expert=4)
    seen = set()
    for dp, cp, ep in ((2, 1, 2), (4, 1, 2), (4, 1, 4), (2, 2, 2), (2, 3, 2), (4, 2, 2), (4, 2, 4), (6, 1, 2)):
        for k in (d for d in range(1, dp * cp) if dp * cp % d == 0):
            groups = {}
            for replica in range(dp * cp):  # dp_rank·cp + cp_rank; its experts: replica mod ep (mesh.py)
                key = (replica // k, replica % ep)
                groups[key] = groups.get(key, 0) + 1
            layout = Layout(dp=dp, cp=cp, ep=ep, zero=3, shard_group=k, cp_kind="ring", cp_split="contiguous")
            uniform = len(set(groups.values())) == 1
            assert layout.accepts(cfg, 12 * dp) == uniform, (dp, cp, ep, k)
            seen.add(uniform)
            if not uniform:
                with pytest.raises(ValueError, match=f"--shard-group {k} with --ep {ep}: each shard group"):
                    layout.validate(cfg, 12 * dp)
    assert seen == {True, False}
    run_ranks(8, _expert_shard_groups)


def _expert_shard_groups():
    from minipar.comm import Communicator
    from minipar.parallel.mesh import Mesh

    world = Communicator()
    mesh = Mesh(world, dp=4, cp=2, ep=2, shard_group=4)  # shard groups: replicas 0-3 and 4-7 (rank = replica here)
    members = lambda comm: sorted(int(r) for r in comm.all_gather(np.array([world.rank])))  # noqa: E731
    experts = world.rank % 2  # the replica's ep rank
    group = [r for r in range(8) if r // 4 == world.rank // 4 and r % 2 == experts]
    assert members(mesh.expert_shard_comm) == group  # this shard group's ranks with this rank's experts
    index = group.index(world.rank)
    assert members(mesh.expert_shard_replica_comm) == [r for r in range(8) if r % 2 == experts and
                                                       (r % 4) // 2 == index]
    groups = [c for c in vars(mesh).values() if isinstance(c, Communicator)]
    assert set(mesh.communicators()) == set(groups) and len(groups) == 12  # the step's byte report misses none
    whole = Mesh(world, dp=4, cp=2, ep=2)  # one shard group of every replica: nothing replicates across groups
    assert whole.shard_comm is whole.grad_comm and whole.expert_shard_comm is whole.expert_grad_comm
    assert whole.shard_replica_comm is None and whole.expert_shard_replica_comm is None


def test_progress_line_reports_drops_and_expert_load():
    command = [sys.executable, "-m", "minipar", "train", *[a for a in model(0.5) if a != "--json"], "--steps", "2",
               "--warmup", "2", "--ep", "2"]
    out = run_command(2, command, timeout=60)
    assert "| dropped " in out and "expert load " in out and "| ep " in out and "dp2·tp1·pp1·ep2 zero0 m1" in out


@pytest.mark.parametrize("ranks,args,message", [
    (2, ["--n-expert", "3", "--ep", "2"], "--ep 2 must divide --n-expert 3"),
    (2, ["--n-expert", "4", "--ep", "4"], "--ep 4 must divide dp·cp = 2"),
    (4, ["--n-expert", "4", "--dp", "2", "--tp", "2", "--ep", "4"], "--ep 4 must divide dp·cp = 2"),
    (3, ["--n-expert", "4", "--ep", "2"], "--ep 2 must divide dp·cp = 3"),
    (1, ["--n-expert", "2", "--expert-top-k", "3"], "--expert-top-k 3 must be between 1 and --n-expert 2"),
    (2, ["--ep", "2"], "--ep splits the experts of a mixture-of-experts model: pass --n-expert"),
    (1, ["--n-expert", "4", "--out", "x"], "--out writes a Hugging Face checkpoint, where this mixture of experts"),
    (2, ["--n-expert", "4", "--ep", "2", "--compression", "topk"], "use it without --local-sgd and --compression"),
    (1, ["--ep", "0"], "--ep must be positive"),
])
def test_bad_expert_layouts(ranks, args, message):
    base = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "8", "--batch-size", "12"]
    command = [sys.executable, "-m", "minipar", "train", *base, *args]
    with pytest.raises(AssertionError) as err:
        run_command(ranks, command, timeout=60)
    assert str(err.value).count(message) == 1 and "exit 2" in str(err.value)



MODERN_MOE = ["--n-layer", "3", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
              "--steps", "3", "--dtype", "float64", "--eval-interval", "0", "--json", "--lr", "3e-3",
              "--n-expert", "8", "--expert-top-k", "2", "--moe-inner", "12", "--n-shared-expert", "1",
              "--first-dense-layers", "1", "--capacity-factor", "0"]
DEEPSEEK_MOE = ["--n-inner", "24", "--router", "sigmoid", "--expert-groups", "4", "--topk-groups", "2", "--routed-scaling", "2.5",
                "--bias-update", "0.01", "--aux-loss-coef", "0.001"]
QWEN3_MOE = ["--n-inner", "24", "--n-head-dim", "6", "--router", "softmax-topk", "--norm-topk-prob", "false"]
# (ranks, the layout's flags, the model's) — the one-process reference runs dp·m microbatches
TODAYS = {
    "dp2 ep2 deepseek": (2, ["--dp", "2", "--ep", "2"], ["--arch", "deepseek", *DEEPSEEK_MOE]),
    "dp3 ep3 deepseek, 6 experts in 3 groups": (3, ["--dp", "3", "--ep", "3"],
                                                ["--arch", "deepseek", *DEEPSEEK_MOE, "--n-expert", "6",
                                                 "--expert-groups", "3", "--batch-size", "6"]),
    "dp2 zero3 mixtral": (2, ["--dp", "2", "--zero", "3"], ["--arch", "llama", "--n-inner", "24", "--router", "softmax-topk"]),
    "dp4 ep2 hsdp qwen3": (4, ["--dp", "4", "--ep", "2", "--zero", "3", "--shard-group", "2"],
                           ["--arch", "llama", "--n-inner", "24", "--router", "softmax-topk", "--norm-topk-prob", "false"]),
    "tp2 sp deepseek": (2, ["--tp", "2", "--sp"], ["--arch", "deepseek", *DEEPSEEK_MOE]),
    "cp2 ring gpt2 dropless": (2, ["--cp", "2"], []),
    "pp2 1f1b deepseek": (2, ["--pp", "2", "--microbatches", "2"], ["--arch", "deepseek", *DEEPSEEK_MOE]),
    "recompute full deepseek": (1, ["--recompute", "full"], ["--arch", "deepseek", *DEEPSEEK_MOE]),
    "tp2 qwen3": (2, ["--tp", "2"], ["--arch", "qwen3", *QWEN3_MOE]),
    "cp2 ulysses qwen3": (2, ["--cp", "2", "--cp-kind", "ulysses"], ["--arch", "qwen3", *QWEN3_MOE]),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "dp2 ep2 deepseek" else pytest.mark.slow)
                                  for n in TODAYS])
def test_todays_moe_equals_one_process(tmp_path, name):
    """Fine-grained SwiGLU experts, a shared expert, a first dense layer, dropless dispatch, and DeepSeek-V3's
    sigmoid routing with groups, scaling, the sequence-wise loss and the bias update — on each axis equal to one
    process (float64, rtol 1e-9), the router biases too (they travel in the checkpoint)."""
    ranks, layout, model = TODAYS[name]
    dp = int(layout[layout.index("--dp") + 1]) if "--dp" in layout else 1
    m = int(layout[layout.index("--microbatches") + 1]) if "--microbatches" in layout else 1
    parallel = train_cli([*MODERN_MOE, *model, *layout, "--save", str(tmp_path / "p")], ranks, timeout=240)[0]
    single = train_cli([*MODERN_MOE, *model, "--microbatches", str(dp * m), "--save", str(tmp_path / "s")], 1)[0]
    saved = load_checkpoint(str(tmp_path / "p")).params, load_checkpoint(str(tmp_path / "s")).params
    assert_same_training((parallel, saved[0]), (single, saved[1]))
    biases = [n for n in saved[1] if n.endswith("score_bias")]
    assert bool(biases) == ("deepseek" in name)
    for n in biases:  # moved by γ = 0.01 each of the 3 steps, the same on every rank
        assert 0 < np.abs(saved[1][n]).max() <= 3 * 0.01 + 1e-7
    if "--ep" in layout:  # dropless all-to-all-v: the rows each rank's tokens sent and received, C = 16 float64
        flags = [*MODERN_MOE, *model, *layout]  # and per MoE layer and microbatch the counts of the other ranks' E/ep
        last = max(i for i, flag in enumerate(flags) if flag == "--n-expert")  # the one train reads
        ep, experts = int(layout[layout.index("--ep") + 1]), int(flags[last + 1])
        moe_layers, microbatches = 2, 1
        for record in parallel:
            sent, rows = record["comm_bytes_by_op"], record["experts"]["rows_out"] + record["experts"]["rows_in"]
            assert sent["ep_forward"] == sent["ep_backward"] == rows * 16 * 8
            assert sent["ep_counts"] == moe_layers * microbatches * (ep - 1) * (experts // ep) * 8
    for mine, reference in zip(parallel, single):  # the balance report: the same loads as one process counts
        report, expected = mine["experts"], reference["experts"]
        assert len(report["load_max_over_mean"]) == 2 and report["dropped_fraction"] == 0  # 2 MoE layers, dropless
        np.testing.assert_allclose(report["load_max_over_mean"], expected["load_max_over_mean"], rtol=1e-12)
        assert report.get("bias_range") == expected.get("bias_range") and ("bias_range" in report) == bool(biases)


@pytest.mark.slow  # two 2-rank runs: the full suite; the fast subset runs ep with the overlap on (dp2 ep2 deepseek)
def test_the_shared_experts_compute_while_the_tokens_travel(tmp_path):
    """Under --ep the dispatch and combine go to the communication thread (an all-to-all-v each) and the shared
    experts compute while the dispatch travels: the same numbers as the blocking exchange, bit for bit; the step
    record's experts report the exposed exchange time, and --trace shows each wait as a span of its own."""
    import json

    flags = [*MODERN_MOE, "--arch", "deepseek", *DEEPSEEK_MOE, "--dp", "2", "--ep", "2"]
    overlapped = train_cli([*flags, "--trace", str(tmp_path / "t.json"), "--save", str(tmp_path / "o")], 2)[0]
    blocking = train_cli([*flags, "--no-moe-overlap", "--save", str(tmp_path / "b")], 2)[0]
    assert [r["loss"] for r in overlapped] == [r["loss"] for r in blocking]
    params = load_checkpoint(str(tmp_path / "o")).params, load_checkpoint(str(tmp_path / "b")).params
    for name, value in params[1].items():
        np.testing.assert_array_equal(params[0][name], value, err_msg=name)
    assert all(r["experts"]["exposed_all_to_all_ms"] >= 0 for r in overlapped)
    with open(tmp_path / "t.json") as f:
        names = {event["name"] for event in json.load(f)["traceEvents"]}
    assert {"wait ep_forward", "wait ep gradient rows"} <= names
