"""The fused CPU kernel: every parameter's Adam step in one C call, one pass over memory.

The compiled step (functional.adam_step under torch.compile) defines the numerics and serves every
device and format. On the CPU, inductor turns it into several passes (moments, block absmax,
encoding) with scalar table gathers; csrc/fused_adam_cpu.c computes the same numbers in one pass
per chunk of blocks, for plain fp32/bf16 states and every format that declares a kernel layout
(``StateTensor.kernel_layout``: codebook formats that keep CodebookState's encoding, FP8 e4m3,
factored): this module only marshals what the formats declare. Factored states it steps with one difference: it sums rows and columns in double, in its own order, so their
sums can differ from the compiled step's in the last bit (the compiled step sums fp32 in inductor's
order). Anything else (a format with its own encoding, stochastic / Kahan / int8-correction
parameter updates) takes the compiled step.

The C file is compiled once per machine with the compiler torch.compile uses, cached next to
inductor's cache, and called through ctypes: the core package still needs nothing but torch.
"""

import ctypes
import functools
import hashlib
import math
import os
import pathlib
import shutil
import subprocess
import tempfile
import warnings

import torch
from torch import Tensor

from .factored import FactoredState
from .state import OptimState, StateTensor, describe_tensor

SOURCE = pathlib.Path(__file__).parent / "csrc" / "fused_adam_cpu.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]

KIND_F32, KIND_BF16, KIND_CODEBOOK, KIND_E4M3, KIND_FACTORED = range(5)
_PLAIN_KINDS = {torch.float32: KIND_F32, torch.bfloat16: KIND_BF16}


class _State(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("bits", ctypes.c_int32),
        ("block_size", ctypes.c_int64),
        ("scale_max", ctypes.c_float),
        ("data", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("codebook", ctypes.c_void_p),
        ("base_code", ctypes.c_void_p),
        ("threshold", ctypes.c_void_p),
        ("thresholds", ctypes.c_void_p),
        ("nan_code", ctypes.c_int32),
        ("near_code", ctypes.c_void_p),
        ("value_bytes", ctypes.c_void_p),
        ("calibrated", ctypes.c_int32),
        ("col", ctypes.c_void_p),
        ("cols", ctypes.c_int64),
        ("col_scaled", ctypes.c_void_p),  # the kernel's, for one step
        ("zero", ctypes.c_float),
        ("col_sums", ctypes.c_void_p),
    ]


class _Param(ctypes.Structure):
    _fields_ = [
        ("numel", ctypes.c_int64),
        ("param_kind", ctypes.c_int32),
        ("grad_kind", ctypes.c_int32),
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("step", ctypes.c_void_p),
        ("exp_avg", _State),
        ("exp_avg_sq", _State),
        ("max_exp_avg_sq", _State),
    ]


class _Hyper(ctypes.Structure):
    _fields_ = [(name, ctypes.c_float) for name in ("lr", "beta1", "beta2", "weight_decay", "eps", "one_minus_beta1", "one_minus_beta2")] + [
        (name, ctypes.c_int32) for name in ("decoupled_weight_decay", "maximize", "amsgrad")
    ]


# ---- building the library ---------------------------------------------------------------------


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc", "clang", os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> pathlib.Path:
    try:  # beside inductor's cache, so an empty TORCHINDUCTOR_CACHE_DIR means a cold start for both
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return pathlib.Path(cache_dir()) / "lowbit_optim"
    except Exception:  # noqa: BLE001 - a private helper; any failure just means our own directory
        return pathlib.Path(tempfile.gettempdir()) / "lowbit_optim"


def _machine_key() -> str:
    # -march=native: a library built on one CPU may not run on another sharing the cache directory
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        return os.uname().machine


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the compiled kernel, None), or (None, why it is unavailable). Built on first use."""
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler was found to build it (set CC)"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, _machine_key()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"fused_adam_cpu_{key}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            command = [compiler, "-x", "c", str(SOURCE), *FLAGS, "-o", str(partial), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise OSError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
            os.replace(partial, path)  # atomic: concurrent processes never load a half-written file
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        why = f"building it failed ({error})"
        warnings.warn(f"lowbit_optim: the fused CPU kernel is unavailable, steps use torch.compile instead: {why}", stacklevel=2)
        return None, why
    lib.lowbit_adam_step.argtypes = [ctypes.POINTER(_Param), ctypes.c_int64, ctypes.POINTER(_Hyper), ctypes.c_int]
    lib.lowbit_adam_step.restype = ctypes.c_int
    lib.lowbit_max_chunk.restype = ctypes.c_int
    lib.lowbit_decode.argtypes = [ctypes.POINTER(_State), ctypes.c_int64, ctypes.c_void_p]
    lib.lowbit_encode.argtypes = [ctypes.POINTER(_State), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.lowbit_divide.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    return lib, None


def library() -> ctypes.CDLL | None:
    """The compiled kernel; None where it cannot be built (``unsupported_reason`` says why)."""
    return _load()[0]


# ---- what the kernel can take ------------------------------------------------------------------


def _kernel_kind(state: Tensor) -> int | None:
    """The kernel's name for how ``state`` is stored, or None if only the compiled step knows."""
    if not isinstance(state, StateTensor):
        return _PLAIN_KINDS.get(state.dtype) if state.is_contiguous() else None
    if isinstance(state, FactoredState):  # a row slice (part) reads its parent's columns: not here
        sums = (state.row, state.col)
        readable = state.dtype == torch.float32 and not state.part and all(t.dtype == torch.float32 and t.is_contiguous() for t in sums)
    else:
        readable = isinstance(state, OptimState) and state.codes.is_contiguous() and state.scale.is_contiguous()
    return _format_kind(type(state), state.signed) if readable else None


