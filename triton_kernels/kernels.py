"""Triton kernels for the copies around FSDP's collectives.

Every kernel works on a *chunked layout*: a packed ``[world, row_numel]`` buffer in
which rank ``r``'s row holds, per parameter ``p``, a segment of ``seg_p`` elements
starting at column ``col_p``. Element ``k`` of segment ``(r, p)`` corresponds to the
unsharded (flat, contiguous) element ``idx = (o * world + r) * chunk_p + rem`` with
``o, rem = divmod(k, chunk_p)``, and is padding when ``idx >= numel_p``. This one
formula covers the all-gather copy-in (``world = 1``), ``Shard(0)`` (one chunk row of
``chunk_p = seg_p`` elements: dim-0 padding) and ``Shard(d > 0)`` (``outer`` rows of
``chunk_p = size(d) / world * inner`` elements: chunk-cat).

Per-parameter metadata is an int64 ``[P, PARAM_COLS]`` table of
:class:`triton_kernels.fields.ParamRow` rows; the 1-D grid (times
``world`` on axis 1) walks a precomputed ``[nblocks, 2]`` int32 table of
``(param, first element)`` pairs, so a block never spans two parameters.

Casts are exact round-to-nearest-even. With ``MANUAL_CASTS`` (the CPU interpreter,
whose float conversions truncate) they are done on the bits by hand; otherwise the
hardware conversions run, which are the ones torch's CUDA kernels use. Division by
the pre-divide factor follows torch's device rule: CUDA multiplies by the fp32
reciprocal, CPU divides.

This file is loaded once per Triton mode (compiled and interpreted) by
:mod:`triton_kernels.loader`; import it only through there. For that to work in a
process whose ``triton`` was imported in the other mode, the kernels call only Triton
builtins and functions of this file, never ``triton.language.standard``'s
``@jit`` functions (``tl.zeros``, ``tl.cdiv``, ...).
"""

import triton
import triton.language as tl

from triton_kernels import fields

# fields' names as constexprs, the only globals a @triton.jit function may read.
PARAM_COLS = tl.constexpr(fields.PARAM_COLS)
COL_OFFSET = tl.constexpr(fields.COL["col_offset"])
SEG_NUMEL = tl.constexpr(fields.COL["seg_numel"])
CHUNK_NUMEL = tl.constexpr(fields.COL["chunk_numel"])
NUMEL = tl.constexpr(fields.COL["numel"])
OUT_OFFSET = tl.constexpr(fields.COL["out_offset"])
SRC_KIND = tl.constexpr(fields.COL["src_kind"])
GAP = tl.constexpr(fields.COL["gap"])
KIND_F32 = tl.constexpr(fields.KIND_F32)
KIND_BF16 = tl.constexpr(fields.KIND_BF16)
KIND_F16 = tl.constexpr(fields.KIND_F16)
SCALE_DIVIDE = tl.constexpr(fields.SCALE_DIVIDE)
SCALE_RECIPROCAL = tl.constexpr(fields.SCALE_RECIPROCAL)

@triton.jit
def chunk_indices(k, rank, seg_numel, chunk_numel, numel, world):
    """For lanes ``k`` of segment ``(rank, param)``: the unsharded index of each lane,
    whether the lane is inside the segment, and whether it holds data (not padding)."""
    in_segment = k < seg_numel
    if seg_numel > chunk_numel:
        outer = k // chunk_numel
        rem = k - outer * chunk_numel
        idx = (outer * world + rank) * chunk_numel + rem
    else:  # one chunk row (Shard(0), all-gather copy-in): skip the per-lane division
        idx = rank * chunk_numel + k
    valid = in_segment & (idx < numel)
    return idx, in_segment, valid


@triton.jit
def segment_indices(block_table, param_meta, world, BLOCK: tl.constexpr):
    """This program's parameter (from the tables), its metadata and lane indices."""
    pid = tl.program_id(0)
    rank = tl.program_id(1)
    param = tl.load(block_table + 2 * pid)
    start = tl.load(block_table + 2 * pid + 1)
    row = param_meta + param.to(tl.int64) * PARAM_COLS
    col_offset = tl.load(row + COL_OFFSET)
    seg_numel = tl.load(row + SEG_NUMEL).to(tl.int32)
    chunk_numel = tl.load(row + CHUNK_NUMEL).to(tl.int32)
    numel = tl.load(row + NUMEL).to(tl.int32)
    out_offset = tl.load(row + OUT_OFFSET)
    kind = tl.load(row + SRC_KIND).to(tl.int32)
    k = start + tl.arange(0, BLOCK)
    idx, in_segment, valid = chunk_indices(k, rank, seg_numel, chunk_numel, numel, world)
    packed = col_offset + k  # column inside the rank's row
    return param, rank, kind, k, idx, in_segment, valid, packed, out_offset


