"""The torch dtypes behind :mod:`.fields`' dtype names (``fields``
itself stays free of torch, so the kernels compile where torch is not installed)."""

from __future__ import annotations

import torch

from .fields import INT_NAME_OF_SIZE, KIND_OF_DTYPE_NAME

# Element kind (``fields.KIND_*``) of each dtype the kernels cast between.
KINDS = {getattr(torch, name): kind for name, kind in KIND_OF_DTYPE_NAME.items()}
# Integer dtype of each element size: the copy-out moves bits through these views.
INT_OF_SIZE = {size: getattr(torch, name) for size, name in INT_NAME_OF_SIZE.items()}
