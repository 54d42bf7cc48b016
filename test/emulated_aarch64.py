"""The fused CPU kernel built for aarch64 and run under emulation, so that an x86 machine tests the
code an ARM server runs (its compiler-vectorized loops, NEON or SVE) against the native kernel.

The build: the kernel's own source and flags (kernel_build: its -D constants, -O3,
-ffp-contract=off, ...) for ``-mcpu=CPU`` instead of -march=native, by the clang that ships in the
``ziglang`` package, linked without a C library: emulated_aarch64_runtime.c gives it memory
functions, an allocator, and powf / exp / log by a call back into this process's libm, which the
native kernel calls too. zig has no OpenMP, so the kernel runs its scheduler on one thread.

The run (``unicorn``, QEMU's CPU emulator; SVE with the CPU's ``sve_bits``, 256 as Neoverse V1's): the guest
sees this process's memory at the same addresses. Its first touch of a page maps a copy of the
host's, with the host mapping's permissions (in a call that touches many, a CHUNK at once); after a
call, the bytes the guest changed are written back and its copies dropped. So the param_t entries, tensors and
tables Python hands the native library serve the emulated one unchanged. The guest's layout tables
are checked against the native kernel's before it runs anything (kernel_abi's check, across ABIs).
The guest's own addresses are reserved in this process, so that no host memory can lie there.
"""

import bisect
import copy
import ctypes
import dataclasses
import functools
import importlib.metadata
import itertools
import os
import pathlib
import platform
import struct
import subprocess
import sys
import threading

from lowbit_optim import kernel_abi, kernel_build

RUNTIME = pathlib.Path(__file__).with_name("emulated_aarch64_runtime.c")
PAGE, CHUNK = 4096, 1 << 18  # a borrowed region: a page, or a CHUNK-aligned CHUNK of one host mapping
IMAGE_BASE = 0x1000_0000_0000  # the guest's code and data: far from where x86-64 Linux maps a process
STACK, STACK_BYTES = 0x1001_0000_0000, 1 << 20
GUEST_END = STACK + STACK_BYTES  # [IMAGE_BASE, GUEST_END) is the guest's, reserved in this process
RETURN = "lowbit_emulation_return"
TIMEOUT_S = 300  # one call; a test's take well under a second
# -march=native: the host's CPU (and kernel_build.tuning(), x86 only, is left out too); -fopenmp:
# zig ships no OpenMP runtime; -fPIC -shared: the guest is a static executable
_NATIVE_ONLY = {"-march=native", "-fopenmp", "-fPIC", "-shared"}


@dataclasses.dataclass(frozen=True)
class CPU:
    """An aarch64 CPU to build the kernel for (``-mcpu=name``) and emulate, with SVE's vectors of
    ``sve_bits`` (a build with SVE compiles vector-length-agnostic loops: Graviton3's cores have
    256-bit vectors, Graviton4's 128)."""

    name: str
    sve_bits: int = 256


@functools.cache
def unavailable() -> str | None:
    """Why the emulated kernel cannot run here, or None."""
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform != "linux":
        return "the emulation runs on x86-64 Linux (it reads /proc/self/mem and calls libm.so.6)"
    try:
        import numpy  # noqa: F401
        import unicorn  # noqa: F401
        import ziglang  # noqa: F401
    except ImportError as error:
        return f"{error.name} is not installed (pip install ziglang unicorn numpy, or the test extra)"
    return None


