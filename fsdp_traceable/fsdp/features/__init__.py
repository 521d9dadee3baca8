"""The opt-in parts of ``fully_shard``, each in its own module, each used only when a
model asks for it: FSDP2's all-gather extensions (a parameter subclass with
``fsdp_pre_all_gather``, e.g. float8 weights), ``reshard_after_forward=N``,
tensor-parallel parameters and ``dp_mesh_dims``, and ``block.compile()`` on a sharded
module (per-module compile). The core (``fully_shard``, ``FSDPModule``, ``ParamGroup``, the
autograd bridge and the reduction) reads as a whole without them and calls them; they
import nothing of it (``tests/test_import_layers.py``).
"""
