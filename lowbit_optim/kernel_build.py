"""Building the fused CPU kernel (csrc/) once per machine.

It is compiled with the system's C compiler ($CC, which may carry a launcher or arguments as make's
does, "ccache gcc"; else the first of gcc, cc, clang, $CXX, g++, c++),
for this CPU (-march=native), and cached beside inductor's cache under a key of every source file,
the compiler, the flags and the CPU's features (its /proc/cpuinfo flags and what -march=native
enables): an edited header, another flag or another CPU sharing the cache directory builds anew. A
cached library is loaded only if its bytes are those the build wrote (a sha256 beside it): a file
cut short by a crash or a copy is built again, never mapped (which killed the process with SIGBUS).
"""

import contextlib
import errno
import functools
import hashlib
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading

from . import affine_codes, precision, quant, stochastic_bf16

SOURCE_DIR = pathlib.Path(__file__).parent / "csrc"
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # an OSError's errno where the cache cannot be written
MAIN_SOURCE = SOURCE_DIR / "fused_step.c"  # the one translation unit; it includes the others
# -ffp-contract=off: no FMA contraction, so the kernel rounds as the compiled step does
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
BUILD_TIMEOUT_S = 300  # a build takes seconds; a compiler that hangs must not hang the first step


class NoCompiler(OSError):
    """No C compiler: the kernel is simply unavailable (not a failure worth a warning)."""


def compiler() -> tuple[str, ...] | None:
    """The compiler's command, its program a path: $CC where it is set, split as a shell splits it
    ("ccache gcc", "gcc -m64"; one word where the whole of it names a program, as a path with a
    space may), None where its first word names no executable (an OSError where a quote is not
    closed); else the first found of gcc, cc, clang, $CXX, g++ and c++."""
    cc = os.environ.get("CC")
    if cc:
        whole = shutil.which(cc)
        if whole:
            return (whole,)
        try:
            words = shlex.split(cc)
        except ValueError as error:
            raise OSError(f"CC={cc!r} cannot be split as a shell splits it ({error}): fix its quotes, or unset CC to use gcc, cc or clang") from None
        program = shutil.which(words[0]) if words else None
        return (program, *words[1:]) if program else None
    found = (shutil.which(name) for name in ("gcc", "cc", "clang", os.environ.get("CXX"), "g++", "c++") if name)
    path = next((p for p in found if p), None)
    return (path,) if path else None


def cache_dir() -> pathlib.Path:
    try:  # beside inductor's cache, so an empty TORCHINDUCTOR_CACHE_DIR means a cold start for both
        from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

        return pathlib.Path(inductor_cache_dir()) / "lowbit_optim"
    except Exception:  # noqa: BLE001 - a private helper; any failure just means our own directory
        return pathlib.Path(tempfile.gettempdir()) / "lowbit_optim"


def defines() -> list[str]:
    """Constants the C takes from the Python that defines the numbers, so the two cannot drift apart
    (being part of the build command, they are part of the cache key)."""
    return [
        f"-DDITHER_DROPPED_BITS={quant.DITHER_DROPPED_BITS}",
        f"-DDITHER_PLACE={quant.DITHER_PLACE:#x}u",
        f"-DDITHER_SALT={quant.DITHER_SALT:#x}u",
        f"-DAFFINE_SMALLEST=((float){affine_codes.SMALLEST!r})",
        f"-DMIN_BLOCK_SCALE=((float){quant.MIN_BLOCK_SCALE!r})",  # rounded from double as torch's clamp rounds it
        f"-DCORRECTION_UNITS_PER_ULP=((float){precision.CORRECTION_UNITS_PER_ULP!r})",
        f"-DBF16_SR_HASH_BLOCK={stochastic_bf16.HASH_BLOCK}",
        f"-DBF16_SR_WRITES_MIX={stochastic_bf16.WRITES_MIX:#x}u",
        f"-DBF16_SR_BLOCK_MIX={stochastic_bf16.BLOCK_MIX:#x}u",
        f"-DLOG_THRESHOLD_BITS={quant.LOG_THRESHOLD_BITS}",
    ]


@functools.cache
def _first_processor() -> dict[str, str]:
    """/proc/cpuinfo's fields of its first processor, read once ({} where there is no such file)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if not key.strip():  # the blank line after the first processor
                    break
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpuinfo_field(name: str) -> str | None:
    """A field of /proc/cpuinfo's first processor (None where there is none)."""
    return _first_processor().get(name)


def tuning() -> list[str]:
    """Choices of code path by the CPU where measurement decided them (the C's defaults elsewhere):
    FAST_DIVIDER (csrc/divide.h) on AMD's family 26 (Zen 5) and family 25 with AVX-512 (Zen 4),
    whose dividers keep up with a real division where other cores take a multiplication and an FMA
    correction (Zen 3, family 25 without AVX-512, has not been measured). An explicit -D in FLAGS
    comes later on the command line and wins."""
    if cpuinfo_field("vendor_id") != "AuthenticAMD":
        return []
    family, flags = cpuinfo_field("cpu family"), (cpuinfo_field("flags") or "").split()
    if family == "26" or family == "25" and "avx512f" in flags:
        return ["-DFAST_DIVIDER=1"]
    return []


