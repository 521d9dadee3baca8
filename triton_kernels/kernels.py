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
:class:`triton_kernels.fields.ParamRow` rows. Work is split by fixed-size tiles of the
kernel's contiguous OUTPUT, never by parameter: a persistent grid of programs strides
over the tiles, and an int32 ``[num_tiles, TILE_COLS]`` table of
:class:`triton_kernels.fields.TileRow` rows names the few parameters each tile
touches; a tile's lanes look only at those. Values are gathered in registers and
each tile is written with one store (16-byte vectors where alignment allows), zeros
where no parameter has data (padding, alignment gaps).

Casts are exact round-to-nearest-even. With ``MANUAL_CASTS`` (the CPU interpreter,
whose float conversions truncate) they are done on the bits by hand; otherwise the
hardware conversions run, which are the ones torch's CUDA kernels use. Division by
the pre-divide factor follows torch's device rule: CUDA multiplies by the fp32
reciprocal, CPU divides.

This file is loaded once per Triton mode (compiled and interpreted) by
:mod:`.loader`; import it only through there. For that to work in a
process whose ``triton`` was imported in the other mode, the kernels call only Triton
builtins and functions of this file, never ``triton.language.standard``'s
``@jit`` functions (``tl.zeros``, ``tl.cdiv``, ...).
"""

import triton
import triton.language as tl

from fsdp_traceable.triton_kernels import fields

# fields' names as constexprs, the only globals a @triton.jit function may read.
PARAM_COLS = tl.constexpr(fields.PARAM_COLS)
COL_OFFSET = tl.constexpr(fields.COL["col_offset"])
SEG_NUMEL = tl.constexpr(fields.COL["seg_numel"])
CHUNK_NUMEL = tl.constexpr(fields.COL["chunk_numel"])
NUMEL = tl.constexpr(fields.COL["numel"])
OUT_OFFSET = tl.constexpr(fields.COL["out_offset"])
SRC_KIND = tl.constexpr(fields.COL["src_kind"])
TILE_COLS = tl.constexpr(fields.TILE_COLS)
FIRST_PARAM = tl.constexpr(fields.TILE_COL["first_param"])
PARAM_COUNT = tl.constexpr(fields.TILE_COL["param_count"])
KIND_F32 = tl.constexpr(fields.KIND_F32)
KIND_BF16 = tl.constexpr(fields.KIND_BF16)
KIND_F16 = tl.constexpr(fields.KIND_F16)
KIND_BYTES = tl.constexpr(fields.KIND_BYTES)
SCALE_DIVIDE = tl.constexpr(fields.SCALE_DIVIDE)
SCALE_RECIPROCAL = tl.constexpr(fields.SCALE_RECIPROCAL)

@triton.jit
def chunk_indices(k, rank, seg_numel, chunk_numel, numel, world):
    """For lanes ``k`` of segment ``(rank, param)``: the unsharded index of each lane,
    whether the lane is inside the segment, and whether it holds data (not padding)."""
    in_segment = (k >= 0) & (k < seg_numel)
    if seg_numel > chunk_numel:
        outer = k // chunk_numel
        rem = k - outer * chunk_numel
        idx = (outer * world + rank) * chunk_numel + rem
    else:  # one chunk row (Shard(0), all-gather copy-in): skip the per-lane division
        idx = rank * chunk_numel + k
    valid = in_segment & (idx < numel)
    return idx, in_segment, valid


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
def load_source(base, idx, valid, kind, HAS_F32: tl.constexpr, HAS_BF16: tl.constexpr,
                HAS_F16: tl.constexpr, MANUAL_CASTS: tl.constexpr, TILE: tl.constexpr):
    """Lanes ``idx`` of the source at address ``base`` (element kind ``kind``),
    widened to fp32; 0 where not ``valid``."""
    x = tl.full([TILE], 0.0, tl.float32)
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
    return x


# Sizes are not specialized (Triton would compile a variant per value class: equal
# to 1, a multiple of 16), so one compiled kernel serves every bucket; only the row
# length, which sets the alignment of every rank's row after the first, is.
@triton.jit(do_not_specialize=["tiles_per_row", "num_tiles", "world"])
def pack_tiles(
    src_addresses, out_ptr, param_meta, tiles, scale, row_numel, tiles_per_row, num_tiles,
    world, HAS_F32: tl.constexpr, HAS_BF16: tl.constexpr, HAS_F16: tl.constexpr,
    DST: tl.constexpr, MANUAL_CASTS: tl.constexpr, SCALE_MODE: tl.constexpr,
    TILE: tl.constexpr,
):
    """Packs many sources (their addresses in ``src_addresses``) into the chunked
    ``[world, row_numel]`` layout: cast to DST and pre-divided, or raw bytes when DST
    is ``KIND_BYTES``; padding is written as zeros. Tile ``t`` is column tile
    ``t % tiles_per_row`` of rank ``t // tiles_per_row``'s row."""
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        rank = tile // tiles_per_row
        column_tile = tile - rank * tiles_per_row
        first = tl.load(tiles + column_tile * TILE_COLS + FIRST_PARAM)
        count = tl.load(tiles + column_tile * TILE_COLS + PARAM_COUNT)
        columns = column_tile * TILE + tl.arange(0, TILE)
        if DST == KIND_BYTES:
            x = tl.full([TILE], 0, tl.uint8)
        else:
            x = tl.full([TILE], 0.0, tl.float32)
        for i in range(count):
            param = first + i
            row = param_meta + param.to(tl.int64) * PARAM_COLS
            k = columns - tl.load(row + COL_OFFSET).to(tl.int32)
            idx, in_segment, valid = chunk_indices(
                k, rank, tl.load(row + SEG_NUMEL).to(tl.int32),
                tl.load(row + CHUNK_NUMEL).to(tl.int32), tl.load(row + NUMEL).to(tl.int32),
                world)
            base = tl.load(src_addresses + param)
            if DST == KIND_BYTES:
                v = tl.load(base.to(tl.pointer_type(tl.uint8)) + idx, mask=valid, other=0)
            else:
                kind = tl.load(row + SRC_KIND).to(tl.int32)
                v = load_source(base, idx, valid, kind, HAS_F32, HAS_BF16, HAS_F16,
                                MANUAL_CASTS, TILE)
            x = tl.where(valid, v, x)
        dst = out_ptr + rank.to(tl.int64) * row_numel + columns
        full = (column_tile + 1) * TILE <= row_numel
        if DST == KIND_BYTES:
            if full:
                tl.store(dst, x)
            else:
                tl.store(dst, x, mask=columns < row_numel)
        else:
            if full:
                cast_scale_store(dst, x, None, scale, DST, MANUAL_CASTS, SCALE_MODE)
            else:
                cast_scale_store(dst, x, columns < row_numel, scale, DST, MANUAL_CASTS,
                                 SCALE_MODE)


