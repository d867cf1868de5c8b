"""FP8 and MX numerics (minipar/precision.py) against independent references: the formats' parameters from their
bit layouts; every recipe's quantization bit for bit against ml_dtypes' casts of a loop-by-loop reference of the
recipe (torchao's scale formula, DeepSeek-V3's tiles and blocks, the OCP MX scale rule); non-finite values, zero
and partial groups; each of a Linear's three GEMMs against a float64 emulation within float32 accumulation error;
and why fine-grained scaling exists: one outlier row costs tensorwise scaling the other rows' precision."""
import math
import sys

import ml_dtypes
import numpy as np
import pytest

from minipar import precision
from minipar.autograd import Tensor
from minipar.testing import run_command, run_ranks, train_cli

# (largest finite value from the bit layout, mantissa bits): e4m3fn's largest is S.1111.110 = 1.75·2^8 (1111.111
# is its NaN), e5m2's S.11110.11 = 1.75·2^15, e2m1's S.11.1 = 1.5·2^2
LAYOUTS = {"e4m3": (1.75 * 2**8, 3), "e5m2": (1.75 * 2**15, 2), "e2m1": (1.5 * 2**2, 1)}
DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn}


def test_formats_from_their_bit_layouts():
    for name, (largest, mantissa) in LAYOUTS.items():
        fmt = precision.FORMATS[name]
        assert fmt.max == largest and fmt.unit_roundoff == 2.0 ** -(mantissa + 1)
    assert precision.FORMATS["e4m3"].emax == 8  # OCP MX v1.0 Table 1: emax_elem of FP8 E4M3
    # the published block sizes: DeepSeek-V3's 1×128 tiles and 128×128 blocks (§3.3.2), OCP MX's k = 32
    assert precision.recipe("blockwise").block == 128 and precision.recipe("mxfp8").block == 32


