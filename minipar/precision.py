"""Number formats and scaling recipes: what FP8 and MX training do to a Linear's numbers.

A low-precision format has few bits of mantissa and a narrow range, so a tensor is multiplied by a scale before
it is rounded (quantized) and divided by it afterwards (dequantized). A recipe says how many scales a tensor gets
and where they come from; an FP8 tensor core then multiplies the quantized operands, accumulates in float32 and
applies the scales. On a CPU the same numbers come from ``ml_dtypes``' casts: quantize → dequantize to float32 →
float32 GEMM equals the tensor core's result up to the order of its float32 accumulation.

Formats (ml_dtypes; u = unit roundoff 2^-(mantissa bits + 1), the relative error of one rounding):

    e4m3   float8_e4m3fn    4 exponent, 3 mantissa bits   max 448      u = 2^-4   no inf (overflow: NaN)
    e5m2   float8_e5m2      5, 2                          max 57344    u = 2^-3   inf
    e8m0   float8_e8m0fnu   powers of two 2^-127…2^127    MX block scales (kept as float32: each is exactly one)
    e2m1   float4_e2m1fn    2, 1                          max 6        u = 2^-2   (MXFP4 / NVFP4 elements)

Recipes (the scale of a group of values is s = max / amax, the group's largest magnitude mapped to the format's
largest finite value; q = cast(clip(x·s, −max, max)), x ≈ q / s):

    tensorwise   one scale per tensor, computed from the tensor as it is (dynamic); e4m3 for inputs and weights,
                 e5m2 for output gradients — torchao's default recipe
    rowwise      one scale per row along each GEMM's contraction dimension, rounded down to a power of two;
                 e4m3 throughout — torchao's "rowwise" recipe
    blockwise    DeepSeek-V3 (§3.3.2): activations and output gradients in 1×128 tiles along the contraction
                 dimension (a token's 128 channels), weights in 128×128 blocks; e4m3 throughout
    mxfp8        OCP Microscaling v1.0: blocks of 32 along the contraction dimension, one e8m0 power of two per
                 block, X = 2^(⌊log₂ amax⌋ − 8) (8 = e4m3's largest exponent), q = cast(clip(x / X)); e4m3

Each Linear's three GEMMs take quantized operands, each scaled along that GEMM's contraction dimension:

    forward   y  = x  · W      x (N, in) along in,    W (in, out) along in
    dgrad     dx = dy · Wᵀ     dy (N, out) along out, W along out
    wgrad     dW = xᵀ · dy     x along N,             dy along N

so rowwise, blockwise and mxfp8 quantize x, W and dy twice each (tensorwise once: one scale serves both axes;
blockwise's 128×128 weight blocks too). The bias, the embedding, the LM head, MoE routers and experts and
attention's softmax and P·V stay in bf16, as torchao and DeepSeek-V3 keep them.

Block sizes default to the recipe's (128; 32) and ``block`` sets another (the tiny models of tests). A partial
last block along a dimension is scaled as zero padding to a whole block would scale it: by the amax of the values
it has (DeepSeek's and torchao's MX reference code require whole blocks; padding with zeros is what their users
do). Non-finite values: amax takes the largest magnitude, so an inf makes its group's scale 0 and a NaN its
scale NaN, and the group dequantizes to NaN — the step's loss or gradient norm is then not finite and training
stops with its one-line error (FP8 has no loss scale to back off). An all-zero group is scaled as if its amax
were 1e-12 (torchao's EPS) and quantizes to zeros. MX's rule maps a block's amax to 256–511·X: what lands past
448 saturates (the spec's clamp), an error below 1/8.

Deep dive, with measurements: docs/precision.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from minipar.autograd import Context, Function, Tensor
from minipar.backend import to_device, to_host


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    type_name: str  # ml_dtypes' numpy type, imported on first use (1 s: every rank of every run would pay it)
    mantissa_bits: int

    @property
    def dtype(self) -> Any:
        import ml_dtypes

        return getattr(ml_dtypes, self.type_name)

    @property
    def max(self) -> float:
        import ml_dtypes

        return float(ml_dtypes.finfo(self.dtype).max)

    @property
    def unit_roundoff(self) -> float:
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def emax(self) -> int:
        """The exponent of the largest power of two in range (OCP MX: emax_elem; 8 for e4m3)."""
        return int(math.floor(math.log2(self.max)))


FORMATS = {f.name: f for f in (Format("e4m3", "float8_e4m3fn", 3), Format("e5m2", "float8_e5m2", 2),
                               Format("e2m1", "float4_e2m1fn", 1))}
EPS = 1e-12  # the smallest amax a scale is computed from (torchao's)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one recipe scales each operand (roles "input", "weight", "grad"), as a small config object."""
    name: str
    block: int            # values per scale along the contraction dimension; 0: the whole row (or tensor)
    per_row: bool         # False: one scale for the whole tensor
    weight_blocks_2d: bool  # weights in block×block squares (DeepSeek-V3) instead of rows of blocks
    grad_format: str      # output gradients' format
    power_of_two: bool    # scales rounded down to a power of two
    mx: bool              # OCP MX: X = 2^(⌊log₂ amax⌋ − emax), stored as e8m0

    @property
    def one_scale(self) -> bool:
        """One scale per tensor: a quantized operand serves the GEMMs of both its axes (tensorwise)."""
        return not self.per_row

    def format(self, role: str) -> Format:
        if role not in ("input", "weight", "grad"):
            raise ValueError(f"unknown role {role!r}: expected 'input', 'weight' or 'grad'")
        return FORMATS[self.grad_format if role == "grad" else "e4m3"]

    def with_block(self, block: int | None) -> Recipe:
        """This recipe with ``block`` values per scale (None: its own); refused for recipes without blocks."""
        if block is None or block == self.block:
            return self
        if not self.block:
            raise ValueError(f"--fp8-block sets a block size: the {self.name} recipe has no blocks")
        if block < 1:
            raise ValueError(f"--fp8-block must be positive, got {block}")
        return dataclasses.replace(self, block=block)


