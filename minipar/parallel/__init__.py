"""Parallel training techniques, one file each, the communication visible in the code:

    data_parallel      bucketed all-reduce overlapped with backward (DDP)
    zero               ZeRO-1/2/3 (FSDP) and hybrid sharding
    tensor_parallel    Megatron column/row-parallel layers, vocab-parallel head, sequence parallelism
    context_parallel   ring attention (zigzag) and DeepSpeed-Ulysses
    expert_parallel    mixture-of-experts all-to-all dispatch and combine
    schedules          one class per pipeline schedule (GPipe, 1F1B, interleaved, ZB-H1, DualPipeV): placement,
                       per-rank actions, bubble and peak formulas, and the logical-clock simulator
    pipeline           the engine that runs a schedule's actions over point-to-point messages
    layout             every degree and option of a run in one dataclass: the one rule book, and the mesh
    mesh               the (pp, dp, cp, tp) rank grid and its sub-communicators
    compression        fp16/bf16/int8/top-k/PowerSGD gradient compression
    local_sgd          local SGD and DiLoCo
    planner            the cost model and the search over layouts; validation: published runs it is checked on;
                       calibration: this machine measured for it
"""
