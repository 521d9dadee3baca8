"""Imported by a rank fork server to detect the CPU's vector instruction sets for Inductor
once, before any rank forks (see [Note: preloaded rank processes]).

Inductor's first C++ compile in a process compiles and runs a probe program per
instruction set (``valid_vec_isa_list``, about 5 s of CPU with a warm cache directory,
18 s with an empty one on a 2-core machine) and keeps the answer for the process;
ranks forked after this import inherit the answer instead of probing again.
"""

from torch._inductor.cpu_vec_isa import valid_vec_isa_list

valid_vec_isa_list()