@triton.jit
def bf16_bits_to_f32(bits):
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f16_bits_to_f32(bits):
    h = bits.to(tl.uint32)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    normal = ((exp + 112) << 23) | (mant << 13)
    special = 0x7F800000 | (mant << 13) | tl.where(mant != 0, 0x400000, 0)  # NaNs quiet
    # Subnormals are mant * 2^-24, exact in fp32.
    sub = (mant.to(tl.float32) * 5.9604644775390625e-08).to(tl.uint32, bitcast=True)
    mag = tl.where(exp == 0, sub, tl.where(exp == 31, special, normal))
    return (sign | mag).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    u = x.to(tl.uint32, bitcast=True)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet_nan = (u >> 16) | 0x40
    return tl.where(is_nan, quiet_nan, rounded).to(tl.uint16)


@triton.jit
def f32_to_f16_bits(x):
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    # Normal range: rebias the exponent (127 -> 15) and round 13 mantissa bits.
    normal = ((a - 0x38000000) + 0xFFF + ((a >> 13) & 1)) >> 13
    # Below 2^-14: round the 24-bit significand to units of 2^-24.
    exp = (a >> 23).to(tl.int32)
    shift = tl.minimum(tl.maximum(126 - exp, 14), 24).to(tl.uint32)
    sig = (a & 0x7FFFFF) | 0x800000
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = tl.where(a <= 0x33000000, 0, q + round_up.to(tl.uint32))
    nan = 0x7E00 | ((a >> 13) & 0x3FF)
    mag = tl.where(a < 0x38800000, sub, normal)
    mag = tl.where(a >= 0x477FF000, 0x7C00, mag)  # rounds past 65504: inf
    mag = tl.where(a > 0x7F800000, nan, mag)
    return (sign | mag).to(tl.uint16)


@triton.jit
def load_as_f32(ptr, mask, KIND: tl.constexpr, MANUAL_CASTS: tl.constexpr):
    """Loads ``ptr`` (typed pointers of element kind ``KIND``) widened to fp32."""
    if KIND == KIND_F32:
        x = tl.load(ptr, mask=mask, other=0.0)
    elif KIND == KIND_BF16:
        bits = tl.load(ptr.to(tl.pointer_type(tl.uint16), bitcast=True), mask=mask, other=0)
        x = bf16_bits_to_f32(bits)
    else:
        if MANUAL_CASTS:
            bits = tl.load(ptr.to(tl.pointer_type(tl.uint16), bitcast=True), mask=mask, other=0)
            x = f16_bits_to_f32(bits)
        else:
            x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def round_to(x, DST: tl.constexpr, MANUAL_CASTS: tl.constexpr):
    """fp32 -> DST with round-to-nearest-even, then back to fp32 (exact)."""
    if DST == KIND_BF16:
        if MANUAL_CASTS:
            y = bf16_bits_to_f32(f32_to_bf16_bits(x))
        else:
            y = x.to(tl.bfloat16).to(tl.float32)
    elif DST == KIND_F16:
        if MANUAL_CASTS:
            y = f16_bits_to_f32(f32_to_f16_bits(x))
        else:
            y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def store_cast(ptr, x, mask, DST: tl.constexpr, MANUAL_CASTS: tl.constexpr):
    """Stores fp32 ``x`` (already representable in DST) to ``ptr`` of kind DST."""
    if DST == KIND_F32:
        tl.store(ptr, x, mask=mask)
    elif DST == KIND_BF16:
        if MANUAL_CASTS:
            tl.store(ptr.to(tl.pointer_type(tl.uint16), bitcast=True), f32_to_bf16_bits(x), mask=mask)
        else:
            tl.store(ptr, x.to(tl.bfloat16), mask=mask)
    else:
        if MANUAL_CASTS:
            tl.store(ptr.to(tl.pointer_type(tl.uint16), bitcast=True), f32_to_f16_bits(x), mask=mask)
        else:
            tl.store(ptr, x.to(tl.float16), mask=mask)


