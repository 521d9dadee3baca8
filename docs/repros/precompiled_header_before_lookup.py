"""Inductor precompiles its C++ kernels' common header before looking for a library it
has already built (torch 2.11 to 2.15).

``CppPythonBindingsCodeCache.load_async`` computes the library's key and, where the key
is not in this process's in-memory cache (always, in a new process), runs
``_precompile_header`` (a preprocessor run and checksum, or a whole header compile,
about 6 s, where the header directory under the temporary directory is gone) before it
looks for the library on disk: a new process loading saved kernels pays it although
every library is found. fsdp_traceable skips the precompile while its saved step loads (a
missing library is built without the precompiled header; no key changes;
``_torch_patches.skip_header_precompile_on_load``). No fsdp_traceable code is involved.

Run: python docs/repros/precompiled_header_before_lookup.py
Reads torch's source: prints whether the precompile runs once the in-memory lookup
misses, before the library is loaded (torch 2.13: True).
"""

import inspect

from torch._inductor import codecache

source = inspect.getsource(codecache.CppPythonBindingsCodeCache.load_async)
lookup = source.find("if key not in cls.cache")
precompile = source.find("_precompile_header(")
print("precompile after the in-memory miss, before the load:", 0 <= lookup < precompile)
