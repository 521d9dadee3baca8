"""Inductor loads a test library per AVX-512 extension in a child Python process, in
every new process, even with ``config.cpp.vec_isa_ok`` set (torch 2.13).

Deciding which CPU vector ISA its C++ kernels use (``valid_vec_isa_list``), Inductor
builds a test library for each extension the CPU advertises (AVX-512 BF16, VNNI, AMX;
built once per cache directory) and loads it in a child Python process
(``VecISA._probe_load``). ``cpp.vec_isa_ok = True`` answers only whether the base ISA
works, not the extensions: a restarted process pays the children again (about 0.1 s
of the 1 s its first call of a saved 4-block step took). Torch 2.14 marks a loaded
library on disk (``.load_ok``) and loads it once per cache directory; 2.11 loads
them too, from inside ``check_build`` (no ``_probe_load``, which the package leaves as
it is). fsdp_traceable answers the checks from
the saving process's recorded outcome while its saved step loads
(``_torch_patches.answer_isa_load_checks``). No fsdp_traceable code is involved.

Needs an x86-64 Linux host whose CPU advertises AVX-512 extensions
(``grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u``: avx512_bf16 or avx512_vnni,
or amx_tile); elsewhere it prints that there is nothing to load.

Run: python docs/repros/cpu_isa_load_checks.py
Prints the extensions the CPU advertises and, in two fresh processes one after the
other (the second with the first's libraries on disk, in a temporary cache directory),
how many child processes computing the ISA list with ``vec_isa_ok = True`` started.
Measured on an AVX-512 BF16 + VNNI host (Linux, x86-64): torch 2.11.0 and 2.13.0: 3
and 3; 2.15.0: 3, then 0. It builds the test libraries first (30 to 90 s on 2 cores).
"""

import os
import subprocess
import sys
import tempfile

CHILD = """
import subprocess, sys
import torch
from torch._inductor import config, cpu_vec_isa

loads = []

def counting(start):
    def counted(command, *args, **kwargs):
        if command and command[0] == sys.executable:
            loads.append(command)
        return start(command, *args, **kwargs)
    return counted

cpu_vec_isa.subprocess.run = counting(subprocess.run)  # 2.13 on
cpu_vec_isa.subprocess.check_call = counting(subprocess.check_call)  # 2.11
config.cpp.vec_isa_ok = True
isas = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
print(f"torch {torch.__version__}: ISAs {isas}; child processes loading a test library: {len(loads)}")
"""


def main() -> None:
    with open("/proc/cpuinfo") as cpuinfo:
        flags = {word for line in cpuinfo if line.startswith("flags") for word in line.split()}
    extensions = sorted(f for f in flags if f.startswith(("avx512_bf16", "avx512_vnni", "amx")))
    print("AVX-512 extensions this CPU advertises:", extensions or "none (nothing to load)")
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir}
        for process in ("first process", "second process"):
            result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True,
                                    text=True, env={**os.environ, **env}, check=True)
            print(f"{process}: {result.stdout.strip()}")


if __name__ == "__main__":
    main()