_LAYOUT_KINDS = {"codebook": KIND_CODEBOOK, "e4m3": KIND_E4M3, "factored": KIND_FACTORED}


@functools.cache
def _layout(cls, signed: bool):
    """The format's declared kernel layout (StateTensor.kernel_layout), cached: asked every step."""
    return cls.kernel_layout(signed)


def _format_kind(cls, signed: bool) -> int | None:
    """The kernel's name for a format whose codec it has (None for the others)."""
    layout = _layout(cls, signed)
    return None if layout is None else _LAYOUT_KINDS.get(layout.kind)


def unsupported_reason(param: Tensor, grad: Tensor, step: Tensor, states: dict, param_update: str) -> str | None:
    """Why the fused kernel cannot step this parameter (None if it can)."""
    lib, why = _load()
    if lib is None:
        return why
    if param.device.type != "cpu":
        return f"the parameter is on {param.device.type}, not the CPU"
    if param.dtype not in _PLAIN_KINDS or grad.dtype not in _PLAIN_KINDS:
        return f"parameter/gradient dtype {param.dtype}/{grad.dtype} (it takes float32 and bfloat16)"
    if not (param.is_contiguous() and grad.is_contiguous()) or grad.layout != torch.strided:
        return "a non-contiguous parameter or gradient"
    if step.dtype != torch.float32 or step.device.type != "cpu":
        return f"a step counter of dtype {step.dtype} on {step.device.type} (it takes a float32 CPU tensor)"
    if param_update != "nearest":
        return f"param_update={param_update!r} (it rounds bf16 parameters to nearest only)"
    for name, state in states.items():
        if getattr(state, "part", False):
            return f"the {name} state is a row slice of a larger factored state (it reads the larger one's columns)"
        if _kernel_kind(state) is None:
            return f"the {name} state {type(state).__name__} (a format with its own encoding)"
        if isinstance(state, OptimState) and state.block_size > lib.lowbit_max_chunk():
            return f"block_size {state.block_size} of the {name} state (at most {lib.lowbit_max_chunk()})"
    unit = chunk_unit(states.values())
    if unit > lib.lowbit_max_chunk():
        return (
            f"a factored state's rows of {max(s.col.numel() for s in states.values() if isinstance(s, FactoredState))} elements and the "
            f"other states' blocks meet only every {unit} elements (the kernel's chunks hold at most {lib.lowbit_max_chunk()})"
        )
    return None


def chunk_unit(states) -> int:
    """The fewest elements that are whole blocks of every blockwise state and whole rows of every
    factored one: the kernel's chunks are multiples of it (chunk_size in the C file)."""
    unit = 1
    for state in states:
        size = state.col.numel() if isinstance(state, FactoredState) else state.block_size if isinstance(state, OptimState) else 1
        unit = math.lcm(unit, max(size, 1))
    return unit


