"""Measuring on an AVX-512 machine as an AVX2 + FMA CPU would run (issue #15): torch's kernels forced
to AVX2 and lowbit_optim's fused kernel built without AVX-512. Only the instruction set is taken
away: the core (its caches, divider and gathers) is still this one, not an AVX2-only CPU's.

torch reads ATEN_CPU_CAPABILITY when it loads, so the forced run is a fresh process: a script calls
``reexec()`` before it imports torch (step_time.py), or runs a child with ``environment()``
(compute_bound.py), and calls ``build_kernel_without_avx512()`` once lowbit_optim is imported.

The forced process gets an inductor cache of its own unless TORCHINDUCTOR_CACHE_DIR is set:
inductor's cache key ignores ATEN_CPU_CAPABILITY, and a graph compiled in an unforced process, loaded
from the shared cache into a forced one, crashed it (a segmentation fault in step_time.py's
``lowbit-8bit-compiled`` row, torch 2.13; with a cache of its own the same row ran).
"""

import getpass
import os
import sys
import tempfile

CAPABILITY = "avx2"
KERNEL_FLAGS = ["-mno-avx512f"]


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a bare uid with no name (some containers)
        return str(os.getuid())


def environment() -> dict[str, str]:
    """The variables that force a fresh process to AVX2, with its own inductor cache."""
    env = {"ATEN_CPU_CAPABILITY": CAPABILITY}
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{_user()}_{CAPABILITY}")
    return env


def forced() -> bool:
    """Whether this process's torch is (to be) forced to AVX2."""
    return os.environ.get("ATEN_CPU_CAPABILITY") == CAPABILITY


def reexec() -> None:
    """Runs this script again from its start (the interpreter's own options too) with torch forced to
    AVX2; returns only if it already is, having given the process its own inductor cache where the
    caller forced it without one."""
    if forced():
        for name, value in environment().items():
            os.environ.setdefault(name, value)
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **environment()})


def build_kernel_without_avx512() -> None:
    """lowbit_optim's fused kernel, from now on, built (and cached) without AVX-512."""
    from lowbit_optim import kernel_abi, kernel_build

    kernel_build.FLAGS = [*kernel_build.FLAGS, *KERNEL_FLAGS]
    kernel_abi.load.cache_clear()