@triton.jit
def cast_scale_store(out_ptr, x, in_segment, scale, DST: tl.constexpr,
                     MANUAL_CASTS: tl.constexpr, SCALE_MODE: tl.constexpr):
    """Casts ``x`` to DST, pre-divides in DST's precision as torch does, stores."""
    y = round_to(x, DST, MANUAL_CASTS)
    if SCALE_MODE == SCALE_DIVIDE:
        y = round_to(tl.div_rn(y, scale), DST, MANUAL_CASTS)
    elif SCALE_MODE == SCALE_RECIPROCAL:
        y = round_to(y * scale, DST, MANUAL_CASTS)
    store_cast(out_ptr, y, in_segment, DST, MANUAL_CASTS)


@triton.jit
def pack_from_pointer_table(
    src_addresses, out_ptr, param_meta, block_table, scale, row_numel, world,
    HAS_F32: tl.constexpr, HAS_BF16: tl.constexpr, HAS_F16: tl.constexpr,
    DST: tl.constexpr, MANUAL_CASTS: tl.constexpr, SCALE_MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Packs many source tensors (their addresses in ``src_addresses``) into the
    chunked layout, casting to DST and pre-dividing; padding is written as zeros."""
    param, rank, kind, k, idx, in_segment, valid, packed, _ = segment_indices(
        block_table, param_meta, world, BLOCK)
    base = tl.load(src_addresses + param)
    x = tl.full([BLOCK], 0.0, tl.float32)
    if HAS_F32:
        if kind == KIND_F32:
            x = load_as_f32(base.to(tl.pointer_type(tl.float32)) + idx, valid, KIND_F32,
                            MANUAL_CASTS)
    if HAS_BF16:
        if kind == KIND_BF16:
            x = load_as_f32(base.to(tl.pointer_type(tl.bfloat16)) + idx, valid, KIND_BF16,
                            MANUAL_CASTS)
    if HAS_F16:
        if kind == KIND_F16:
            x = load_as_f32(base.to(tl.pointer_type(tl.float16)) + idx, valid, KIND_F16,
                            MANUAL_CASTS)
    dst = out_ptr + rank.to(tl.int64) * row_numel + packed
    cast_scale_store(dst, x, in_segment, scale, DST, MANUAL_CASTS, SCALE_MODE)


@triton.jit
def pack_bytes_from_pointer_table(
    src_addresses, out_ptr, param_meta, block_table, row_numel, world, BLOCK: tl.constexpr,
):
    """Packs raw bytes (a mixed-dtype bucket): no cast, zero padding."""
    param, rank, kind, k, idx, in_segment, valid, packed, _ = segment_indices(
        block_table, param_meta, world, BLOCK)
    base = tl.load(src_addresses + param)
    src = base.to(tl.pointer_type(tl.uint8)) + idx
    x = tl.load(src, mask=valid, other=0)
    tl.store(out_ptr + rank.to(tl.int64) * row_numel + packed, x, mask=in_segment)


@triton.jit
def unpack(in_ptr, out_ptr, param_meta, block_table, row_numel, world, BLOCK: tl.constexpr):
    """Unpacks the chunked layout into the flat unsharded buffer (bit copy; padding
    is dropped). ``in_ptr``/``out_ptr`` have one integer dtype of the element size."""
    param, rank, kind, k, idx, in_segment, valid, packed, out_offset = segment_indices(
        block_table, param_meta, world, BLOCK)
    x = tl.load(in_ptr + rank.to(tl.int64) * row_numel + packed, mask=valid)
    tl.store(out_ptr + out_offset + idx, x, mask=valid)
    # The last block of each parameter zeroes the alignment gap after it.
    row = param_meta + param.to(tl.int64) * PARAM_COLS
    start = tl.load(block_table + 2 * tl.program_id(0) + 1)
    if (rank == 0) & (start + BLOCK >= tl.load(row + SEG_NUMEL)):
        g = tl.arange(0, 16)
        gap_ptr = out_ptr + out_offset + tl.load(row + NUMEL) + g
        tl.store(gap_ptr, tl.full([16], 0, x.dtype), mask=g < tl.load(row + GAP))
