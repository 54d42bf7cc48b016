"""The fused CPU kernel built for aarch64 and run under emulation, so that an x86 machine tests the
code an ARM server runs (its compiler-vectorized loops, NEON) against the native kernel.

The build: the kernel's own source and flags (kernel_build: its -D constants, -O3,
-ffp-contract=off, ...) for ``-mcpu=CPU`` instead of -march=native, by the clang that ships in the
``ziglang`` package, linked without a C library: emulated_aarch64_runtime.c gives it memory
functions, an allocator, and powf / exp / log by a call back into this process's libm, which the
native kernel calls too. zig has no OpenMP, so the kernel runs its scheduler on one thread.

The run (``unicorn``, QEMU's CPU emulator): the guest sees this process's memory at the same
addresses. The first touch of a page maps a copy of it; after a call, the bytes the guest changed
are written back and its copies dropped. So the param_t entries, tensors and tables Python hands the
native library serve the emulated one unchanged. The guest's layout table is checked against the
native one's before it runs anything (kernel_abi's check, for the other ABI).
"""

import copy
import ctypes
import dataclasses
import functools
import hashlib
import itertools
import os
import pathlib
import platform
import struct
import subprocess
import sys
from collections.abc import Callable

import numpy as np

from lowbit_optim import kernel_abi, kernel_build

RUNTIME = pathlib.Path(__file__).with_name("emulated_aarch64_runtime.c")
PAGE = 4096
IMAGE_BASE = 0x1000_0000_0000  # the guest's code and data: far from where x86-64 Linux maps a process
STACK, STACK_BYTES = 0x1001_0000_0000, 1 << 20
RETURN = "lowbit_emulation_return"
_NATIVE_ONLY = {"-march=native", "-fopenmp", "-fPIC", "-shared"}  # the host's CPU, libgomp, a shared library


@dataclasses.dataclass(frozen=True)
class CPU:
    """An aarch64 CPU to build the kernel for (``-mcpu=name``) and emulate."""

    name: str


@functools.cache
def unavailable() -> str | None:
    """Why the emulated kernel cannot run here, or None."""
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform != "linux":
        return "the emulation runs on x86-64 Linux (it reads /proc/self/mem and calls libm.so.6)"
    try:
        import unicorn  # noqa: F401
        import ziglang  # noqa: F401
    except ImportError as error:
        return f"{error.name} is not installed (pip install ziglang unicorn, or the test extra)"
    return None


