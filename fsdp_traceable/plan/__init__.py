"""A training step's per-rank memory and per-step communication at any world size,
from the step itself run on one CPU with fake tensors and a fake process group.

- :mod:`.models`: the models (built-in, torchtitan Llama 3, Hugging Face, user function)
  built on meta and parallelized in their recipe;
- :mod:`.recorder`: the fake mode that records allocations, collectives and FLOPs;
- :mod:`.trace`: one step on fake tensors, recorded;
- :mod:`.extrapolate`: the plan at the real depth from two shallow traces;
- :mod:`.report`, :mod:`.gpus`: the table, JSON and step-time estimate.

``python -m fsdp_traceable plan`` is the command (``docs/plan.md``).
"""