# ---- calling it --------------------------------------------------------------------------------

_MOMENT_NAMES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def check_inputs(param: Tensor, grad: Tensor, step: Tensor, moments, amsgrad: bool) -> None:
    """Raise a ValueError unless every tensor has the size, dtype and layout the kernel assumes: it
    reads and writes them through raw pointers, unchecked, so a corrupt state or a gradient of
    another size would corrupt memory."""
    problem = _input_problem(param, grad, step, moments, amsgrad)
    if problem:
        raise ValueError(f"the fused CPU kernel cannot step a parameter of shape {tuple(param.shape)}: its {problem}")


def _input_problem(param: Tensor, grad: Tensor, step: Tensor, moments, amsgrad: bool) -> str | None:
    # attribute checks only: this runs for every parameter at every step
    numel = param.numel()
    if not _plain_fits(param, numel):
        return f"values are {describe_tensor(param)}, not contiguous float32 or bfloat16 values on the CPU"
    if not _plain_fits(grad, numel):
        return f"gradient is {describe_tensor(grad)}, not {numel} contiguous float32 or bfloat16 values on the CPU"
    if step.dtype != torch.float32 or not step.is_cpu or step.numel() != 1:
        return f"step counter is {describe_tensor(step)}, not one float32 value on the CPU"
    if amsgrad and moments[2] is None:
        return "max_exp_avg_sq state is missing (amsgrad=True needs it)"
    for name, state in zip(_MOMENT_NAMES, moments):
        if state is None:
            continue
        if not isinstance(state, StateTensor):
            if not _plain_fits(state, numel):
                return f"{name} state is {describe_tensor(state)}, not {numel} contiguous float32 or bfloat16 values on the CPU"
            continue
        try:
            state.check_layout()
        except ValueError as error:
            return f"{name} state: {error}"
        if not state.is_cpu or state.numel() != numel:
            return f"{name} state is {state!r}, not a state of {numel} elements on the CPU"
    return None


def _plain_fits(t: Tensor, numel: int) -> bool:
    return t.dtype in _PLAIN_KINDS and t.is_contiguous() and t.is_cpu and t.numel() == numel


def _describe(state: Tensor | None) -> _State:
    if state is None:
        return _State(kind=KIND_F32)
    if isinstance(state, FactoredState):
        return _State(kind=KIND_FACTORED, data=state.row.data_ptr(), col=state.col.data_ptr(), cols=state.col.numel())
    if not isinstance(state, OptimState):
        return _State(kind=_kernel_kind(state), data=state.data_ptr())
    described = _State.from_buffer_copy(_format_description(type(state), state.signed))
    described.block_size = state.block_size
    described.data = state.codes.data_ptr()
    described.scale = state.scale.data_ptr()
    return described


@functools.cache
def _format_description(cls, signed: bool) -> _State:
    """What the kernel needs of a format (its kind, constants and tables), built once: a step only
    adds each state's block size and pointers."""
    kind = _format_kind(cls, signed)
    described = _State(kind=kind, bits=cls.bits, scale_max=cls.scale_max, calibrated=cls.calibrated(signed))
    if kind == KIND_CODEBOOK:
        tables = _layout(cls, signed).tables
        described.codebook = tables["codebook"].data_ptr()
        described.base_code = _int32_base_code(cls, signed).data_ptr()
        described.threshold = tables["threshold"].data_ptr()
        thresholds, described.nan_code = _search_thresholds(cls, signed)
        described.thresholds = thresholds.data_ptr()
        if cls.bits == 8:
            described.near_code = _near_code_table(cls, signed).data_ptr()
            described.value_bytes = _value_bytes(cls, signed).data_ptr()
    return described


@functools.cache
def _search_thresholds(cls, signed: bool) -> tuple[Tensor, int]:
    """A codebook's sorted decision thresholds, NaN-padded to 2**bits (NaN is never <= a value),
    and the code of NaN: what the kernel's binary search needs to give the lookup tables' codes."""
    thresholds = _layout(cls, signed).tables["decision_thresholds"]
    padded = torch.full((2**cls.bits,), math.nan, dtype=torch.float32)
    padded[: thresholds.numel()] = thresholds
    nan_code = int(cls.encode(torch.tensor([math.nan], dtype=torch.float32), signed)[0])
    return padded, nan_code


