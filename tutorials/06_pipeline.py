"""Tutorial 6: pipeline parallelism — GPipe → 1F1B → interleaved 1F1B → zero bubble (ZB-H1) → DualPipeV.

    mpiexec -n 4 python tutorials/06_pipeline.py [--plot DIR]     (--plot: each schedule drawn into DIR)

The model (8 blocks) is cut into stages, one per rank; a step of m = 8 microbatches is run with each
schedule in turn. Every rank checks the losses and its stage's gradients against a single-process run,
measures the bubble on the schedule's logical clock (forward = 1, backward = 2) against the paper's closed
form, and counts the microbatches whose activations it holds at once:

    GPipe        all forwards, then all backwards          bubble (p−1)/(m+p−1)     holds m
    1F1B         backward as soon as the pipe is full      bubble (p−1)/(m+p−1)     holds p − stage
    interleaved  v = 2 chunks per rank (stages r, r + p)   bubble (p−1)/(v·m+p−1)   a little more than 1F1B
    ZB-H1        backward split: input gradients B first,  bubble (p−1)/(3m+p−1)    at most p
                 weight gradients W fill the waits
    DualPipeV    two chunks per rank in a V (stages r and   bubble (p−1)/(6m+p−1)    2p + 1 chunks
                 2p−1−r): rank 0 embeds and scores the loss

Each schedule is an object (minipar/parallel/schedules.py): its placement, every rank's actions, its bubble.

The wall-clock timeline of the last run is drawn at the end.
"""
import os
import sys
import tempfile

import numpy as np

from minipar import plot, trace
from minipar.comm import Communicator
from minipar.data import Batches, load_tokens
from minipar.models.gpt import GPT, GPTConfig
from minipar.parallel.data_parallel import DataParallel
from minipar.parallel.pipeline import Pipeline
from minipar.parallel.schedules import build

comm = Communicator()
p, s = comm.size, comm.rank
say = print if s == 0 else (lambda *a, **k: None)
m = 8
timeline = os.path.join(tempfile.gettempdir(), "minipar_tutorial_06.json")
cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2 * p, n_head=2, n_embd=32, dtype="float64")
x, y = Batches(load_tokens(), batch_size=2 * m, block_size=32, seed=0)(0)

reference = GPT(cfg, seed=0)
ref_losses = []
for xi, yi in zip(np.split(x, m), np.split(y, m)):
    _, loss = reference(xi, yi)
    (loss * (1.0 / m)).backward()
    ref_losses.append(loss.item())
ref_grads = {n: q.grad for n, q in reference.named_parameters()}

# the papers' bubbles: Huang et al. 2019 (GPipe), Narayanan et al. 2021 (1F1B, interleaved), Qi et al. 2024 (ZB-H1),
# DeepSeek-V3 2024 (DualPipeV: (p−1)(F&B + B − 3W) idle, chunk F = B = W = 1/2 and F&B = F + B + W, over 3m of work)
PAPER = {"gpipe": lambda v: (p - 1) / (m + p - 1), "1f1b": lambda v: (p - 1) / (m + p - 1),
         "interleaved": lambda v: (p - 1) / (v * m + p - 1), "zb-h1": lambda v: (p - 1) / (3 * m + p - 1),
         "dualpipev": lambda v: (p - 1) / 2 / (3 * m + (p - 1) / 2)}
bubbles = {}
for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("dualpipev", 2)):
    schedule = build(kind, p, m, v)
    ops = " ".join(f"{k}{i}" if c == 0 else f"{k.lower()}{i}" for k, i, c in schedule.actions(s))
    say(f"\n{kind}{f' (v = {v})' if v > 1 else ''}, each rank's actions (lower case: its second chunk):")
    for r, line in enumerate(comm.all_gather_bytes(ops.encode())):
        say(f"  rank {r}: {line.decode()}")
    model = GPT(cfg, seed=0)
    pipeline = Pipeline(model, comm, schedule)
    trace.start(comm)
    losses = pipeline.run(DataParallel(model, comm.split(color=s)), x, y)
    if losses:  # the rank with the last stage holds the losses
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
    for n, q in model.named_parameters():  # this rank's gradients are the single-process ones (wte: embedding + head)
        np.testing.assert_allclose(q.grad, ref_grads[n], rtol=1e-9, atol=1e-13, err_msg=n)
    stats = pipeline.stats
    peaks = [int(h) for h in comm.all_gather(np.array([stats["peak_microbatches_in_flight"]]))]
    bubbles[kind] = stats["bubble"]
    say(f"  bubble {stats['bubble']:.3f} on the logical clock; the paper's closed form {PAPER[kind](v):.3f}; "
        f"microbatch activations held at once per rank: {peaks}")
    assert abs(stats["bubble"] - PAPER[kind](v)) < 1e-12
    expected = {"gpipe": [m] * p, "1f1b": [min(p - r, m) for r in range(p)], "dualpipev": [2 * p + 1] * p}
    assert peaks == expected.get(kind, schedule.simulate().peak_in_flight)
    assert kind != "zb-h1" or max(peaks) <= p
    say(schedule.timeline())
    trace.write(timeline, comm)
if s == 0:
    print(plot.ascii_chart(plot.load_events(timeline), width=96))
say("(wall clock of the DualPipeV run: here 4 ranks share 2 cores and rank 0 also runs the head and the loss)")
assert bubbles["gpipe"] == bubbles["1f1b"] > bubbles["interleaved"] > bubbles["zb-h1"] > bubbles["dualpipev"]
say("GPipe keeps all m microbatches alive before its first backward; 1F1B starts backward as soon as the pipe")
say("is full, so stage s never holds more than p − s: the same bubble, far less memory. Interleaving halves the")
say("ramp by giving each rank two thinner stages; ZB-H1 fills what is left with the deferred weight gradients;")
say("DualPipeV folds two thinner stages per rank into a V and halves ZB-H1's bubble again, for 2p + 1 chunks held.")
if "--plot" in sys.argv and s == 0:  # --plot DIR: each schedule's passes and its bubble, drawn (minipar.figures)
    from minipar.figures import SCHEDULE_FIGURES, draw_schedule

    folder = sys.argv[sys.argv.index("--plot") + 1]
    os.makedirs(folder, exist_ok=True)
    for kind, v in SCHEDULE_FIGURES:
        draw_schedule(build(kind, p, m, v), os.path.join(folder, f"pipeline_{kind}.svg"))
    say(f"drew the schedules into {folder}/")
say("tutorial 6: all invariants hold")
