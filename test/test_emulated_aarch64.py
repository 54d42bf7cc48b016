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
    with pytest.raises(kernel_abi.LayoutMismatch, match=r"state_t', 'data', 'ptr'"):
        emulated_aarch64.kernel.__wrapped__(emulated_aarch64.CPU("generic"))


def test_an_unmapped_address_is_an_error_not_a_crash():
    """A pointer to memory this process has not mapped (a kernel bug) raises in the test instead of
    crashing the process that reads the page for the guest."""
    emulated = emulated_aarch64.kernel(emulated_aarch64.CPU("generic"))
    state = formats.get_format("8bit").zeros(256, signed=True)
    codes = torch.empty(256, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="has not mapped"):
        emulated.lib.lowbit_encode(ctypes.byref(kernel_op.describe(emulated, state)), 0x1000, 256, codes.data_ptr())
