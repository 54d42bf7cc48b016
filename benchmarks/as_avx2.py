"""Measuring on an AVX-512 machine as an AVX2 + FMA CPU would run (issue #15): torch's kernels forced
to AVX2 and lowbit_optim's fused kernel built without AVX-512. Only the instruction set is taken
away: the core (its caches, divider and gathers) is still this one, not an AVX2-only CPU's.

torch reads ATEN_CPU_CAPABILITY when it loads, so the forced run is a fresh process: a script calls
``reexec()`` before it imports torch (step_time.py), or runs a child with ``ENV`` (compute_bound.py),
and calls ``build_kernel_without_avx512()`` once lowbit_optim is imported.
"""

import os
import sys

ENV = {"ATEN_CPU_CAPABILITY": "avx2"}
KERNEL_FLAGS = ["-mno-avx512f"]


def forced() -> bool:
    """Whether this process's torch is (to be) forced to AVX2."""
    return os.environ.get("ATEN_CPU_CAPABILITY") == ENV["ATEN_CPU_CAPABILITY"]


def reexec() -> None:
    """Runs this script again from its start with torch forced to AVX2; returns only if it already is."""
    if not forced():
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ENV})


def build_kernel_without_avx512() -> None:
    """lowbit_optim's fused kernel, from now on, built (and cached) without AVX-512."""
    from lowbit_optim import kernel_abi, kernel_build

    kernel_build.FLAGS = [*kernel_build.FLAGS, *KERNEL_FLAGS]
    kernel_abi.load.cache_clear()
