"""Tutorial 10: choosing the parallel layout from a cost model.

    python tutorials/10_planner.py

1. For a small GPT on 8 A100s: every layout the engine accepts, ranked by predicted step time, and
   where the time goes (compute, pipeline bubble, tensor/pipeline/data communication).
2. GPT-3 175B on 1024 A100s (80 GB) as Megatron-LM ran it in 2021: its layout — TP = 8 inside a node,
   PP = 16, DP = 8, microbatches of 1 — is within a few percent of the planner's best, and its predicted
   throughput is compared with the 138 TFLOP/s per GPU Narayanan et al. (2021) measured.
3. The summary of the validation against 24 published runs.
"""
import dataclasses

from minipar.models.gpt import GPTConfig
from minipar.parallel import planner, validation

a100 = planner.BUILTIN_PROFILES["a100-80gb"]
small = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)  # GPT-2 124M
ranked = planner.plan(small, 8, 64, a100, itemsize=2)
print(f"1. GPT-2 124M, batch 64×1024, bf16, 8 × A100: {len(ranked)} layouts")
print(planner.format_plan(ranked, 6))
best = ranked[0].layout
assert best.tp == 1 and best.pp == 1, "a model this small fits on one GPU: pure data parallelism should win"
print(f"   -> {best}: the whole model fits on each GPU, so splitting it only adds communication")

gpt3 = GPTConfig(**planner.PRESETS["gpt3-175b"])
# As in 2021: Megatron-LM's code (DP all-reduce after backward, unfused attention, its fitted GEMM share), no
# ZeRO, cp or sp, full recomputation, 1F1B.
efficiency = validation.fit(a100, validation.PUBLISHED_RUNS)["Megatron-LM 2021"]
megatron_2021 = dataclasses.replace(a100, **validation.MEGATRON, gemm_efficiency=efficiency)
ranked = [p for p in planner.plan(gpt3, 1024, 1536, megatron_2021, itemsize=2, recompute=("full",), context=False,
                                  schedules=("1f1b",)) if p.layout.zero == 0]
flops = lambda layout: planner.megatron_flops(gpt3, 1536, layout.recompute == "full")  # noqa: E731
print(f"\n2. GPT-3 175B, batch 1536×2048, bf16, 1024 × A100-80GB, as Megatron-LM ran it in 2021: {len(ranked)} "
      f"layouts, {sum(p.feasible for p in ranked)} fit in memory")
print(planner.format_plan(ranked, 5, flops))
megatron = next(p for p in ranked if p.layout == planner.Layout(8, 8, 16, 0, 192, "1f1b", "full"))
predicted = flops(megatron.layout) / megatron.step_time / 1024 / 1e12
assert megatron.step_time <= 1.05 * ranked[0].step_time and abs(predicted - 138) / 138 < 0.10
print(f"   Megatron's layout (dp8·tp8·pp16, microbatch 1): predicted {predicted:.0f} TFLOP/s/GPU vs 138 measured "
      f"({(predicted - 138) / 138:+.0%}), within {megatron.step_time / ranked[0].step_time - 1:.0%} of the best")

print("\n3. Every published run in minipar/parallel/validation.py (python -m minipar plan --validate):")
print(validation.report(a100, loo=False).splitlines()[-1])
print("tutorial 10: all invariants hold")