@functools.cache
def _near_code_table(cls, signed: bool) -> Tensor:
    """The nearest-code tables (base_code, threshold) packed into one int32 per key (a value's top 16
    bits, sign included), so that one gather and one comparison find a code.

    Entry = base | (limit - 1) << 16: the code is base + 1 where the value's low 16 bits, complemented
    for negative values (whose order they reverse), reach limit. The kernel compares them, shifted up
    by 16, with the entry as a whole (unsigned) and takes the low byte of entry + 1 or entry. No
    threshold in the bucket: limit = 2**16 (never reached); limit 0 (always reached) is stored as
    base + 1 with limit 2**16. NaN and infinities get nan_code.
    """
    tables = _layout(cls, signed).tables
    base, threshold = tables["base_code"].to(torch.int64), tables["threshold"]
    keys = torch.arange(2**16)
    low = threshold.view(torch.int32).to(torch.int64) & 0xFFFF
    low = torch.where(keys >= 2**15, 0xFFFF - low, low)  # negative values: a larger value has smaller low bits
    limit = torch.where(threshold.isnan(), 2**16, low)
    base, limit = torch.where(limit == 0, base + 1, base), torch.where(limit == 0, 2**16, limit)
    non_finite = (keys & 0x7FFF) >= 0x7F80
    base, limit = torch.where(non_finite, _search_thresholds(cls, signed)[1], base), torch.where(non_finite, 2**16, limit)
    assert int(base.max()) <= 255
    return (base | (limit - 1) << 16).to(torch.int32)  # wraps to int32: the kernel compares unsigned


@functools.cache
def _value_bytes(cls, signed: bool) -> Tensor:
    """The codebook's values byte by byte ([k, code]: byte k of code's fp32 value), for the kernel's
    gather-free decoding of 8-bit codes."""
    return _layout(cls, signed).tables["codebook"].view(torch.uint8).view(-1, 4).t().contiguous()


@functools.cache
def _int32_base_code(cls, signed: bool) -> Tensor:
    # the scalar loops' table (the vector loops use _near_code_table)
    return _layout(cls, signed).tables["base_code"].to(torch.int32)


def adam_step(items: list[tuple], group: dict) -> None:
    """Step every (param, grad, step, exp_avg, exp_avg_sq, max_exp_avg_sq or None) of ``group``
    (local, contiguous tensors that unsupported_reason accepts) in one kernel call. Steps are
    counted like the compiled step."""
    params = (_Param * len(items))()
    for entry, (param, grad, step, exp_avg, exp_avg_sq, max_exp_avg_sq) in zip(params, items):
        check_inputs(param, grad, step, (exp_avg, exp_avg_sq, max_exp_avg_sq), group["amsgrad"])
        entry.numel = param.numel()
        entry.param_kind = _PLAIN_KINDS[param.dtype]
        entry.grad_kind = _PLAIN_KINDS[grad.dtype]
        entry.param = param.data_ptr()
        entry.grad = grad.data_ptr()
        entry.step = step.data_ptr()
        entry.exp_avg = _describe(exp_avg)
        entry.exp_avg_sq = _describe(exp_avg_sq)
        entry.max_exp_avg_sq = _describe(max_exp_avg_sq)
    beta1, beta2 = group["betas"]
    hyper = _Hyper(
        lr=float(group["lr"]),
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        one_minus_beta1=1 - beta1,
        one_minus_beta2=1 - beta2,
        decoupled_weight_decay=group["decoupled_weight_decay"],
        maximize=group["maximize"],
        amsgrad=group["amsgrad"],
    )
    if library().lowbit_adam_step(params, len(items), ctypes.byref(hyper), torch.get_num_threads()) != 0:
        raise MemoryError("the fused CPU kernel could not allocate its work list or factored states' column sums (nothing was stepped)")
    # what an in-place aten op would do: autograd then catches a later backward through old values
    for param, _grad, step, *moments in items:
        for written in (param, step, *moments):
            if written is not None and not isinstance(written, StateTensor):
                torch.autograd.graph.increment_version(written)
