"""The emulation that runs the kernel's aarch64 build in the tests (emulated_aarch64.py): what its
users rely on beyond the bits it gives, which test_fused_cpu checks against the native kernel."""

import ctypes

import pytest
import torch

import emulated_aarch64
from lowbit_optim import formats, kernel_abi, kernel_build, kernel_op

pytestmark = pytest.mark.skipif(emulated_aarch64.unavailable() is not None, reason=f"the aarch64 kernel is emulated here, but {emulated_aarch64.unavailable()}")


def test_a_build_whose_layout_differs_is_refused(monkeypatch, tmp_path):
    """The guest's structures are checked against the native kernel's before it runs: a build that
    lays them out otherwise (here packed to 4 bytes) raises a LayoutMismatch naming the field."""
    kernel_op.kernel()  # the native kernel, built and loaded (cached) before the flag goes in
    monkeypatch.setattr(kernel_build, "FLAGS", [*kernel_build.FLAGS, "-fpack-struct=4"])
    monkeypatch.setattr(kernel_build, "cache_dir", lambda: tmp_path)  # not beside the builds that pass
    with pytest.raises(kernel_abi.LayoutMismatch, match=r"state_t', 'near_code', 'ptr'"):
        emulated_aarch64.kernel.__wrapped__(emulated_aarch64.CPU("generic"))


def test_an_unmapped_address_is_an_error_not_a_crash():
    """A pointer to memory this process has not mapped (a kernel bug) raises in the test instead of
    crashing the process that reads the page for the guest."""
    emulated = emulated_aarch64.kernel(emulated_aarch64.CPU("generic"))
    state = formats.get_format("8bit").zeros(256, signed=True)
    codes = torch.empty(256, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="has not mapped"):
        emulated.lib.lowbit_encode(ctypes.byref(kernel_op.describe(emulated, state)), 0x1000, 256, codes.data_ptr())


def test_pages_made_readable_since_the_last_reading_are_found():
    """Memory reserved unreadable, then made readable (as malloc grows another thread's arena), is
    found readable: a cached reading of this process's mappings had called it unmapped, and the
    emulated kernel failed on it once in the suite."""
    libc = ctypes.CDLL(None)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    reserved = libc.mmap(None, 4 * 4096, 0, 0x22, -1, 0)  # PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS
    try:
        maps = emulated_aarch64.HostMaps()
        assert maps.find(reserved) is None
        assert libc.mprotect(reserved, 4096, 3) == 0  # PROT_READ | PROT_WRITE
        assert maps.find(reserved)[2].startswith("rw")
    finally:
        libc.munmap(reserved, 4 * 4096)
