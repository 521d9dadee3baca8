"""Imported by a rank fork server to do, once and before any rank forks, the per-process
work every rank that compiles with Inductor would repeat (see [Note: preloaded rank
processes]).

- Inductor's first C++ compile in a process compiles and runs a probe program per
  instruction set (``valid_vec_isa_list``, about 5 s of CPU with a warm cache directory,
  18 s with an empty one on a 2-core machine) and keeps the answer for the process.
- The first ``torch.compile`` imports Inductor's compiler, lowerings and graph passes
  (about 2.5 s of CPU on a 2-core machine).

Ranks forked after this import inherit both. Only imports and the probe: nothing here
starts a thread (a thread of the server would not exist in its forked ranks) or touches
Dynamo's caches and counters (which the ranks would inherit).
"""

import torch._functorch.aot_autograd  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401
import torch._inductor.fx_passes.joint_graph  # noqa: F401
import torch._inductor.fx_passes.post_grad  # noqa: F401
from torch._inductor.cpu_vec_isa import valid_vec_isa_list

valid_vec_isa_list()
