"""Tutorial 14: composing every axis — dp · tp (with sp) · pp · cp · ep in one run, equal to one process.

    python tutorials/14_every_axis.py [--plot mesh.svg]    (it starts mpiexec -n 16 itself; --plot: the mesh, drawn)

Five axes of degree 2 take 2·2·2·2 = 16 ranks: expert parallelism is carved out of the dp·cp replicas,
so ep 2 adds none. The model is a mixture of experts (4 experts, top-2, capacity 0.5, so tokens
drop) trained in float64 under DualPipeV with 4 microbatches.

1. The layout: one `Layout`, checked by its rules before any rank starts, and where rank 5 sits.
2. 16 ranks train 6 steps: `python -m minipar train` with every flag, the same command a user types.
3. One process trains the same 6 steps, routing the same token groups (dp·m = 8 microbatches of whole
   sequences): the same losses and final parameters (rtol 1e-9), the same share of dropped tokens.
4. What each axis sent in one step, by label.
"""
import os
import sys
import tempfile

import numpy as np

from minipar.checkpoint import load_checkpoint
from minipar.models.gpt import GPTConfig
from minipar.parallel.layout import Layout
from minipar.testing import assert_same_training, train_cli

MODEL = ["--n-layer", "4", "--n-head", "2", "--n-embd", "16", "--block-size", "8", "--batch-size", "8",
         "--n-expert", "4", "--capacity-factor", "0.5", "--steps", "6", "--warmup", "2", "--lr", "3e-3",
         "--dtype", "float64", "--eval-interval", "0", "--json"]
AXES = ["--dp", "2", "--ep", "2", "--tp", "2", "--sp", "--pp", "2", "--schedule", "dualpipev", "--microbatches", "4",
        "--cp", "2"]

layout = Layout(dp=2, ep=2, tp=2, sp=True, pp=2, schedule="dualpipev", microbatches=4, cp=2)
layout.validate(GPTConfig(vocab_size=256, block_size=8, n_layer=4, n_head=2, n_embd=16, n_expert=4), batch_size=8,
                world_size=16)
print(f"1. {layout}: {layout.world} ranks, accepted by Layout's rules")
rank_of = lambda pp, dp, cp, tp: ((pp * 2 + dp) * 2 + cp) * 2 + tp  # noqa: E731  mesh.py: tp fastest, then cp, dp, pp
assert rank_of(0, 1, 0, 1) == 5
# ep groups are runs of 2 of the replicas q = dp·cp + cp_rank (mesh.py): rank 5 is replica 2, its ep partner replica 3
partners = {"tp": rank_of(0, 1, 0, 0), "cp (and ep)": rank_of(0, 1, 1, 1), "dp": rank_of(0, 0, 0, 1),
            "pp": rank_of(1, 1, 0, 1)}
print("   rank 5 = (pp, dp, cp, tp) (0, 1, 0, 1); its partner along each axis: "
      + ", ".join(f"{axis} {rank}" for axis, rank in partners.items()))

work = tempfile.mkdtemp(prefix="minipar_tutorial_14_")
records, _ = train_cli([*MODEL, *AXES, "--save", os.path.join(work, "parallel")], ranks=16, timeout=240)
parallel = (records, load_checkpoint(os.path.join(work, "parallel")).params)
print(f"2. 16 ranks: losses {[round(r['loss'], 6) for r in records]}")
print(f"   dropped for capacity: {[round(r['experts']['dropped_fraction'], 4) for r in records]}")

records, _ = train_cli([*MODEL, "--microbatches", "8", "--save", os.path.join(work, "single")], ranks=1)
single = (records, load_checkpoint(os.path.join(work, "single")).params)
assert_same_training(parallel, single)
assert [r["experts"]["dropped_fraction"] for r in parallel[0]] == [r["experts"]["dropped_fraction"] for r in single[0]]
assert all(r["experts"]["dropped_fraction"] > 0 for r in single[0])
print(f"3. one process: losses {[round(r['loss'], 6) for r in records]}")
print(f"   equal: 6 losses and all {len(single[1])} parameter tensors within rtol 1e-9, the same tokens dropped")

sent = parallel[0][-1]["comm_bytes_by_op"]
print("4. bytes rank 0 sent in the last step, by label:")
for label, count in sorted(sent.items(), key=lambda item: -item[1]):
    print(f"   {label:<22} {count:>8}")
for label in ("cp_forward", "cp_moe_route", "sp_moe_forward", "ep_forward", "grads"):
    assert sent.get(label, 0) > 0, label
assert np.isfinite(parallel[0][-1]["loss"])
if "--plot" in sys.argv:  # --plot FILE.svg: which rank holds which layers, heads, sequence chunks and experts
    from minipar.figures import draw_mesh

    draw_mesh(sys.argv[sys.argv.index("--plot") + 1], layout, n_layer=4, n_head=2, n_expert=4)
print("tutorial 14: all invariants hold")