@triton.jit(do_not_specialize=["row_numel", "out_numel", "num_tiles", "world"])
def unpack_tiles(in_ptr, out_ptr, param_meta, tiles, row_numel, out_numel, num_tiles, world,
                 TILE: tl.constexpr):
    """Unpacks the chunked ``[world, row_numel]`` layout into the flat unsharded buffer
    of ``out_numel`` elements (bit copy: ``in_ptr``/``out_ptr`` have one integer dtype
    of the element size); padding is dropped, gaps between parameters are zeroed."""
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        first = tl.load(tiles + tile * TILE_COLS + FIRST_PARAM)
        count = tl.load(tiles + tile * TILE_COLS + PARAM_COUNT)
        offsets = tile * TILE + tl.arange(0, TILE)
        x = tl.full([TILE], 0, out_ptr.dtype.element_ty)
        for i in range(count):
            row = param_meta + (first + i).to(tl.int64) * PARAM_COLS
            idx = offsets - tl.load(row + OUT_OFFSET).to(tl.int32)
            valid = (idx >= 0) & (idx < tl.load(row + NUMEL).to(tl.int32))
            chunk = tl.load(row + CHUNK_NUMEL).to(tl.int32)
            q = idx // chunk
            if tl.load(row + SEG_NUMEL).to(tl.int32) > chunk:  # Shard(d > 0): chunk-cat
                outer = q // world
                rank = q - outer * world
                k = outer * chunk + (idx - q * chunk)
            else:  # one chunk row per rank
                rank = q
                k = idx - q * chunk
            src = in_ptr + rank.to(tl.int64) * row_numel + tl.load(row + COL_OFFSET) + k
            x = tl.where(valid, tl.load(src, mask=valid, other=0), x)
        if (tile + 1) * TILE <= out_numel:
            tl.store(out_ptr + offsets, x)
        else:
            tl.store(out_ptr + offsets, x, mask=offsets < out_numel)
