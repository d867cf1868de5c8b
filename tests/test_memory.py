"""Peak memory per rank: `train --peak-memory` reports each step's traced peak, and for every ZeRO stage it stays
within 1.25× of the counted model state plus the activations GPT.activation_elements accounts for (a model
whose blocks are small next to its state: 16 blocks; with 4 blocks, ZeRO-3's whole block in hand, the
prefetched one and their gradient buffers are each a quarter of the model — benchmarks/memory.py)."""
import pytest

from minipar.models.gpt import GPTConfig, activation_elements
from minipar.testing import train_cli

L, C, T, B, P = 16, 128, 32, 8, 4


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_peak_within_a_quarter_of_state_plus_activations(zero):
    records, _ = train_cli(["--n-layer", str(L), "--n-embd", str(C), "--block-size", str(T), "--batch-size", str(B),
                            "--steps", "2", "--eval-interval", "0", "--json", "--peak-memory", "--dp", str(P),
                            "--zero", str(zero)], P)
    record = records[-1]
    state = sum(record["model_state_bytes"].values())
    activations = activation_elements(GPTConfig(block_size=T, n_layer=L, n_head=4, n_embd=C), B // P) * 4
    peak = record["peak_bytes"]
    assert peak["rank0"] <= peak["max"]
    assert state + activations <= peak["max"] <= 1.25 * (state + activations), (peak, state, activations)