def flags() -> list[str]:
    """Every flag of the build, in order: the CPU's tuning first, so that a -D in FLAGS overrides it."""
    return [*tuning(), *FLAGS, *defines()]


def sources() -> list[pathlib.Path]:
    """Every file the build reads (not an editor's lock or backup file, .#x.h)."""
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h") and not p.name.startswith("."))


def _machine_key(cc: tuple[str, ...]) -> str:
    """-march=native: a library built on one CPU may not run on another sharing the cache directory.
    The CPU's flags where /proc/cpuinfo has them (x86; aarch64's say Features) and the macros the
    compiler defines for this CPU (every architecture: what -march=native turns on)."""
    return " ".join([os.uname().machine, cpuinfo_field("flags") or cpuinfo_field("Features") or "", native_macros(cc)])


@functools.cache
def native_macros(cc: tuple[str, ...]) -> str:
    """A sha256 of the macros ``cc -march=native`` predefines here (__AVX512F__, __ARM_FEATURE_SVE, ...)."""
    try:
        target = _run([*cc, "-march=native", "-dM", "-E", "-x", "c", os.devnull]).stdout
    except FileNotFoundError:  # (then the build itself says what is wrong)
        target = ""
    return hashlib.sha256(target.encode()).hexdigest()


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` run to its end, or stopped with everything it started after BUILD_TIMEOUT_S (an
    OSError saying so): a compiler that hangs must not hang the first step."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)  # its own session: the compiler's children too
            process.communicate()
            raise OSError(f"{argv[0]} did not finish in {BUILD_TIMEOUT_S} s (a build takes seconds): {' '.join(argv)}") from None
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def sources_digest(*extra: pathlib.Path):
    """A sha256 of every file the build reads (and ``extra`` files), names and contents, to which a
    cache key adds how it is built."""
    digest = hashlib.sha256()
    for source in [*sources(), *extra]:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest


def library_path(cc: tuple[str, ...]) -> pathlib.Path:
    """Where the library built by ``cc`` with FLAGS lies in the cache: its name is a hash of every
    source file, the compiler, the flags and this CPU's features."""
    digest = sources_digest()
    digest.update(" ".join([*cc, *flags(), _machine_key(cc)]).encode())
    return cache_dir() / f"fused_step_{digest.hexdigest()[:16]}.so"


def command(cc: tuple[str, ...], source: pathlib.Path, output: pathlib.Path) -> list[str]:
    """The compiler command that builds ``source`` (the kernel, or a file that includes it: its
    headers are found in SOURCE_DIR) into the shared library ``output``, as the kernel is built."""
    return [*cc, "-x", "c", str(source), f"-I{SOURCE_DIR}", *flags(), "-o", str(output), "-lm"]


def build() -> pathlib.Path:
    """The path of the compiled library, built unless cached intact. Raises OSError saying why it
    failed (NoCompiler where there is no compiler at all)."""
    cc = compiler()
    if cc is None and os.environ.get("CC"):
        raise OSError(f"CC={os.environ['CC']!r} names no executable compiler (its first word a program found on PATH): fix it, or unset CC to use gcc, cc or clang")
    if cc is None:
        raise NoCompiler("no C compiler was found to build it (install gcc or set CC; torch.compile's CPU step needs one too: without any, steps run eagerly)")
    path = library_path(cc)
    if not _intact(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # its own, in any process or thread
        argv = command(cc, MAIN_SOURCE, partial)
        try:
            result = _run(argv)
            if result.returncode != 0:
                raise OSError(f"{' '.join(argv)} failed:\n{result.stderr.strip()}")
            if not partial.is_file() or partial.stat().st_size == 0:  # (CC=true: a program that compiles nothing)
                raise OSError(f"{' '.join(argv)} exited 0 but wrote no library: CC={shlex.join(cc)!r} is no C compiler; fix it, or unset CC to use gcc, cc or clang")
        except OSError:
            with contextlib.suppress(OSError):  # (in a read-only cache: the compiler's own error says so)
                partial.unlink(missing_ok=True)
            raise
        with open(partial, "rb") as written:  # on disk before it is named: a crash leaves no short file under the name
            os.fsync(written.fileno())
        _digest_path(path).write_text(_sha256(partial))
        os.replace(partial, path)  # atomic: concurrent processes never load a half-written file
    return path


def _digest_path(library: pathlib.Path) -> pathlib.Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(library: pathlib.Path) -> bool:
    """Whether the cached ``library`` holds the bytes its build wrote (the sha256 beside it):
    mapping a file cut short kills the process (SIGBUS), a garbage one never loads."""
    try:
        return _digest_path(library).read_text().strip() == _sha256(library)
    except OSError:  # (either missing: not built here, or by a version that wrote no digest)
        return False
