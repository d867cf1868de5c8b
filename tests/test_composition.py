"""Layouts nobody wrote a test for: pairs the README's composition table accepts (✓), launched through `train`
with the layout's own flags, equal to one process (float64, 6 steps, losses and final parameters at rtol 1e-9).

The pairs are the table's own (``layout.combine`` over ``layout.OPTIONS``), a fixed sample of the ✓ cells among
the exact options; mixed precision, compression and local SGD change the numbers by design and are tested against
their own bounds elsewhere. The one-process reference routes the same token groups (``--microbatches dp·m``).
"""
import pytest

from minipar.checkpoint import load_checkpoint
from minipar.models import config_from_dict
from minipar.parallel.layout import OPTIONS, TABLE_MODEL, combine
from minipar.testing import assert_same_training, train_cli

INEXACT = ("bf16-mixed", "fp16-mixed", "fp8", "compression", "local SGD")
EXACT = [option for option in OPTIONS if option[0] not in INEXACT]
ACCEPTED = [(a[0], b[0], *pair) for i, a in enumerate(EXACT) for b in EXACT[i + 1:]
            if (pair := combine(a, b)) is not None and pair[0].accepts(config_from_dict({**TABLE_MODEL, **pair[1]}),
                                                                             16 * pair[0].dp)]
SAMPLE = ACCEPTED[::8]  # every eighth of the accepted pairs, in table order


def _model(extra_model):
    cfg = {**TABLE_MODEL, **extra_model}
    flags = ["--n-layer", str(cfg["n_layer"]), "--n-head", str(cfg["n_head"]), "--n-embd", str(cfg["n_embd"]),
             "--block-size", str(cfg["block_size"]), "--steps", "6", "--warmup", "2", "--lr", "3e-3",
             "--dtype", "float64", "--eval-interval", "0", "--json"]
    flags += ["--capacity-factor", "0.5"] if "n_expert" in cfg and "capacity_factor" not in cfg else []
    return flags + [text for name, value in extra_model.items() for text in (f"--{name.replace('_', '-')}", str(value))]


def test_the_sample_spans_the_table():
    assert len(ACCEPTED) >= 80 and len(SAMPLE) >= 9
    assert {name for pair in SAMPLE for name in pair[:2]} >= {"ZeRO-3", "HSDP", "tp", "sp", "cp ring", "pp ZB-H1",
                                                              "pp DualPipeV", "MoE, ep", "recompute full", "MLA",
                                                              "MTP", "MoE dropless, sigmoid"}


@pytest.mark.slow  # about a minute: the fast subset keeps its three
@pytest.mark.parametrize("first,second,layout,model", SAMPLE, ids=[f"{a}+{b}" for a, b, *_ in SAMPLE])
def test_an_accepted_pair_equals_one_process(tmp_path, first, second, layout, model):
    flags, batch = _model(model), ["--batch-size", str(16 * layout.dp)]
    parallel, single = str(tmp_path / "parallel"), str(tmp_path / "single")
    records = train_cli([*flags, *batch, *layout.flags(), "--save", parallel], layout.world, timeout=240)[0]
    reference = train_cli([*flags, *batch, "--microbatches", str(layout.dp * layout.microbatches), "--save", single],
                          1)[0]
    assert_same_training((records, load_checkpoint(parallel).params), (reference, load_checkpoint(single).params))
