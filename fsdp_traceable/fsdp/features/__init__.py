"""The opt-in parts of ``fully_shard``, each in its own module: FSDP2's all-gather
extensions (float8 weights), ``reshard_after_forward=N``, tensor-parallel parameters and
``dp_mesh_dims``, torch's pipeline stages, and which compiled backwards are one group's
(for per-block compile). The core (``fully_shard``, ``FSDPModule``, ``ParamGroup``, the
autograd bridge and the reduction) reads as a whole without them and calls them; they
import nothing of it (``tests/test_import_layers.py``).
"""