def _reference_quantize(x, recipe, role, axis):
    """The recipe written out group by group, in Python loops: which elements share a scale, the scale from the
    group's amax (torchao's max/amax in float64 rounded to float32, rounded down to a power of two by frexp for
    rowwise; OCP MX: X = 2^(⌊log₂ amax⌋ − 8) for e4m3), and ml_dtypes' cast of the saturated scaled values."""
    fmt = "e5m2" if role == "grad" and recipe.grad_format == "e5m2" else "e4m3"
    largest = LAYOUTS[fmt][0]
    rows, cols = x.shape
    if recipe.name == "tensorwise":
        size = (rows, cols)
    elif recipe.name == "blockwise" and role == "weight":
        size = (recipe.block, recipe.block)        # DeepSeek-V3: 128×128 weight blocks
    else:
        along = recipe.block or x.shape[axis]      # rowwise: the whole row; blockwise 1×128; MX 32
        size = (along, 1) if axis == 0 else (1, along)
    q = np.zeros(x.shape, DTYPES[fmt])
    scales = np.zeros((-(-rows // size[0]), -(-cols // size[1])), np.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = x[i * size[0]:(i + 1) * size[0], j * size[1]:(j + 1) * size[1]].astype(np.float32)
            amax = max(float(np.max(np.abs(block))), 1e-12)
            if recipe.mx:
                s = 2.0 ** -(math.frexp(amax)[1] - 1 - 8)
            else:
                s = float(np.float32(largest / amax))
                if recipe.power_of_two:
                    s = 2.0 ** (math.frexp(s)[1] - 1)
            scales[i, j] = s
            scaled = np.clip(block * np.float32(s), -largest, largest)
            q[i * size[0]:(i + 1) * size[0], j * size[1]:(j + 1) * size[1]] = scaled.astype(DTYPES[fmt])
    return q, scales


CASES = [(name, block) for name, block in (("tensorwise", None), ("rowwise", None), ("blockwise", 16), ("blockwise", 128),
                                            ("mxfp8", 32), ("mxfp8", 8))]


@pytest.mark.parametrize("name,block", CASES)
@pytest.mark.parametrize("role", ["input", "weight", "grad"])
def test_quantize_is_the_recipe_bit_for_bit(name, block, role):
    """Every role along both axes, on values spanning 2^±20 with an outlier row and column, partial last blocks
    (37 × 50), exact ties of the format (RNE) and values past the format's range (saturated)."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((37, 50)) * 2.0 ** rng.integers(-20, 20, (37, 50))).astype(np.float32)
    x[5] *= 1e4
    x[:, 9] *= 1e-3
    recipe = precision.recipe(name, block)
    for axis in (0, 1):
        q, s = precision.quantize(x, recipe, role, axis)
        want_q, want_s = _reference_quantize(x, recipe, role, axis)
        assert q.dtype == want_q.dtype and s.dtype == np.float32
        assert np.array_equal(s, want_s), (axis, s, want_s)
        if recipe.mx:  # every block's X = 1/s is an e8m0 value exactly
            assert ((1 / s).astype(ml_dtypes.float8_e8m0fnu).astype(np.float32) == 1 / s).all()
        assert q.tobytes() == want_q.tobytes(), axis
        back = precision.dequantize(q, s, recipe, role, axis)
        expanded = want_q.astype(np.float64) / np.kron(want_s, np.ones(_size(recipe, role, axis, x.shape)))[:37, :50]
        assert np.array_equal(back, expanded.astype(np.float32))


def _size(recipe, role, axis, shape):
    if recipe.name == "tensorwise":
        return shape
    if recipe.name == "blockwise" and role == "weight":
        return (recipe.block, recipe.block)
    along = recipe.block or shape[axis]
    return (along, 1) if axis == 0 else (1, along)


def test_saturation_ties_and_the_scale_rules():
    e4m3 = precision.recipe("tensorwise")
    q, s = precision.quantize(np.array([[3.0, -7.0, 0.5]], np.float32), e4m3, "input")
    assert s[0, 0] == np.float32(448 / 7) and q.astype(np.float32)[0, 1] == -448.0  # amax lands on the largest value
    # MX: X = 2^(⌊log₂ amax⌋ − 8): amax 300 and 500 both give X = 1 (2^8 ≤ amax < 2^9), 1000 gives X = 2; past
    # 448 the spec's clamp saturates (500 → 448); e4m3's spacing above 256 is 32, so 300 rounds to 288
    mx = precision.recipe("mxfp8", 2)
    q, s = precision.quantize(np.array([[300.0, 1.0, 500.0, 3.0, 1000.0, 6.0]], np.float32), mx, "input")
    assert s.tolist() == [[1.0, 1.0, 0.5]]
    shared = (1 / s).astype(ml_dtypes.float8_e8m0fnu)  # X, stored as the spec's e8m0, exactly
    assert (shared.astype(np.float32) == 1 / s).all()
    assert q.astype(np.float32).tolist() == [[288.0, 1.0, 448.0, 3.0, 448.0, 3.0]]
    # rowwise rounds the scale down to a power of two: 448/3 = 149.33 → 128
    q, s = precision.quantize(np.array([[3.0, 1.0]], np.float32), precision.recipe("rowwise"), "input")
    assert s.tolist() == [[128.0]] and q.astype(np.float32).tolist() == [[384.0, 128.0]]
    # a value past the largest after scaling saturates (MX: amax/X can reach 511.9 > 448)
    q, _ = precision.quantize(np.array([[511.0, 0.0]], np.float32), mx, "input")
    assert q.astype(np.float32).tolist() == [[448.0, 0.0]]


@pytest.mark.parametrize("name", list(precision.RECIPES))
def test_non_finite_zero_and_partial_groups(name):
    """An inf or NaN makes its group dequantize to NaN (and only its group, where groups are smaller than the
    tensor); an all-zero group quantizes to zeros; a partial last block is scaled by the amax of what it holds."""
    recipe = precision.recipe(name, 4 if precision.RECIPES[name].block else None)
    x = np.ones((3, 6), np.float32)
    x[0, 0], x[1, 5], x[2] = np.inf, np.nan, 0.0
    with np.errstate(invalid="ignore"):
        back = precision.fake_quantize(x, recipe, "input", 1)
    assert np.isnan(back[0, 0]) and np.isnan(back[1, 5])
    if recipe.per_row:
        assert (back[2] == 0).all()
        assert np.isnan(back[0, :4]).all() and (back[0, 4:] == 1).all() if recipe.block else np.isnan(back[0]).all()
    else:
        assert np.isnan(back).all()
    if recipe.block:  # the last block along the row holds 2 values (6 = 4 + 2): its scale is theirs
        _, s = precision.quantize(np.array([[1.0, 1.0, 1.0, 1.0, 2.0, 0.25]], np.float32), recipe, "input", 1)
        assert s[0, 1] == _reference_quantize(np.array([[2.0, 0.25]], np.float32), recipe, "input", 1)[1][0, 0]


def test_bad_recipes_are_refused_in_one_line():
    for call, message in ((lambda: precision.recipe("fp4"), "unknown FP8 recipe 'fp4': expected one of tensorwise"),
                          (lambda: precision.recipe("tensorwise", 16), "the tensorwise recipe has no blocks"),
                          (lambda: precision.recipe("mxfp8", 0), "--fp8-block must be positive"),
                          (lambda: precision.RECIPES["rowwise"].format("bias"), "unknown role 'bias'")):
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.parametrize("name,block", CASES)
def test_each_gemm_is_the_float64_emulation_of_the_recipe(name, block):
    """Forward y = x·W, input gradient dy·Wᵀ and weight gradient xᵀ·dy from operands quantized by the reference
    along each GEMM's contraction dimension, multiplied in float64: equal up to float32 accumulation,
    |error| ≤ γ_K·(|A|·|B|) + u·|result| with γ_K = K·u/(1 − K·u), u = 2^-24 (Higham, Thm 3.5; then one rounding)."""
    rng = np.random.default_rng(3)
    N, n_in, n_out = 40, 48, 36
    x, w = rng.standard_normal((N, n_in)), rng.standard_normal((n_in, n_out)) * 0.1
    x[3] *= 50
    g = rng.standard_normal((N, n_out)) * 1e-3
    recipe = precision.recipe(name, block)
    xt, wt = Tensor(x.astype(np.float32), requires_grad=True), Tensor(w.astype(np.float32), requires_grad=True)
    y = precision.linear(xt, wt, recipe)
    y.backward(g.astype(np.float32))

    def deq(a, role, axis):
        q, s = _reference_quantize(a.astype(np.float32), recipe, role, axis)
        return q.astype(np.float64) / np.kron(s, np.ones(_size(recipe, role, axis, a.shape)))[:a.shape[0], :a.shape[1]]

    u = 2.0**-24
    for got, (a, b) in ((y.data, (deq(x, "input", 1), deq(w, "weight", 0))),
                        (xt.grad, (deq(g, "grad", 1), deq(w, "weight", 1).T)),
                        (wt.grad, (deq(x, "input", 0).T, deq(g, "grad", 0)))):
        k = a.shape[1]
        exact = a @ b
        bound = k * u / (1 - k * u) * (np.abs(a) @ np.abs(b)) + u * np.abs(exact)
        assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)


def test_one_outlier_row_costs_tensorwise_the_other_rows():
    """Rows of N(0, 1) and one row 10^5 larger: one scale for the tensor puts the ordinary rows at 448·10^-5 of
    e4m3's range — among its subnormals (below 2^-6), spaced 2^-9 — so their error is a large share of their
    magnitude; a scale per row (rowwise), per 1×16 tile (blockwise) or per 16 values (MX) keeps each ordinary row
    within e4m3's unit roundoff of its largest value (u = 2^-4; the power-of-two scales of rowwise and MX put the
    largest value in [224, 448], still normal). MX within 2u: its scale rule puts a block's amax at 256-511·X, and the
    spec's clamp saturates what lands past 448, an error below 1/8 = 2u. Measured: tensorwise 2.4-5u, MX 0.5-1.4u."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    x[7] *= 1e5
    ordinary = np.arange(16) != 7
    u = precision.FORMATS["e4m3"].unit_roundoff
    for name, block in (("tensorwise", None), ("rowwise", None), ("blockwise", 16), ("mxfp8", 16)):
        back = precision.fake_quantize(x, precision.recipe(name, block), "input", 1)
        error = np.abs(back - x)[ordinary].max(axis=1) / np.abs(x[ordinary]).max(axis=1)
        if name == "tensorwise":
            assert error.min() > 2 * u, error  # over twice the unit roundoff on every ordinary row
        else:
            assert error.max() <= (2 * u if name == "mxfp8" else u), (name, error)


# ------------------------------------------------------------------------------------------------ training

FP8_MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "8",
             "--steps", "6", "--eval-interval", "0", "--json", "--precision", "fp8"]


@pytest.fixture(scope="module")
def fp8_one_process():
    runs = {}

    def run(recipe_flags, microbatches):
        key = (tuple(recipe_flags), microbatches)
        if key not in runs:
            runs[key] = train_cli([*FP8_MODEL, *recipe_flags, "--microbatches", str(microbatches)], 1)[0]
        return runs[key]
    return run


@pytest.mark.parametrize("recipe_flags,ranks,layout,rtol", [
    (["--fp8-recipe", "tensorwise"], 2, ["--dp", "2"], 0.0),
    (["--fp8-recipe", "tensorwise"], 2, ["--dp", "2", "--zero", "3"], 0.0),
    (["--fp8-recipe", "tensorwise"], 4, ["--dp", "4", "--zero", "3", "--shard-group", "2"], 2.0**-8),
    (["--fp8-recipe", "rowwise"], 2, ["--dp", "2", "--zero", "1"], 0.0),
    (["--fp8-recipe", "blockwise", "--fp8-block", "16"], 2, ["--dp", "2", "--zero", "3"], 0.0),
    (["--fp8-recipe", "mxfp8", "--fp8-block", "8"], 2, ["--dp", "2", "--zero", "2"], 0.0),
    (["--fp8-recipe", "blockwise", "--fp8-block", "16"], 2, ["--pp", "2", "--microbatches", "2"], 2.0**-8),
    (["--fp8-recipe", "mxfp8", "--fp8-block", "8"], 4, ["--dp", "4"], 2.0**-8),
    (["--fp8-recipe", "tensorwise"], 2, ["--tp", "2"], 2.0**-8),
    (["--fp8-recipe", "rowwise"], 2, ["--tp", "2", "--sp"], 2.0**-8),
    (["--fp8-recipe", "tensorwise"], 4, ["--dp", "2", "--tp", "2", "--zero", "1"], 2.0**-8),
    (["--fp8-recipe", "tensorwise"], 2, ["--cp", "2"], 2.0**-8),
    # an odd degree: three ranks, ZeRO-3's shards (and tensorwise's FP8 pieces) of uneven sizes
    (["--fp8-recipe", "tensorwise", "--batch-size", "12"], 3, ["--dp", "3", "--zero", "3"], 2.0**-8),
    (["--fp8-recipe", "rowwise", "--batch-size", "12"], 3, ["--dp", "3", "--zero", "1"], 2.0**-8),
    (["--fp8-recipe", "rowwise"], 2, ["--cp", "2", "--cp-kind", "ulysses"], 2.0**-8),
])
def test_fp8_layouts_equal_the_one_process_run(fp8_one_process, recipe_flags, ranks, layout, rtol):
    """The reference is one process whose microbatches are each data-parallel rank's rows: a weight's scales are
    the whole weight's (ZeRO-3 gathers it before its forward — in FP8 under tensorwise, each rank encoding its
    shard with the whole weight's scale), an activation's are its own microbatch's, so every
    GEMM sees the same quantized operands — the first step's loss is the same number. dp 2 stays bit-identical
    (the sum of two bf16 gradients does not depend on their order); a pipeline adds the tied embedding's two
    gradients, and 3 or 4 ranks' ring theirs, in another order in bfloat16: within one bf16 unit roundoff, 2^-8.
    Under tp a scale whose group spans the slices takes its amax over the ranks (precision-checked in
    test_tensor_parallel_fp8_scales_span_the_slices), but the row-parallel sum adds the ranks' partial products in
    another order, its bf16 output differs by an ulp here and there and the next quantization may round that to
    another e4m3 step: the first step too within 2^-8 (measured 5e-5). Under cp the scales across tokens take
    their amax over the cp ranks (test_context_parallel_fp8_scales_span_the_tokens); attention adds its blocks in
    another order: within 2^-8."""
    dp = int(layout[layout.index("--dp") + 1]) if "--dp" in layout else 1
    microbatches = int(layout[layout.index("--microbatches") + 1]) if "--microbatches" in layout else 1
    reference = fp8_one_process(recipe_flags, dp * microbatches)
    records, _ = train_cli([*FP8_MODEL, *recipe_flags, *layout], ranks)
    losses, want = [r["loss"] for r in records], [r["loss"] for r in reference]
    assert losses[0] == want[0] or "--tp" in layout or "--cp" in layout
    np.testing.assert_allclose(losses, want, rtol=rtol, atol=0)


@pytest.mark.slow  # the fast subset has the bit-identical dp 2 run; these two count the bytes
@pytest.mark.parametrize("ranks,layout", [(2, ["--dp", "2", "--zero", "3"]),
                                          (4, ["--dp", "4", "--zero", "3", "--microbatches", "2"])])
def test_zero3_gathers_fp8_weights_in_fp8(ranks, layout):
    """FP8 on the wire: under tensorwise ZeRO-3 every block Linear's weight travels as e4m3 codes, 1 byte per
    element instead of bf16's 2, plus one float32 amax per weight (an all-reduce of max per block unit and gather).
    A rank sends (p−1)/p·(Ψ_fp8·1 + Ψ_rest·2) bytes per gather (ring; every shard's size divides by p = 2 and 4 here,
    so rank 0's share is the mean) and 2(p−1)/p·4 values·4 bytes per block amax all-reduce (ring, 4 weights); a unit
    is gathered in each microbatch's forward and backward. Ψ_fp8 and Ψ_rest are counted from the model's arrays."""
    from minipar.models.gpt import GPT, GPTConfig

    m = int(layout[layout.index("--microbatches") + 1]) if "--microbatches" in layout else 1
    model = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", str(6 * ranks),
             "--steps", "2", "--eval-interval", "0", "--json", "--precision", "fp8"]
    gpt = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32))
    fp8 = sum(p.size for name, p in gpt.named_parameters() if name.startswith("transformer.h.") and
              name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")))
    rest = gpt.num_parameters() - fp8
    assert fp8 == 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32)  # 2 blocks: c_attn, attn.c_proj, c_fc, mlp.c_proj
    records, _ = train_cli([*model, *layout], ranks)
    sent = records[-1]["comm_bytes_by_op"]
    assert sent["params"] == 2 * m * (ranks - 1) // ranks * (fp8 * 1 + rest * 2)  # half of bf16's for the weights
    assert sent["fp8_amax"] == 2 * m * 2 * (2 * (ranks - 1) * (4 // ranks) * 4)  # 2 blocks' amax all-reduces


@pytest.mark.parametrize("flags,message", [
    (["--precision", "fp8", "--tp", "2", "--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8 with --tp or --cp: its blocks"),
    (["--precision", "fp8", "--cp", "2", "--fp8-recipe", "blockwise"], "--fp8-recipe blockwise with --tp or --cp"),
    (["--precision", "fp8", "--tp", "2", "--arch", "llama", "--n-kv-head", "1"], "--tp 2 > --n-kv-head 1"),
    (["--fp8-recipe", "rowwise"], "--fp8-recipe has no effect here: it needs --precision fp8"),
    (["--precision", "fp8", "--fp8-block", "16"], "--fp8-block sets a block size: the tensorwise recipe has no blocks"),
    (["--precision", "fp8", "--fp8-recipe", "mxfp8", "--fp8-block", "0"], "--fp8-block must be positive"),
])
def test_bad_fp8_flags_are_refused_in_one_line(flags, message):
    with pytest.raises(AssertionError) as err:
        run_command(2, [sys.executable, "-m", "minipar", "train", *FP8_MODEL[:-2], *flags], timeout=60)
    assert str(err.value).count(message) == 1 and "exit 2" in str(err.value) and "Traceback" not in str(err.value)


@pytest.mark.slow  # importing torch: 3 s (the fast subset keeps the float64 emulation)
@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_tensorwise_and_rowwise_are_torchaos_float8_training(name):
    """torchao's Float8Linear with its recipe of that name, emulate=True (dequantize, float32 mm: its CPU path), on
    the same x, W, dy: output, input gradient and weight gradient each within twice float32's accumulation error
    of minipar's — two float32 sums of the same quantized products in different orders, 2·γ_K·(|A|·|B|) with A, B
    minipar's dequantized operands. A scale that differed would move whole e4m3 steps (2^-4 relative), far past it."""
    torch = pytest.importorskip("torch", reason='the FP8 oracle needs `pip install -e ".[hf]"` (torch, torchao)')
    float8 = pytest.importorskip("torchao.float8", reason='the FP8 oracle needs `pip install -e ".[hf]"` (torchao)')
    import dataclasses

    rng = np.random.default_rng(0)
    N, n_in, n_out = 64, 48, 32
    x = rng.standard_normal((N, n_in)).astype(np.float32)
    x[3] *= 50
    w = (rng.standard_normal((n_in, n_out)) * 0.1).astype(np.float32)
    g = (rng.standard_normal((N, n_out)) * 1e-3).astype(np.float32)
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(name), emulate=True)
    layer = torch.nn.Sequential(torch.nn.Linear(n_in, n_out, bias=False))
    with torch.no_grad():
        layer[0].weight.copy_(torch.from_numpy(w.T.copy()))  # torch's (out, in)
    float8.convert_to_float8_training(layer, config=config)
    assert type(layer[0]).__name__ == "Float8Linear"
    xt = torch.from_numpy(x.copy()).requires_grad_()
    out = layer(xt)
    out.backward(torch.from_numpy(g))
    recipe = precision.recipe(name)
    a, b = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    mine = precision.linear(a, b, recipe)
    mine.backward(g)
    fq = precision.fake_quantize
    u = 2.0**-24
    for theirs, ours, (left, right) in (
            (out.detach().numpy(), mine.data, (fq(x, recipe, "input", 1), fq(w, recipe, "weight", 0))),
            (xt.grad.numpy(), a.grad, (fq(g, recipe, "grad", 1), fq(w, recipe, "weight", 1).T)),
            (layer[0].weight.grad.numpy().T, b.grad, (fq(x, recipe, "input", 0).T, fq(g, recipe, "grad", 0)))):
        k = left.shape[1]
        bound = 2 * k * u / (1 - k * u) * (np.abs(left).astype(np.float64) @ np.abs(right))
        assert np.all(np.abs(theirs.astype(np.float64) - ours) <= bound), np.max(np.abs(theirs - ours) / bound)


def _tensor_parallel_fp8(name):
    """A column-parallel then a row-parallel FP8 Linear (Megatron's MLP without its GELU) over the tp ranks against
    the same two FP8 Linears on one process: every scale whose group spans the slices takes its amax over the
    ranks, so each rank quantizes its slice with the one process's scales. The column outputs are the one process's
    (each column's dot products alike); the row-parallel sum adds the ranks' partial products in another order:
    float32 accumulation error, γ_K·(|A|·|B|); so do the gradients, whose products numpy blocks otherwise."""
    from minipar.comm import Communicator
    from minipar.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    comm = Communicator()
    tp, r = comm.size, comm.rank
    rng = np.random.default_rng(5)
    N, C, H = 24, 16, 64
    x = rng.standard_normal((N, C)).astype(np.float32)
    x[2] *= 30
    w1 = (rng.standard_normal((C, H)) * 0.2).astype(np.float32)
    w2 = (rng.standard_normal((H, C)) * 0.2).astype(np.float32)
    # an outlier column (rank 0's) and row (rank 1's) that local scales would miss: 10^4 puts the other values of
    # their rows among e4m3's subnormals, where even rowwise's power-of-two scales round differently
    w1[:, 5] *= 1e4
    w2[H - 3] *= 1e4
    g = (rng.standard_normal((N, C)) * 1e-2).astype(np.float32)
    recipe = precision.recipe(name)
    xs, a, b = Tensor(x, requires_grad=True), Tensor(w1, requires_grad=True), Tensor(w2, requires_grad=True)
    y_ref = precision.linear(precision.linear(xs, a, recipe), b, recipe)
    y_ref.backward(g)
    cols = slice(r * H // tp, (r + 1) * H // tp)
    column, row = ColumnParallelLinear(w1[:, cols].copy(), None, comm), RowParallelLinear(w2[cols].copy(), None, comm)
    column.fp8 = row.fp8 = recipe
    xt = Tensor(x, requires_grad=True)
    y = row(column(xt))
    y.backward(g)
    u = 2.0**-24
    h = precision.fake_quantize(precision.linear(Tensor(x), Tensor(w1), recipe).data, recipe, "input", 1)
    bound = H * u / (1 - H * u) * (np.abs(h) @ np.abs(precision.fake_quantize(w2, recipe, "weight", 0)))
    assert np.all(np.abs(y.data - y_ref.data) <= bound + 1e-30), np.max(np.abs(y.data - y_ref.data) / bound)
    # the same quantized operands, multiplied in blocks of another shape (float32 accumulation, K = N or H terms);
    # one wrong scale would move whole e4m3 steps (2^-4)
    for got, want, k in ((column.weight.grad, a.grad[:, cols], N), (row.weight.grad, b.grad[cols], N), (xt.grad, xs.grad, H)):
        np.testing.assert_allclose(got, want, rtol=0, atol=np.abs(want).max() * 2 * k * u)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_tensor_parallel_fp8_scales_span_the_slices(name):
    run_ranks(2, _tensor_parallel_fp8, name)


def _context_parallel_fp8(name):
    """An FP8 Linear on each cp rank's tokens (half of every sequence) against one process on all of them: the
    activations' and output gradients' scales across tokens take their amax over the ranks (token_amax), so every
    rank quantizes its tokens as one process does; outputs per token and the weight gradient summed over the ranks
    within float32 accumulation error. Rank 1's tokens hold an outlier 10^4 larger than the rest."""
    from mpi4py import MPI

    from minipar.comm import Communicator
    from minipar.parallel.context_parallel import token_amax

    comm = Communicator()
    r = comm.rank
    rng = np.random.default_rng(9)
    N, C, H = 32, 16, 24
    x, g = rng.standard_normal((N, C)).astype(np.float32), (rng.standard_normal((N, H)) * 1e-2).astype(np.float32)
    x[N - 3, 4] *= 1e4
    g[N - 5] *= 1e4
    w = (rng.standard_normal((C, H)) * 0.2).astype(np.float32)
    recipe = precision.recipe(name)
    xs, ws = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    y_ref = precision.linear(xs, ws, recipe)
    y_ref.backward(g)
    mine = slice(r * N // comm.size, (r + 1) * N // comm.size)
    xt, wt = Tensor(x[mine].copy(), requires_grad=True), Tensor(w, requires_grad=True)
    y = precision.linear(xt, wt, recipe, reduce_amax=token_amax(comm, recipe))
    y.backward(g[mine])
    total = np.empty_like(wt.grad)
    comm.mpi.Allreduce(wt.grad, total, op=MPI.SUM)
    u = 2.0**-24
    for got, want, k in ((y.data, y_ref.data[mine], C), (xt.grad, xs.grad[mine], H), (total, ws.grad, N)):
        np.testing.assert_allclose(got, want, rtol=0, atol=np.abs(want).max() * 2 * k * u)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_context_parallel_fp8_scales_span_the_tokens(name):
    run_ranks(2, _context_parallel_fp8, name)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_tensorwise_keeps_fp8_codes_of_the_linear_inputs(arch):
    """What one forward keeps, traced: under tensorwise every block Linear keeps its input's FP8 codes (1 byte) and
    its bf16 input is given back — per block and token ln_1's and ln_2's outputs and the attention output (h each)
    and the MLP's hidden activation (GPT: GELU's 4h; Llama: the SwiGLU product, I) — so bf16 − fp8 = L·s·b·(3h + I)
    bytes; rowwise quantizes x again along the tokens for the weight gradient and keeps it in bf16: no saving.
    Tolerance: the Python headers of each Linear's codes and scale (~0.7 KB per Linear)."""
    import tracemalloc

    from minipar.models import config_from_dict, build_model

    L, T, B, C, inner = 2, 64, 3, 64, (4 * 64 if arch == "gpt2" else 96)
    cfg = config_from_dict(dict(arch=arch, vocab_size=256, block_size=T, n_layer=L, n_head=4, n_embd=C,
                                dtype="bfloat16", **({"n_inner": inner} if arch == "llama" else {})))
    x = np.random.default_rng(0).integers(0, 256, (B, T))

    def kept(recipe):
        model = build_model(cfg)
        if recipe:
            model.set_fp8(precision.recipe(recipe))
        model(x, x)[1].backward()  # first-use caches out of the way
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            _, loss = model(x, x)
            return tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()

    bf16, tensorwise, rowwise = kept(None), kept("tensorwise"), kept("rowwise")
    assert bf16 - tensorwise == pytest.approx(L * T * B * (3 * C + inner), abs=4 * L * 1024)
    assert abs(bf16 - rowwise) < 4 * L * 1024