RECIPES = {
    "tensorwise": Recipe("tensorwise", 0, False, False, "e5m2", False, False),
    "rowwise": Recipe("rowwise", 0, True, False, "e4m3", True, False),
    "blockwise": Recipe("blockwise", 128, True, True, "e4m3", False, False),
    "mxfp8": Recipe("mxfp8", 32, True, False, "e4m3", True, True),
}


def recipe(name: str, block: int | None = None) -> Recipe:
    """The recipe called ``name`` (``--fp8-recipe``), with ``block`` values per scale where it has blocks."""
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}: expected one of {', '.join(RECIPES)}")
    return RECIPES[name].with_block(block)


# ------------------------------------------------------------------------------------------------ scales


def _block_shape(shape: tuple[int, int], recipe: Recipe, role: str, axis: int) -> tuple[int, int]:
    """(rows, columns) of the group one scale covers in a 2-D operand scaled along ``axis``."""
    if not recipe.per_row:
        return shape
    along = recipe.block or shape[axis]
    square = role == "weight" and recipe.weight_blocks_2d
    return (along if axis == 0 or square else 1), (along if axis == 1 or square else 1)


def _groups(x: np.ndarray, block_rows: int, block_cols: int) -> np.ndarray:
    """x (2-D, float32) zero-padded to whole blocks and reshaped to (row blocks, block_rows, column blocks,
    block_cols): one scale's group is [i, :, j, :]."""
    rows, cols = x.shape
    padded = np.zeros((-(-rows // block_rows) * block_rows, -(-cols // block_cols) * block_cols), np.float32)
    padded[:rows, :cols] = x
    r, c = padded.shape
    return padded.reshape(r // block_rows, block_rows, c // block_cols, block_cols)


def scales_of(amax: np.ndarray, recipe: Recipe, fmt: Format) -> np.ndarray:
    """The multiplier s of each group from its amax (float32): max/amax in float64, rounded to float32 (torchao's
    amax_to_scale), then rounded down to a power of two for rowwise (exactly: 2^(e−1) for s = m·2^e, m ∈ [½, 1));
    MX: 1/X with X = 2^(⌊log₂ amax⌋ − emax), clamped to e8m0's 2^±127. A non-finite amax gives s = 0 (inf) or
    NaN, so that the group dequantizes to NaN."""
    amax = np.maximum(amax.astype(np.float64), EPS)  # NaN stays NaN
    finite = np.isfinite(amax)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if recipe.mx:
            shared = np.frexp(np.where(finite, amax, 1.0))[1] - 1 - fmt.emax  # ⌊log₂ amax⌋ − emax, exactly
            s = np.ldexp(1.0, -np.clip(shared, -127, 127))
        else:
            s = (fmt.max / amax).astype(np.float32).astype(np.float64)
            if recipe.power_of_two:
                s = np.ldexp(1.0, np.frexp(np.where(finite, s, 1.0))[1] - 1)
        return np.where(finite, s, np.where(np.isnan(amax), np.nan, 0.0)).astype(np.float32)


def quantize(x: Any, recipe: Recipe, role: str, axis: int = -1, reduce_amax: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(q, s): ``x`` (2-D) in the role's format, each group scaled along ``axis`` (the GEMM's contraction
    dimension) by its multiplier s, q = cast(clip(x·s, −max, max)) — ml_dtypes' cast, round to nearest even,
    saturating; s has x's shape with each group's dimension cut to its number of groups (1 for tensorwise).
    ``reduce_amax(role, axis, amax)``: the groups' amax over every rank holding a piece of them
    (:func:`amax_over`), or the local amax as it is."""
    fmt = recipe.format(role)
    x = np.asarray(to_host(x), dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {x.shape}")
    groups = _groups(x, *_block_shape(x.shape, recipe, role, axis % 2))
    amax = np.max(np.abs(groups), axis=(1, 3), keepdims=True)
    if reduce_amax is not None:
        amax = reduce_amax(role, axis % 2, amax)
    s = scales_of(amax, recipe, fmt)
    q = encode(groups, s, fmt).reshape(groups.shape[0] * groups.shape[1], -1)[:x.shape[0], :x.shape[1]]
    return q, s[:, 0, :, 0]


def amax_over(comm: Any, recipe: Recipe, cut: dict[str, int], then: Any = None) -> Any:
    """A ``reduce_amax`` for operands cut over the ranks of ``comm``: a group of values that spans the cut gets its
    amax from every rank — one all-reduce of max (label ``fp8_amax``), of one number per tensor (tensorwise) or per
    row (rowwise) — so every rank scales its piece as one process scales the whole; a group inside the piece stays
    local. ``cut``: role -> the axis along which that operand is cut (a role absent: whole on every rank).
    Tensorwise: every cut operand; rowwise: rows along the cut axis. ``then``: a further such reduction (the
    Linear's own: parallel/tensor_parallel.py cuts features, parallel/context_parallel.py tokens)."""
    def reduce(role: str, axis: int, amax: Any) -> Any:
        along = cut.get(role)
        if along is not None and (not recipe.per_row or axis == along):
            amax = comm.all_reduce(np.ascontiguousarray(amax, dtype=np.float32), op="max", label="fp8_amax")
        return amax if then is None else then(role, axis, amax)
    return reduce


def encode(x: np.ndarray, s: np.ndarray, fmt: Format) -> np.ndarray:
    """cast(clip(x·s, −max, max)) to ``fmt`` (s broadcast against x): ml_dtypes' cast, saturating."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.clip(x * s, -fmt.max, fmt.max).astype(fmt.dtype)


def dequantize(q: np.ndarray, s: np.ndarray, recipe: Recipe, role: str, axis: int = -1) -> np.ndarray:
    """x ≈ q / s in float32: each group's scale expanded over its block (the inverse of :func:`quantize`)."""
    block_rows, block_cols = _block_shape(q.shape, recipe, role, axis % 2)
    expanded = np.repeat(np.repeat(s, block_rows, axis=0), block_cols, axis=1)[:q.shape[0], :q.shape[1]]
    return _decoded(q) / expanded


def _decoded(q: np.ndarray) -> np.ndarray:
    """q in float32, through a table of the format's 256 codes (ml_dtypes' own cast of each): the same values,
    5× faster than casting element by element."""
    table = _TABLES.get(q.dtype)
    if table is None:
        table = _TABLES[q.dtype] = np.arange(256, dtype=np.uint8).view(q.dtype).astype(np.float32)
    return table[q.view(np.uint8)]


_TABLES: dict[Any, np.ndarray] = {}


def fake_quantize(x: Any, recipe: Recipe, role: str, axis: int = -1, reduce_amax: Any = None) -> np.ndarray:
    """x as its GEMM sees it: quantized, then dequantized to float32."""
    return dequantize(*quantize(x, recipe, role, axis, reduce_amax), recipe, role, axis)


# ------------------------------------------------------------------------------------------------ linear


class FP8Linear(Function):
    """y = x W + b with every GEMM on quantized operands (module docstring); W is (in, out).

    What backward keeps of x: tensorwise, whose one scale serves both GEMMs that take x, keeps the forward's FP8
    codes — 1 byte per element instead of bf16's 2, the same codes a requantization would give — and declares x
    unread (autograd.release_unread gives its array back when nothing else reads it); the other recipes scale x
    along another axis for the weight gradient and keep x in bf16 to quantize it again from the one value (torchao
    keeps its high-precision input; DeepSeek-V3 keeps 1×128 FP8 tiles and re-tiles them, a second rounding).
    W is read again in backward and quantized along the other GEMM's axis. Costs what Linear costs, plus a
    quantization pass over each operand per GEMM.
    ``gathered`` (tensorwise only): a function returning W as ZeRO-3 all-gathered it in FP8, (q, s), used in both
    GEMMs that take W instead of quantizing it here — the same codes, since every rank quantized its shard with
    the whole weight's scale (parallel/zero.py); it is asked for again in backward, after the unit's regather.
    ``reduce_amax``: see :func:`amax_over` (tensor and context parallelism's slices).
    """

    @staticmethod
    def forward(ctx: Context, x: Any, w: Any, b: Any, recipe: Recipe, gathered: Any = None,
                reduce_amax: Any = None) -> Any:
        ctx.recipe, ctx.has_bias, ctx.gathered, ctx.reduce_amax = recipe, b is not None, gathered, reduce_amax
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        x_q = quantize(x.reshape(-1, x.shape[-1]), recipe, "input", 1, reduce_amax)
        if recipe.one_scale:
            ctx.x_q, ctx.unread = x_q, (0,)  # the codes, not x (not through save_for_backward: s stays float32)
        out = dequantize(*x_q, recipe, "input", 1) @ _weight(ctx, w, 0)
        if b is not None:
            out += to_host(b)
        return to_device(out.reshape(*x.shape[:-1], out.shape[-1]), dtype=x.dtype)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        w, recipe, reduce = ctx.input(1), ctx.recipe, ctx.reduce_amax
        g2 = g.reshape(-1, g.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = fake_quantize(g2, recipe, "grad", 1, reduce) @ _weight(ctx, w, 1).T
            gx = to_device(gx.reshape(ctx.x_shape), dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            x_t = (dequantize(*ctx.x_q, recipe, "input", 0) if recipe.one_scale else
                   fake_quantize(ctx.input(0).reshape(-1, ctx.x_shape[-1]), recipe, "input", 0, reduce))
            gw = x_t.T @ fake_quantize(g2, recipe, "grad", 0, reduce)
            gw = to_device(gw, dtype=w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(axis=0)
        return gx, gw, gb, None, None, None


def _weight(ctx: Context, w: Any, axis: int) -> np.ndarray:
    """W as a GEMM contracting along ``axis`` sees it: ZeRO-3's FP8-gathered codes, or quantized here."""
    if ctx.gathered is None:
        return fake_quantize(w, ctx.recipe, "weight", axis, ctx.reduce_amax)
    pair = ctx.gathered()
    if pair is None:
        raise RuntimeError("an FP8-gathered weight was used while its ZeRO-3 unit was not gathered")
    return dequantize(*pair, ctx.recipe, "weight", axis)


def linear(x: Tensor, w: Tensor, recipe: Recipe, b: Tensor | None = None, gathered: Any = None,
           reduce_amax: Any = None) -> Tensor:
    """``x · w (+ b)`` with FP8 GEMMs under ``recipe``; w is (in, out), minipar's weight layout; ``gathered`` and
    ``reduce_amax``: see :class:`FP8Linear`."""
    return FP8Linear.apply(x, w, b, recipe, gathered, reduce_amax)
