"""The papers' closed forms, written here apart from the code they check (no minipar imports): a test compares
what minipar measures or simulates with these, never with minipar's own formula for the same thing."""
import math


def pipeline_bubble(kind: str, p: int, m: int, v: int = 1) -> float:
    """Idle share of a pipeline step's makespan, p stages, m microbatches, v chunks per rank, backward = 2 forwards.

    GPipe (Huang et al. 2019, §2.2) and 1F1B (Narayanan et al. 2021, §2.2.1): (p−1)/(m+p−1).
    Interleaved 1F1B (Narayanan et al. 2021, §2.2.2): the bubble shrinks by v: (p−1)/(v·m+p−1).
    ZB-H1 (Qi et al. 2024, §3, F = B = W and m ≥ p): 1F1B's p−1 idle passes of 3 units become p−1 units,
    over 3m units of work: (p−1)/(3m+p−1).
    DualPipeV (DeepSeek-V3 technical report, 2024, Table 2): (PP/2 − 1)(F&B + B − 3W) idle on PP/2 ranks.
    """
    if kind in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if kind == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if kind == "zb-h1":
        if m < p:
            raise ValueError("the ZB-H1 closed form holds for m >= p")
        return (p - 1) / (3 * m + p - 1)
    if kind == "dualpipev":  # DeepSeek-V3 (2024) §3.2.1, Table 2: idle (PP/2 − 1)(F&B + B − 3W) over PP/2 = p ranks
        chunk = 0.5               # two chunks per rank: a chunk's F = B = W is half a stage's unit
        overlapped = 3 * chunk    # F&B: a chunk's forward and whole backward, here not overlapped (F + B + W)
        idle = (p - 1) * (overlapped + chunk - 3 * chunk)
        return idle / (3 * m + idle)  # a rank's work per step: m microbatches × 2 chunks × (F + B + W)
    raise ValueError(kind)


def all_reduce_bytes(algorithm: str, n: int, p: int, itemsize: int) -> int:
    """Bytes one rank sends in an all-reduce of n elements over p ranks (Thakur, Rabenseifner & Gropp 2005, §4),
    for n divisible by p (and p a power of two where the algorithm halves or doubles):
    ring and Rabenseifner (reduce-scatter + all-gather) 2(p−1)/p·n, recursive doubling log2(p)·n."""
    if n % p:
        raise ValueError("these closed forms are for n divisible by p")
    if algorithm in ("ring", "rabenseifner"):
        return 2 * (p - 1) * (n // p) * itemsize
    if algorithm == "recursive_doubling" and p & (p - 1) == 0:
        return (p.bit_length() - 1) * n * itemsize
    raise ValueError(f"no closed form here for {algorithm} on p = {p}")


def expert_capacity(factor: float, k: int, tokens: int, experts: int) -> int:
    """Places per expert for a routing group of N tokens choosing k of E experts each (GShard, Lepikhin et al. 2020,
    §2.2; Switch Transformer, Fedus et al. 2021, eq. 3): ⌈c·k·N/E⌉, rounded up so that c = 1 holds an even
    split's every assignment, and at least one."""
    return max(1, math.ceil(factor * k * tokens / experts))
