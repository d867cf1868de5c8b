"""Tutorial 10: choosing the parallel layout from a cost model.

    python tutorials/10_planner.py

1. For a small GPT on 8 A100s: every layout the engine accepts, ranked by predicted step time, and
   where the time goes (compute, pipeline bubble, tensor/pipeline/data communication).
2. GPT-3 175B on 1024 A100s (80 GB): the planner's first choice is the layout Megatron-LM used,
   TP = 8 inside a node, PP = 16, DP = 8, microbatches of 1; its predicted throughput is compared
   with the 138 TFLOP/s per GPU Narayanan et al. (2021) measured.
"""
from minipar.models.gpt import GPTConfig
from minipar.parallel import planner

a100 = planner.BUILTIN_PROFILES["a100-80gb"]
small = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)  # GPT-2 124M
ranked = planner.plan(small, 8, 64, a100, itemsize=2)
print(f"1. GPT-2 124M, batch 64×1024, bf16, 8 × A100: {len(ranked)} layouts")
print(planner.format_plan(ranked, 6))
best = ranked[0].layout
assert best.tp == 1 and best.pp == 1, "a model this small fits on one GPU: pure data parallelism should win"
print(f"   -> {best}: the whole model fits on each GPU, so splitting it only adds communication")

L, H, C, T, V = planner.PRESETS["gpt3-175b"]
gpt3 = GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C)
ranked = planner.plan(gpt3, 1024, 1536, a100, itemsize=2, recompute=(False, True), context=False,  # as in 2021:
                      schedules=("1f1b",))  # no cp, no sp, no selective recomputation; layouts compared under 1F1B
flops = lambda layout: planner.megatron_flops(gpt3, 1536, layout.recompute_mode == "full")  # noqa: E731
print(f"\n2. GPT-3 175B, batch 1536×2048, bf16, 1024 × A100-80GB: {len(ranked)} layouts, "
      f"{sum(p.feasible for p in ranked)} fit in memory")
print(planner.format_plan(ranked, 5, flops))
choice = ranked[0].layout
assert (choice.dp, choice.tp, choice.pp, choice.microbatches) == (8, 8, 16, 192)
megatron = next(p for p in ranked if p.layout == planner.Layout(8, 8, 16, 0, 192, "1f1b", True))
predicted = flops(megatron.layout) / megatron.step_time / 1024 / 1e12
print(f"   Megatron's layout (dp8·tp8·pp16, microbatch 1, recomputation): predicted {predicted:.0f} TFLOP/s/GPU "
      f"vs 138 measured ({(predicted - 138) / 138:+.0%}). The model's kernels reach 80% of peak and its links "
      f"their nominal bandwidth; Megatron's real ones do not quite.")
print("tutorial 10: all invariants hold")