def build(cpu: str) -> str:
    """The kernel as a static aarch64 executable for ``-mcpu=cpu``, cached beside the native one."""
    flags = [f for f in kernel_build.FLAGS if f not in _NATIVE_ONLY] + kernel_build.defines()
    digest = hashlib.sha256()
    for source in [*kernel_build.sources(), RUNTIME]:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    digest.update(" ".join([cpu, *flags, f"{IMAGE_BASE:#x}"]).encode())
    path = kernel_build.cache_dir() / f"fused_step_aarch64_{cpu}_{digest.hexdigest()[:16]}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        zig = [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-musl", f"-mcpu={cpu}"]
        kernel, runtime, partial = (path.with_name(f"{path.name}.{os.getpid()}.{name}") for name in ("kernel.o", "runtime.o", "tmp"))
        for argv in (
            [*zig, "-c", "-x", "c", str(kernel_build.MAIN_SOURCE), f"-I{kernel_build.SOURCE_DIR}", *flags, "-o", str(kernel)],
            [*zig, "-c", "-O2", "-ffreestanding", "-fno-builtin", str(RUNTIME), "-o", str(runtime)],
            [*zig, "-nostdlib", "-static", f"-Wl,--image-base={IMAGE_BASE:#x}", f"-Wl,-e,{RETURN}", str(kernel), str(runtime), "-o", str(partial)],
        ):
            result = subprocess.run(argv, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise OSError(f"{' '.join(argv)} failed:\n{result.stderr.strip()}")
        partial.replace(path)  # atomic: concurrent test workers never load a half-written file
        for intermediate in (kernel, runtime):
            intermediate.unlink()
    return str(path)


class Executable:
    """A static aarch64 ELF executable: its loadable segments, symbols and constructors."""

    def __init__(self, path: str):
        data = pathlib.Path(path).read_bytes()
        if data[:5] != b"\x7fELF\x02" or struct.unpack_from("<H", data, 18)[0] != 183:  # 64-bit, EM_AARCH64
            raise ValueError(f"{path} is not a 64-bit aarch64 ELF file")
        program_headers, section_headers = struct.unpack_from("<QQ", data, 32)
        program_size, programs, section_size, sections_count = struct.unpack_from("<HHHH", data, 54)
        self.segments = []  # (address, file bytes, bytes in memory)
        for i in range(programs):
            kind, _, offset, address, _, file_bytes, memory_bytes, _ = struct.unpack_from("<IIQQQQQQ", data, program_headers + i * program_size)
            if kind == 1:  # PT_LOAD
                self.segments.append((address, data[offset : offset + file_bytes], memory_bytes))
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_headers + i * section_size) for i in range(sections_count)]
        self.symbols, self.constructors = {}, []
        for _, kind, _, _, offset, size, link, _, _, _ in sections:
            if kind == 14:  # SHT_INIT_ARRAY: what a loader runs before main (convert.h fills its tables so)
                self.constructors += struct.unpack_from(f"<{size // 8}Q", data, offset)
            if kind == 2:  # SHT_SYMTAB
                names = data[sections[link][4] : sections[link][4] + sections[link][5]]
                for j in range(size // 24):
                    name, _, _, index, value, _ = struct.unpack_from("<IBBHQQ", data, offset + j * 24)
                    if index and value:
                        self.symbols[names[name : names.index(b"\0", name)].decode()] = value


class Guest:
    """The executable in an emulated aarch64 CPU that borrows this process's memory (module doc)."""

    def __init__(self, path: str):
        from unicorn import UC_ARCH_ARM64, UC_HOOK_INTR, UC_HOOK_MEM_UNMAPPED, UC_MODE_ARM, Uc, arm64_const

        self.regs = arm64_const
        self.executable = Executable(path)
        self.uc = Uc(UC_ARCH_ARM64, UC_MODE_ARM)
        self.uc.ctl_set_cpu_model(arm64_const.UC_CPU_ARM64_MAX)
        self.own = [(STACK, STACK + STACK_BYTES)]
        for address, contents, memory_bytes in self.executable.segments:
            low, high = address // PAGE * PAGE, -(-(address + memory_bytes) // PAGE) * PAGE
            self.uc.mem_map(low, high - low)
            self.uc.mem_write(address, contents)
            self.own.append((low, high))
        self.uc.mem_map(STACK, STACK_BYTES)
        self.uc.reg_write(arm64_const.UC_ARM64_REG_CPACR_EL1, 3 << 20)  # FP and SIMD on
        self.uc.hook_add(UC_HOOK_MEM_UNMAPPED, self._borrow)
        self.uc.hook_add(UC_HOOK_INTR, self._host_call)
        self.borrowed: dict[int, bytes] = {}  # host page -> its bytes when the guest first touched it
        self.memory = os.open("/proc/self/mem", os.O_RDONLY)
        libm = ctypes.CDLL("libm.so.6")
        powf, exp, log = libm.powf, libm.exp, libm.log
        powf.restype, powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
        exp.restype = log.restype = ctypes.c_double
        exp.argtypes = log.argtypes = [ctypes.c_double]
        self.host_functions = {1: powf, 2: lambda x, _: exp(x), 3: lambda x, _: log(x)}
        for constructor in self.executable.constructors:
            self.run(constructor)

    def _borrow(self, uc, access, address, size, value, data) -> bool:
        """unicorn's hook for a touch of unmapped memory: map a copy of this process's page(s) there."""
        for page in range(address // PAGE * PAGE, address + max(size, 1), PAGE):
            if page in self.borrowed:
                continue
            if any(low <= page < high for low, high in self.own):
                self.error = f"the guest touched {address:#x}, unmapped guest memory"
                return False
            try:  # /proc/self/mem: an unmapped page is an error, not a crash of this process
                self.borrowed[page] = os.pread(self.memory, PAGE, page)
            except OSError:
                self.error = f"the guest touched {address:#x}, which this process has not mapped"
                return False
            uc.mem_map(page, PAGE)
            uc.mem_write(page, self.borrowed[page])
        return True

    def _host_call(self, uc, interrupt, data) -> None:
        """unicorn's hook for an exception: the runtime's svc asks for powf, exp or log (x8)."""
        r = self.regs
        which = uc.reg_read(r.UC_ARM64_REG_X8)
        x, y = (struct.unpack("<d", struct.pack("<Q", uc.reg_read(reg)))[0] for reg in (r.UC_ARM64_REG_D0, r.UC_ARM64_REG_D1))
        if interrupt != 2 or which not in self.host_functions:  # EXCP_SWI: svc
            self.error = f"exception {interrupt} (x8 = {which}) at {uc.reg_read(r.UC_ARM64_REG_PC):#x}"
            uc.emu_stop()
            return
        uc.reg_write(r.UC_ARM64_REG_D0, struct.unpack("<Q", struct.pack("<d", self.host_functions[which](x, y)))[0])

    def run(self, address: int, integers=(), floats=()) -> int:
        """Call the function at ``address`` with its integer and pointer arguments (x0..x7) and fp32
        ones (s0..s7), then write what it changed back into this process; returns x0."""
        r, uc = self.regs, self.uc
        if len(integers) > 8 or len(floats) > 8:
            raise TypeError("arguments beyond the registers are not passed")
        for i, value in enumerate(integers):
            uc.reg_write(getattr(r, f"UC_ARM64_REG_X{i}"), value & (2**64 - 1))
        for i, value in enumerate(floats):
            uc.reg_write(getattr(r, f"UC_ARM64_REG_D{i}"), struct.unpack("<I", struct.pack("<f", value))[0])
        uc.reg_write(r.UC_ARM64_REG_SP, STACK + STACK_BYTES)
        stop = self.executable.symbols[RETURN]
        uc.reg_write(r.UC_ARM64_REG_LR, stop)
        self.error = None
        try:
            uc.emu_start(address, stop)
            if self.error is None and uc.reg_read(r.UC_ARM64_REG_PC) != stop:
                self.error = f"stopped at {uc.reg_read(r.UC_ARM64_REG_PC):#x}"
        except Exception as error:  # noqa: BLE001 - unicorn's UcError; the hook's reason is the news
            self.error = f"{error}: {self.error}"
        try:
            if self.error is None:
                for page, before in self.borrowed.items():
                    after = np.frombuffer(bytes(uc.mem_read(page, PAGE)), np.uint8)
                    changed = after != np.frombuffer(before, np.uint8)
                    if changed.any():  # only those bytes: the rest of a page may be Python's, changed since
                        np.ctypeslib.as_array((ctypes.c_uint8 * PAGE).from_address(page))[changed] = after[changed]
        finally:
            for page in self.borrowed:
                uc.mem_unmap(page, PAGE)
            self.borrowed = {}
        if self.error is not None:
            raise RuntimeError(f"the emulated kernel failed: {self.error}")
        return uc.reg_read(r.UC_ARM64_REG_X0)

    def string(self, address: int) -> str:
        """The NUL-terminated string at ``address`` of the guest's memory."""
        data = b""
        while b"\0" not in data:
            data += bytes(self.uc.mem_read(address + len(data), 16))
        return data[: data.index(b"\0")].decode()


class Function:
    """One of the library's functions, called in the guest with the native one's ctypes prototype."""

    def __init__(self, guest: Guest, address: int, native):
        self.guest, self.address = guest, address
        self.argtypes, self.restype = native.argtypes or [], native.restype
        if ctypes.c_double in self.argtypes:
            raise TypeError("the emulated library passes fp32 arguments only (Guest.run)")

    def __call__(self, *args):
        integers, floats = [], []
        for value, kind in zip(args, self.argtypes, strict=True):
            if kind is ctypes.c_float:
                floats.append(float(value.value if isinstance(value, ctypes._SimpleCData) else value))
            else:
                integers.append(_address(value))
        result = self.guest.run(self.address, integers, floats)
        if self.restype is None:
            return None
        return self.restype(result & (2 ** (8 * ctypes.sizeof(self.restype)) - 1)).value


def _address(value) -> int:
    """An integer or pointer argument as the number a register holds."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, ctypes._SimpleCData):
        return value.value or 0
    if type(value).__name__ == "CArgObject":  # ctypes.byref(x)
        return ctypes.addressof(value._obj)
    if isinstance(value, (ctypes.Array, ctypes.Structure)):
        return ctypes.addressof(value)
    return ctypes.cast(value, ctypes.c_void_p).value or 0


class Library:
    """Stands in for the native kernel's ctypes library: the same functions, run in the guest."""

    def __init__(self, guest: Guest, native: ctypes.CDLL):
        self._guest, self._native = guest, native

    def __getattr__(self, name: str) -> Function:
        return Function(self._guest, self._guest.executable.symbols[name], getattr(self._native, name))


# the layout tables (fused_step.c): how many of a row's outputs are strings, and how many there are
TABLES = {"lowbit_abi_field": (3, 6), "lowbit_abi_constant": (2, 3), "lowbit_abi_optimizer": (3, 4)}


def _rows(call, read: Callable[[int], str], strings: int, width: int) -> list[tuple]:
    """Every row of a layout table: ``call(i, *addresses of the outputs)`` returns 0 past the end; the
    first ``strings`` outputs are char pointers, read by ``read``."""
    rows, outs = [], [ctypes.c_uint64() for _ in range(width)]
    while ctypes.c_int32(call(len(rows), *(ctypes.addressof(o) for o in outs)) & 0xFFFFFFFF).value:
        rows.append(tuple(read(o.value) if i < strings else o.value for i, o in enumerate(outs)))
    return rows


@functools.cache
def kernel(cpu: str) -> kernel_abi.Kernel:
    """The native kernel's Kernel (structures, kinds, optimizers) with the emulated library, once
    the guest's layout tables (every field's offset and size, the kinds, limits and optimizers) are
    found to be the native ones: a LayoutMismatch names the first row that differs."""
    native, why = kernel_abi.load()
    if native is None:
        raise RuntimeError(f"no native kernel to compare with: {why}")
    guest = Guest(build(cpu))
    for name, (strings, width) in TABLES.items():
        prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * width)
        ours = _rows(prototype(ctypes.cast(getattr(native.lib, name), ctypes.c_void_p).value), lambda a: ctypes.string_at(a).decode(), strings, width)
        theirs = _rows(lambda *a, name=name: guest.run(guest.executable.symbols[name], a), guest.string, strings, width)
        for i, (a, b) in enumerate(itertools.zip_longest(ours, theirs)):
            if a != b:
                raise kernel_abi.LayoutMismatch(f"{name}'s row {i} is {a} in the native kernel, {b} in the aarch64 build for {cpu}")
    emulated = copy.copy(native)
    emulated.lib = Library(guest, native.lib)
    return emulated