def _commands(cpu: str, kernel: str, runtime: str, output: str) -> list[list[str]]:
    """The compiler commands that build the guest executable ``output`` for ``-mcpu=cpu``."""
    flags = [f for f in kernel_build.FLAGS if f not in _NATIVE_ONLY] + kernel_build.defines()
    zig = [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-musl", f"-mcpu={cpu}"]
    return [
        [*zig, "-c", "-x", "c", str(kernel_build.MAIN_SOURCE), f"-I{kernel_build.SOURCE_DIR}", *flags, "-o", kernel],
        [*zig, "-c", "-O2", "-ffreestanding", "-fno-builtin", str(RUNTIME), "-o", runtime],
        [*zig, "-nostdlib", "-static", f"-Wl,--image-base={IMAGE_BASE:#x}", f"-Wl,-e,{RETURN}", kernel, runtime, "-o", output],
    ]


def build(cpu: str) -> str:
    """The kernel as a static aarch64 executable for ``-mcpu=cpu``, cached beside the native one
    under a key of every source, the commands and zig's version."""
    digest = kernel_build.sources_digest(RUNTIME)
    digest.update(repr([_commands(cpu, "k", "r", "o"), importlib.metadata.version("ziglang")]).encode())
    path = kernel_build.cache_dir() / f"fused_step_aarch64_{cpu}_{digest.hexdigest()[:16]}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        kernel, runtime, partial = (path.with_name(f"{path.name}.{os.getpid()}.{name}") for name in ("kernel.o", "runtime.o", "tmp"))
        try:
            for argv in _commands(cpu, str(kernel), str(runtime), str(partial)):
                result = subprocess.run(argv, capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    raise OSError(f"{' '.join(argv)} failed:\n{result.stderr.strip()}")
            partial.replace(path)  # atomic: concurrent test workers never load a half-written file
        finally:
            for intermediate in (kernel, runtime, partial):
                intermediate.unlink(missing_ok=True)
    return str(path)


class Executable:
    """A static aarch64 ELF executable: its loadable segments, symbols and constructors."""

    def __init__(self, path: str):
        data = pathlib.Path(path).read_bytes()
        if data[:5] != b"\x7fELF\x02" or struct.unpack_from("<HH", data, 16) != (2, 183):  # 64-bit, ET_EXEC, EM_AARCH64
            raise ValueError(f"{path} is not a 64-bit aarch64 executable")
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
                    name, info, _, index, value, _ = struct.unpack_from("<IBBHQQ", data, offset + j * 24)
                    if index and value and info >> 4 == 1:  # defined, global
                        self.symbols[names[name : names.index(b"\0", name)].decode()] = value


class HostMaps:
    """This process's mappings (/proc/self/maps): read when an address is not in the last reading."""

    def __init__(self):
        self.starts, self.ends, self.permissions = [], [], []

    def find(self, address: int) -> tuple[int, int, str] | None:
        """(start, end, permissions) of the readable mapping that holds ``address``, or None. A
        reading that has it unreadable is read again too: malloc's arenas of other threads reserve
        address space unreadable and make it readable as they grow (the suite failed once on such a
        page, its cached permissions stale)."""
        for fresh in (False, True):
            if fresh:
                self._read()
            i = bisect.bisect_right(self.starts, address) - 1
            if i >= 0 and address < self.ends[i] and self.permissions[i][0] == "r":
                return self.starts[i], self.ends[i], self.permissions[i]
        return None

    def _read(self) -> None:
        self.starts, self.ends, self.permissions = [], [], []
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, permissions = line.split()[:2]
                start, end = (int(x, 16) for x in span.split("-"))
                self.starts.append(start)
                self.ends.append(end)
                self.permissions.append(permissions)


@functools.cache
def _reserve_guest_addresses() -> None:
    """Map [IMAGE_BASE, GUEST_END) inaccessible in this process, so that no host memory lies where
    the guest's own does (mmap fails if anything is there already)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    private_anonymous_noreserve_fixed_noreplace = 0x02 | 0x20 | 0x4000 | 0x100000
    got = libc.mmap(IMAGE_BASE, GUEST_END - IMAGE_BASE, 0, private_anonymous_noreserve_fixed_noreplace, -1, 0)
    if got != IMAGE_BASE:
        raise OSError(f"cannot reserve the guest's addresses {IMAGE_BASE:#x}..{GUEST_END:#x} in this process: {os.strerror(ctypes.get_errno())}")


class Guest:
    """The executable in an emulated aarch64 CPU that borrows this process's memory (module doc)."""

    def __init__(self, path: str, sve_bits: int):
        from unicorn import UC_ARCH_ARM64, UC_HOOK_INTR, UC_HOOK_MEM_UNMAPPED, UC_MODE_ARM, Uc, arm64_const

        self.regs = r = arm64_const
        self.executable = Executable(path)
        self.uc = Uc(UC_ARCH_ARM64, UC_MODE_ARM)
        self.uc.ctl_set_cpu_model(r.UC_CPU_ARM64_MAX)
        _reserve_guest_addresses()
        for address, contents, memory_bytes in self.executable.segments:
            low, high = address // PAGE * PAGE, -(-(address + memory_bytes) // PAGE) * PAGE
            self.uc.mem_map(low, high - low)
            self.uc.mem_write(address, contents)
        self.uc.mem_map(STACK, STACK_BYTES)
        # FP, SIMD and SVE on (CPACR_EL1.FPEN, .ZEN; CPTR_EL3.EZ), SVE's vector length (ZCR_ELx.LEN)
        self.uc.reg_write(r.UC_ARM64_REG_CPACR_EL1, 3 << 20 | 3 << 16)
        self.uc.reg_write(r.UC_ARM64_REG_CP_REG, (1, 1, 3, 6, 2, 1 << 8))  # (crn, crm, op0, op1, op2, value)
        for op1 in (0, 4, 6):  # EL1, EL2, EL3
            self.uc.reg_write(r.UC_ARM64_REG_CP_REG, (1, 2, 3, op1, 0, sve_bits // 128 - 1))
        self.uc.hook_add(UC_HOOK_MEM_UNMAPPED, self._borrow)
        self.uc.hook_add(UC_HOOK_INTR, self._host_call)
        self.borrowed: dict[int, tuple[bytes, bool]] = {}  # start -> the host's bytes when borrowed, writable
        self.borrowed_pages: set[int] = set()
        self.maps, self.lock = HostMaps(), threading.Lock()
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
        """unicorn's hook for a touch of unmapped memory: map a copy of this process's memory there."""
        from unicorn import UC_PROT_READ, UC_PROT_WRITE

        for page in range(address // PAGE * PAGE, address + max(size, 1), PAGE):
            if page in self.borrowed_pages:
                continue
            if IMAGE_BASE <= page < GUEST_END:
                self.error = f"the guest touched {address:#x}, its own unmapped memory (a stack overflow?)"
                return False
            mapping = self.maps.find(page)
            if mapping is None:
                self.error = f"the guest touched {address:#x}, which this process has not mapped readable"
                return False
            start, end, permissions = mapping
            # a page, or once a call has borrowed many, the rest of its chunk: unicorn's mem_map slows
            # with the number of regions mapped (thousands of pages: minutes), and copies cost little
            chunk = CHUNK if len(self.borrowed_pages) >= CHUNK // PAGE else PAGE
            low, high = page, page + PAGE  # grown within the chunk and the mapping, around borrowed pages
            while low - PAGE >= max(start, page // chunk * chunk) and low - PAGE not in self.borrowed_pages:
                low -= PAGE
            while high + PAGE <= min(end, page // chunk * chunk + chunk) and high not in self.borrowed_pages:
                high += PAGE
            try:  # /proc/self/mem: a page unmapped since is an error, not a crash of this process
                contents = os.pread(self.memory, high - low, low)
            except OSError as error:
                self.error = f"the guest touched {address:#x}, which this process cannot read ({error})"
                return False
            writable = permissions[1] == "w"
            uc.mem_map(low, high - low, UC_PROT_READ | (UC_PROT_WRITE if writable else 0))
            uc.mem_write(low, contents)
            self.borrowed[low] = (contents, writable)
            self.borrowed_pages.update(range(low, high, PAGE))
        return True

    def _host_call(self, uc, interrupt, data) -> None:
        """unicorn's hook for an exception: the runtime's svc asks for powf, exp or log (x8)."""
        r = self.regs
        which = uc.reg_read(r.UC_ARM64_REG_X8)
        if interrupt != 2 or which not in self.host_functions:  # 2: EXCP_SWI, an svc
            self.error = f"exception {interrupt} (x8 = {which}) at {uc.reg_read(r.UC_ARM64_REG_PC):#x}"
            uc.emu_stop()
            return
        x, y = (struct.unpack("<d", struct.pack("<Q", uc.reg_read(reg)))[0] for reg in (r.UC_ARM64_REG_D0, r.UC_ARM64_REG_D1))
        uc.reg_write(r.UC_ARM64_REG_D0, struct.unpack("<Q", struct.pack("<d", self.host_functions[which](x, y)))[0])

    def run(self, address: int, integers=(), floats=()) -> int:
        """Call the function at ``address`` with its integer and pointer arguments (x0..x7) and fp32
        ones (s0..s7), then write what it changed back into this process; returns x0."""
        import numpy as np

        r, uc = self.regs, self.uc
        if len(integers) > 8 or len(floats) > 8:
            raise TypeError("arguments beyond the registers are not passed")
        with self.lock:
            for i, value in enumerate(integers):
                uc.reg_write(getattr(r, f"UC_ARM64_REG_X{i}"), value & (2**64 - 1))
            for i, value in enumerate(floats):  # rounded as ctypes rounds a c_float argument
                uc.reg_write(getattr(r, f"UC_ARM64_REG_D{i}"), struct.unpack("<I", bytes(ctypes.c_float(value)))[0])
            uc.reg_write(r.UC_ARM64_REG_SP, STACK + STACK_BYTES)
            stop = self.executable.symbols[RETURN]
            uc.reg_write(r.UC_ARM64_REG_LR, stop)
            self.error = None
            try:
                uc.emu_start(address, stop, timeout=TIMEOUT_S * 10**6)
                if self.error is None and uc.reg_read(r.UC_ARM64_REG_PC) != stop:
                    self.error = f"stopped at {uc.reg_read(r.UC_ARM64_REG_PC):#x} (after {TIMEOUT_S} s?)"
            except Exception as error:  # noqa: BLE001 - unicorn's UcError; the hook's reason is the news
                self.error = f"{error}" + (f": {self.error}" if self.error else "")
            try:
                if self.error is None:
                    for start, (before, writable) in self.borrowed.items():
                        if not writable:  # (the guest could not write it)
                            continue
                        after = np.frombuffer(bytes(uc.mem_read(start, len(before))), np.uint8)
                        changed = after != np.frombuffer(before, np.uint8)
                        if changed.any():  # only those bytes: the rest of a page may be Python's, changed since
                            np.ctypeslib.as_array((ctypes.c_uint8 * len(before)).from_address(start))[changed] = after[changed]
            finally:
                for start, (before, _) in self.borrowed.items():
                    uc.mem_unmap(start, len(before))
                self.borrowed, self.borrowed_pages = {}, set()
            if self.error is not None:
                raise RuntimeError(f"the emulated kernel failed: {self.error}")
            return uc.reg_read(r.UC_ARM64_REG_X0)

    def string(self, address: int) -> str:
        """The NUL-terminated string at ``address`` of the guest's memory."""
        data = b""
        while b"\0" not in data:
            data += bytes(self.uc.mem_read(address + len(data), PAGE - (address + len(data)) % PAGE))
        return data[: data.index(b"\0")].decode()


class Function:
    """One of the library's functions, called in the guest with the native one's ctypes prototype."""

    def __init__(self, guest: Guest, address: int, native):
        self.guest, self.address = guest, address
        if native.argtypes is None:
            raise TypeError("the emulated library needs the function's argtypes (kernel_abi declares them)")
        self.argtypes, self.restype = native.argtypes, native.restype
        if ctypes.c_double in self.argtypes or self.restype in (ctypes.c_float, ctypes.c_double):
            raise TypeError("the emulated library passes fp32 arguments only and returns integers (Guest.run)")

    def __call__(self, *args):
        integers, floats = [], []
        for value, kind in zip(args, self.argtypes, strict=True):
            if kind is ctypes.c_float:
                floats.append(float(value.value if isinstance(value, ctypes.c_float) else value))
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
    if isinstance(value, (ctypes.c_int8, ctypes.c_int16, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64)):
        return value.value
    if isinstance(value, (ctypes.Array, ctypes.Structure)):
        return ctypes.addressof(value)
    return ctypes.cast(value, ctypes.c_void_p).value or 0  # pointers, byref(x[, offset]), c_void_p


class Library:
    """Stands in for the native kernel's ctypes library: the same functions, run in the guest."""

    def __init__(self, guest: Guest, native: ctypes.CDLL):
        self._guest, self._native = guest, native

    def __getattr__(self, name: str) -> Function:
        if name not in self._guest.executable.symbols:
            raise AttributeError(f"the aarch64 build has no function {name}")
        return Function(self._guest, self._guest.executable.symbols[name], getattr(self._native, name))


def _rows(call, read, strings: int, width: int) -> list[tuple]:
    """Every row of a layout table: ``call(i, *addresses of the outputs)`` returns 0 past the end; the
    first ``strings`` outputs are char pointers, read by ``read`` (kernel_abi's own reader takes them
    as c_char_p, which would dereference the guest's addresses in this process)."""
    rows, outs = [], [ctypes.c_uint64() for _ in range(width)]
    while ctypes.c_int32(call(len(rows), *(ctypes.addressof(o) for o in outs)) & 0xFFFFFFFF).value:
        rows.append(tuple(read(o.value) if i < strings else o.value for i, o in enumerate(outs)))
    return rows


@functools.cache
def kernel(cpu: CPU) -> kernel_abi.Kernel:
    """The native kernel's Kernel (structures, kinds, optimizers) with the emulated library, once
    the guest's layout tables (every field's offset and size, the kinds, limits and optimizers) are
    found to be the native ones: a LayoutMismatch names the first row that differs."""
    native, why = kernel_abi.load()
    if native is None:
        raise RuntimeError(f"no native kernel to compare with: {why}")
    guest = Guest(build(cpu.name), cpu.sve_bits)
    for name, (strings, integers) in kernel_abi.TABLES.items():
        width = strings + integers
        prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * width)  # the outputs by address
        ours = _rows(prototype(ctypes.cast(getattr(native.lib, name), ctypes.c_void_p).value), lambda a: ctypes.string_at(a).decode(), strings, width)
        theirs = _rows(lambda *a, name=name: guest.run(guest.executable.symbols[name], a), guest.string, strings, width)
        for i, (a, b) in enumerate(itertools.zip_longest(ours, theirs)):
            if a != b:
                raise kernel_abi.LayoutMismatch(f"{name}'s row {i} is {a} in the native kernel, {b} in the aarch64 build for {cpu.name}")
    emulated = copy.copy(native)
    emulated.lib = Library(guest, native.lib)
    return emulated
