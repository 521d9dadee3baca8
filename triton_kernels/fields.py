"""The one definition of what the copy kernels and their Python side exchange.

The per-parameter metadata row (:class:`ParamRow`: its fields are the columns of the
int64 ``param_meta`` table, in order), the per-tile row (:class:`TileRow`: the columns
of the int32 tile table), the element kinds of sources and destinations, and the
pre-divide modes. ``kernels.py``, the layouts and the launches all read these names;
nothing repeats a column number or a kind. Dtypes are named by their torch names
(``"bfloat16"``), so this module, ``kernels.py`` and the GPU target check
(``tests/triton_kernels/gpu_targets.py``) import without torch; :mod:`.dtypes`
maps the names to torch dtypes.
"""

from __future__ import annotations

from typing import NamedTuple


class ParamRow(NamedTuple):
    """Where one parameter's elements sit in a packed ``[world, row_numel]`` buffer."""

    col_offset: int  # first column of the parameter's segment in each rank's row
    seg_numel: int  # columns of the segment (padding included)
    chunk_numel: int  # elements of one contiguous chunk of the unsharded tensor
    numel: int  # elements of the unsharded tensor (or shard, for the copy-in)
    out_offset: int  # offset of the unsharded tensor in the copy-out buffer
    src_kind: int  # element kind of the parameter's source (a KIND_*)


class TileRow(NamedTuple):
    """The parameters one output tile touches: ``first_param`` and the ``param_count``
    that follow it (in index order; parameters without elements match no lane)."""

    first_param: int
    param_count: int


PARAM_COLS = len(ParamRow._fields)
COL = {name: index for index, name in enumerate(ParamRow._fields)}
TILE_COLS = len(TileRow._fields)
TILE_COL = {name: index for index, name in enumerate(TileRow._fields)}

# Element kinds: of a source (ParamRow.src_kind) and of a destination (the DST constexpr).
KIND_F32, KIND_BF16, KIND_F16, KIND_BYTES = 0, 1, 2, 3
# The dtypes the kernels cast between (every other dtype takes the aten path).
KIND_OF_DTYPE_NAME = {"float32": KIND_F32, "bfloat16": KIND_BF16, "float16": KIND_F16}
# The dtype of a byte copy's sources and destination.
BYTES_DTYPE_NAME = "uint8"

# Pre-divide modes (the SCALE_MODE constexpr): none, divide by the factor (as torch's
# CPU kernels do), multiply by its fp32 reciprocal (as torch's CUDA kernels do).
SCALE_NONE, SCALE_DIVIDE, SCALE_RECIPROCAL = 0, 1, 2

# Integer dtype of each element size: the copy-out moves bits through these views.
INT_NAME_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

# Lane indices are int32 inside the kernels; larger buckets take the aten path.
MAX_INDEX = 2**31 - 1
# Elements per output tile: 16 per thread at 4 warps, whole 16-byte stores.
DEFAULT_TILE = 2048
