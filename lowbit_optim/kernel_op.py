"""``lowbit_optim::fused_step_cpu``: the fused CPU kernel as a torch op over plain tensors.

The op is a torch.library op, so dynamo never traces into it (a graph that calls it holds one node);
its schema declares what it mutates, and it bumps those tensors' version counters. It takes only
plain tensors: each state arrives as its inner tensors (a plain fp32/bf16 state as itself) and a
format key (``format_key``) naming its format and metadata. Before the C reads anything through raw
pointers, the op rebuilds each state, checks every tensor (``check_inputs``: the format's own
``check_layout``, dtypes, sizes, devices) and refuses bad input with a ValueError. It then describes
each state as the C's ``state_t`` from what its format declares (``StateTensor.kernel_layout``: the
codec's name and tables) and calls ``lowbit_step``. A parameter's states that passed are remembered
by what the checks read of them (``_Checked``), so that a later call given the same formats over
tensors of the same dtypes, shapes, layouts and addresses checks only the parameter, gradient and
counter, and copies the states' descriptions.

Arguments: ``optimizer`` (the kernel's name of an update, e.g. "adam"), ``hyper`` (its
hyper-parameters in its C struct's field order: ``hyper_values`` makes them from names), ``params``,
``grads``, ``steps`` (one each per parameter; an empty step tensor for a parameter without states
and counter), ``state_tensors`` (every given state's inner tensors, parameter by parameter, state by
state), ``state_formats`` (per parameter, one key per state the optimizer names: ABSENT, PLAIN or
a format key), ``corrections`` (none, or one per parameter: the int8-correction of a bf16
parameter, ``param_update="int8-correction"``, or an empty tensor) and ``addends`` (one per given
state with ``has_addend``, in the same order: its part outside the codes, StateTensor.kernel_addend,
which the kernel overwrites with the state's new values, leaving its codes as they were).
"""

import ctypes
import dataclasses
import functools
import math
import threading

import torch
from torch import Tensor

from . import affine_codes, kernel_abi
from .factored import FactoredState
from .state import OptimState, StateTensor, describe_tensor, storage_holds, storage_shortfall

ABSENT, PLAIN = 0, 1  # format keys of an absent state and of a plain fp32 / bf16 tensor
_PLAIN_KINDS = {torch.float32: "f32", torch.bfloat16: "bf16"}  # dtype -> the C's kind name

_formats: list = [None, None]  # format key -> (state class, its __tensor_flatten__ metadata)
_format_keys: dict = {}


def format_key(state: Tensor | None) -> int:
    """The op's key for how ``state`` is stored (registered on first sight)."""
    if state is None:
        return ABSENT
    if not isinstance(state, StateTensor):
        return PLAIN
    metadata = state.__tensor_flatten__()[1]
    # with the values' types: signed=1 equals True, and the op checks the state it rebuilds from the
    # metadata registered first, so one odd state must not stand for (nor be taken for) valid ones
    entry = (type(state), metadata, tuple(map(type, metadata)))
    key = _format_keys.get(entry)
    if key is None:
        key = _format_keys[entry] = len(_formats)
        _formats.append(entry[:2])
    return key


def kernel() -> kernel_abi.Kernel:
    """The loaded kernel, or a RuntimeError saying why there is none."""
    loaded, why = kernel_abi.load()
    if loaded is None:
        raise RuntimeError(f"the fused CPU kernel is unavailable: {why}")
    return loaded


def hyper_values(optimizer: str, hyper: dict) -> list[float]:
    """``hyper`` (field name -> number) as the op takes it: in the C struct's field order, exactly
    its fields (a ValueError names the missing and unknown ones)."""
    struct = _hyper_struct(kernel(), optimizer, hyper)
    return [float(getattr(struct, name)) for name, _ in struct._fields_]


def _hyper_struct(k: kernel_abi.Kernel, optimizer: str, values: dict):
    """k.hyper(optimizer, values), shared between calls with the same plain numbers (read only: the C
    takes it const). The step in backward calls the op once per parameter with the same numbers,
    and building and checking the structure cost about as much as the rest of a small call."""
    if all(type(v) in (bool, int, float) for v in values.values()):  # hashable, and nothing changes in place
        signs = tuple(math.copysign(1.0, v) for v in values.values()) if 0 in values.values() else ()  # -0.0 equals 0.0
        return _shared_hyper_struct(k, optimizer, tuple(values.items()), signs)
    return k.hyper(optimizer, values)


@functools.lru_cache(maxsize=64)
def _shared_hyper_struct(k: kernel_abi.Kernel, optimizer: str, items: tuple, signs: tuple):
    return k.hyper(optimizer, dict(items))  # signs: only in the cache's key


# ---- what the kernel can take --------------------------------------------------------------------


@functools.cache
def layout(cls, signed: bool):
    """The format's declared kernel layout (StateTensor.kernel_layout), cached: asked every step."""
    return cls.kernel_layout(signed)


@functools.cache
def format_kind(cls, signed: bool) -> str | None:
    """The kernel's kind (its codec's name) for a format, or None where it has no codec for it
    (cached: asked for every state at every step)."""
    declared = layout(cls, signed)
    if declared is None or (declared.stochastic and declared.kind != "codebook"):  # stochastic rounding: codebooks only
        return None
    # the C reads the inner tensors as the class that declares the layout stores them: a subclass that
    # stores them otherwise (float16 scales) is the compiled step's (the kernel would read past their ends)
    owner = next(k for k in cls.__mro__ if "kernel_layout" in vars(k) and issubclass(k, StateTensor))  # (not a mixin)
    if (cls.inner_names, cls.inner_dtypes) != (owner.inner_names, owner.inner_dtypes):
        return None
    return declared.kind if declared.kind in kernel().kinds else None


def kernel_kind(state: Tensor) -> str | None:
    """The kernel's kind for how ``state`` is stored, or None if only the compiled step knows."""
    if not isinstance(state, StateTensor):
        return _PLAIN_KINDS.get(state.dtype) if state.is_contiguous() else None
    for name in state.inner_names:
        if not getattr(state, name).is_contiguous():
            return None
    return _stored_kind(state)


def _stored_kind(state: StateTensor) -> str | None:
    # kernel_kind of a state whose inner tensors are contiguous
    if isinstance(state, FactoredState) and state.part:  # a row slice reads its parent's columns: not here
        return None
    return format_kind(type(state), state.signed)


# ---- checking what the C will read ------------------------------------------------------------------


def block_size_unsupported(block_size: int, whose: str = "") -> str | None:
    """Why the kernel cannot hold blocks of ``block_size`` elements (longer than its chunks), or None."""
    limit = kernel().limits["max_chunk"]
    return f"block_size {block_size}{whose} (at most {limit})" if block_size > limit else None


def state_unsupported(name: str, state: Tensor, contiguous: bool = False) -> str | None:
    """Why the kernel cannot hold ``state`` in its chunks (no codec for its format, blocks longer than
    a chunk), or None. ``contiguous``: its inner tensors are known to be (check_layout)."""
    if isinstance(state, FactoredState) and state.part:
        return f"the {name} state is a row slice of a larger factored state (it reads the larger one's columns)"
    if (_stored_kind(state) if contiguous else kernel_kind(state)) is None:
        if not isinstance(state, StateTensor):  # a plain state the user swapped in (the kernel's are fp32 or bf16)
            return f"the {name} state is {describe_tensor(state)} (the kernel's plain states are contiguous float32 or bfloat16)"
        return f"the {name} state {type(state).__name__} (a format with its own encoding or block scales)"
    if isinstance(state, OptimState) and (too_long := block_size_unsupported(state.block_size, f" of the {name} state")):
        return too_long
    if isinstance(state, StateTensor) and state.has_addend and _stored_kind(state) != "codebook":  # chunk_io.h adds it to codebook codes only
        return f"the {name} state keeps a part outside its {_stored_kind(state)} codes (the kernel takes one beside codebook codes only)"
    return None


def chunks_unsupported(states) -> str | None:
    """Why a parameter's states cannot share the kernel's chunks (they would overflow its buffers),
    or None."""
    unit, max_chunk = chunk_unit(states), kernel().limits["max_chunk"]
    if unit <= max_chunk:
        return None
    rows = max(s.col.numel() for s in states if isinstance(s, FactoredState))
    return f"a factored state's rows of {rows} elements and the other states' blocks meet only every {unit} elements (the kernel's chunks hold at most {max_chunk})"


def chunk_unit(states) -> int:
    """The fewest elements that are whole blocks of every blockwise state and whole rows of every
    factored one: the kernel's chunks are multiples of it (chunk_size in csrc/scheduler.h)."""
    unit = 1
    for state in states:
        if isinstance(state, StateTensor):  # plain states: any chunk
            unit = math.lcm(unit, max(state.col.numel() if isinstance(state, FactoredState) else state.block_size or 1, 1))  # bf16-sr: no blocks
    return unit


def check_inputs(param: Tensor, grad: Tensor, step: Tensor, states: dict, required=()) -> None:
    """Raise a ValueError unless every tensor has the size, dtype and layout the kernel assumes: it
    reads and writes them through raw pointers, unchecked, so a corrupt state or a gradient of
    another size would corrupt memory. ``states``: name -> state or None; ``required``: the names
    that must be given."""
    problem = _input_problem(param, grad, step, states, required)
    if problem:
        raise refused(param, problem)


def _input_problem(param: Tensor, grad: Tensor, step: Tensor, states: dict, required) -> str | None:
    # attribute checks only: this runs for every parameter at every step
    numel = param.numel()
    if not _plain_fits(param, numel):
        return f"its values are {describe_tensor(param)}, not contiguous float32 or bfloat16 values on the CPU"
    if not _plain_fits(grad, numel):
        return f"its gradient is {describe_tensor(grad)}, not {numel} contiguous float32 or bfloat16 values on the CPU"
    given = [s for s in states.values() if s is not None]  # a parameter with states counts its steps
    if not _counter_fits(step, bool(given)):
        return f"its step counter is {describe_tensor(step)}, not {'one float32 value' if given else 'empty (it has no states)'} on the CPU"
    for name in required:
        if states.get(name) is None:
            return f"its {name} state is missing"
    for name, state in states.items():
        if state is None:
            continue
        if not isinstance(state, StateTensor):
            if not _plain_fits(state, numel):
                return f"its {name} state is {describe_tensor(state)}, not {numel} contiguous float32 or bfloat16 values on the CPU"
            continue
        try:
            state.check_layout()
        except ValueError as error:
            return f"its {name} state: {error}"
        if not state.is_cpu or state.numel() != numel:
            return f"its {name} state is {state!r}, not a state of {numel} elements on the CPU"
        problem = state_unsupported(name, state, contiguous=True)
        if problem:
            return problem
    for what, t in tensors_of(param, grad, step, states):
        if not storage_holds(t):
            return f"the storage of its {what} {storage_shortfall(t)}"
    return chunks_unsupported(given)


def tensors_of(param: Tensor, grad: Tensor, step: Tensor, states: dict):
    """(what, tensor) for each tensor the C reads or writes of a parameter (``states``: name -> state or None)."""
    yield "values", param
    yield "gradient", grad
    yield "step counter", step
    for name, state in states.items():
        if isinstance(state, StateTensor):
            for inner in state.inner_names:
                yield f"{name} state's {inner}", getattr(state, inner)
        elif state is not None:
            yield f"{name} state", state


def check_correction(param: Tensor, correction: Tensor) -> None:
    """Raise a ValueError unless ``correction`` can be ``param``'s int8-correction (precision.py):
    the C reads and writes one int8 per element."""
    if (
        param.dtype != torch.bfloat16 or correction.dtype != torch.int8 or not correction.is_contiguous() or not correction.is_cpu
        or correction.numel() != param.numel()
    ):  # fmt: skip
        raise refused(
            param,
            f"its int8-correction is {describe_tensor(correction)} for {describe_tensor(param)}; it needs {param.numel()} "
            "contiguous int8 values on the CPU beside a bfloat16 parameter",
        )
    if not storage_holds(correction):
        raise refused(param, f"the storage of its int8-correction {storage_shortfall(correction)}")


def refused(param: Tensor, problem: str) -> ValueError:
    """The error that the kernel cannot step ``param``, for ``problem``."""
    return ValueError(f"the fused CPU kernel cannot step a parameter of shape {tuple(param.shape)}: {problem}")


def _plain_fits(t: Tensor, numel: int) -> bool:
    return t.dtype in _PLAIN_KINDS and t.is_contiguous() and t.is_cpu and t.numel() == numel


def _counter_fits(step: Tensor, counted: bool) -> bool:
    return step.dtype == torch.float32 and step.is_cpu and step.numel() == (1 if counted else 0)


# ---- describing states as the C's state_t ----------------------------------------------------------


def describe(k: kernel_abi.Kernel, state: Tensor | None):
    """``state`` as the C's state_t (absent: kind none)."""
    described = k.structs["state_t"]()
    if state is not None:
        with memoryview(described).cast("B") as buffer:
            _write_state(_writers(k), buffer, 0, k, state)
    return described


class _Writers:
    """Where the op writes a parameter's fields and its states' in the C's param_t array: one
    struct.pack per field or run of fields (kernel_abi.packer), several times faster than ctypes'
    setters over the few hundred parameters of a step."""

    def __init__(self, k: kernel_abi.Kernel):
        Param, State = k.structs["param_t"], k.structs["state_t"]
        self.param_size, self.state_size, self.states_at = ctypes.sizeof(Param), ctypes.sizeof(State), Param.state.offset
        self.param = kernel_abi.packer(Param, "numel", "param_kind", "grad_kind", "param", "grad", "step", "correction")
        self.block_size, self.data, self.scale, self.col, self.cols, self.writes, self.addend = (
            kernel_abi.packer(State, name) for name in ("block_size", "data", "scale", "col", "cols", "writes", "addend")
        )


@functools.cache
def _writers(k: kernel_abi.Kernel) -> _Writers:
    return _Writers(k)


def _write_state(w: _Writers, buffer, at: int, k: kernel_abi.Kernel, state: Tensor) -> None:
    """``state`` as the C's state_t into ``buffer`` at byte ``at``."""
    if not isinstance(state, StateTensor):
        buffer[at : at + w.state_size] = _plain_description(k, state.dtype)
        w.data.write(buffer, at, state.data_ptr())
    else:
        buffer[at : at + w.state_size] = _format_description(k, type(state), state.signed)
        kind = format_kind(type(state), state.signed)
        if kind in ("codebook", "e4m3", "block-float"):
            w.block_size.write(buffer, at, state.block_size)
            w.data.write(buffer, at, state.codes.data_ptr())
            w.scale.write(buffer, at, state.scale.data_ptr())
            if kind == "block-float":  # and the count of writes the kernel adds to
                w.writes.write(buffer, at, state.writes.data_ptr())
        elif kind == "bf16-sr":  # bf16 values and the count of writes the kernel adds to
            w.data.write(buffer, at, state.values.data_ptr())
            w.writes.write(buffer, at, state.writes.data_ptr())
        else:  # factored: row and column sums
            w.data.write(buffer, at, state.row.data_ptr())
            w.col.write(buffer, at, state.col.data_ptr())
            w.cols.write(buffer, at, state.col.numel())


@functools.cache
def _plain_kind_codes(k: kernel_abi.Kernel) -> dict:
    return {dtype: k.kinds[name] for dtype, name in _PLAIN_KINDS.items()}


@functools.cache
def _plain_description(k: kernel_abi.Kernel, dtype: torch.dtype) -> bytes:
    return bytes(k.structs["state_t"](kind=k.kinds[_PLAIN_KINDS[dtype]]))


# The descriptions hold raw addresses of cached tables: built under a lock, so that two threads'
# first steps cannot each build a table, cache one and describe the other (freed with its thread's
# reference)
_DESCRIBING = threading.RLock()


@functools.cache
def _format_description(k: kernel_abi.Kernel, cls, signed: bool) -> bytes:
    """What the kernel needs of a format (its kind, constants and tables) as a state_t's bytes,
    built once: a step only adds each state's block size and pointers."""
    with _DESCRIBING:
        return _describe_format(k, cls, signed)


def _describe_format(k: kernel_abi.Kernel, cls, signed: bool) -> bytes:
    kind = format_kind(cls, signed)
    described = k.structs["state_t"](kind=k.kinds[kind], zero_code=-1, smallest_code=-1)
    if kind in ("codebook", "e4m3", "block-float"):
        described.bits, described.scale_max, described.scale_min, described.calibrated = cls.bits, cls.scale_max, cls.scale_min(signed), cls.calibrated(signed)
    floor = cls.positive_floor(signed) if kind in ("codebook", "e4m3") else None
    if floor is not None:
        described.zero_code, described.smallest_code = floor
    if kind == "block-float":
        described.exponent_bits, described.mantissa_bits = cls.exponent_bits(signed), cls.mantissa_bits
        described.log_unbiased, described.power_of_two_scale = cls.rounds_log_unbiased(signed), cls.power_of_two_scale
    if kind == "codebook":
        declared = layout(cls, signed)
        described.stochastic = declared.stochastic
        described.codebook = declared.tables["codebook"].data_ptr()
        described.base_code = _int32_base_code(cls, signed).data_ptr()
        described.threshold = declared.tables["threshold"].data_ptr()
        thresholds, described.nan_code = _search_thresholds(cls, signed)
        described.thresholds = thresholds.data_ptr()
        if cls.bits == 4:
            for field, table in (("value_buckets", "codebook"), ("threshold_buckets", "decision_thresholds")):
                buckets = _buckets(k, cls, signed, table)
                setattr(described, field, ctypes.addressof(buckets) if buckets is not None else None)
        if cls.bits == 8:
            described.near_code = _near_code_table(cls, signed).data_ptr()
            described.value_bytes = _value_bytes(cls, signed).data_ptr()
            affine = _affine_map(k, cls, signed)
            described.affine = ctypes.addressof(affine) if affine is not None else None
    return bytes(described)


@functools.cache
def _search_thresholds(cls, signed: bool) -> tuple[Tensor, int]:
    """A codebook's sorted decision thresholds, NaN-padded to 2**bits (NaN is never <= a value),
    and the code of NaN: what the kernel's binary search needs to give the lookup tables' codes."""
    thresholds = layout(cls, signed).tables["decision_thresholds"]
    padded = torch.full((2**cls.bits,), math.nan, dtype=torch.float32)
    padded[: thresholds.numel()] = thresholds
    nan_code = int(cls.encode(torch.tensor([math.nan], dtype=torch.float32), signed)[0])
    return padded, nan_code


@functools.cache
def _buckets(k: kernel_abi.Kernel, cls, signed: bool, table: str):
    """A 4-bit codebook's ``table`` (its values, or its decision thresholds) as the C's buckets_t, or
    None where a bucket would hold two of them (the kernel then searches them). Bucket b of n covers
    [2b / n - 1, 2(b + 1) / n - 1), the last one closed at 1 (csrc/abi.h); ``below`` counts the numbers
    at or below its start, ``inside`` is the one within it (+inf: none)."""
    struct = k.structs["buckets_t"]
    arrays = dict(struct._fields_)
    n = arrays["below"]._length_
    numbers = layout(cls, signed).tables[table].double()
    numbers = numbers[~numbers.isnan()]  # unused codes count as above every value
    below, inside = [], []
    for b in range(n):
        start, end = 2 * b / n - 1, 2 * (b + 1) / n - 1
        within = numbers[(numbers > start) & ((numbers < end) | ((b == n - 1) & (numbers <= end)))]
        if within.numel() > 1:
            return None
        below.append(int((numbers <= start).sum()))
        inside.append(float(within[0]) if within.numel() else math.inf)  # an fp32 number: exact in double
    return struct(below=arrays["below"](*below), inside=arrays["inside"](*inside))


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
    tables = layout(cls, signed).tables
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
def _affine_map(k: kernel_abi.Kernel, cls, signed: bool):
    """The codebook's affine_code_t (affine_codes.py), or None where its thresholds do not fit one."""
    found = affine_codes.affine_codes(layout(cls, signed).tables["decision_thresholds"])
    if found is None:
        return None
    struct = k.structs["affine_code_t"]
    arrays = dict(struct._fields_)  # per-level entries past the last level stay 0: only infinities reach them, left to the table
    return struct(**{name: arrays[name](*value) if isinstance(value, list) else value for name, value in dataclasses.asdict(found).items()})


@functools.cache
def _value_bytes(cls, signed: bool) -> Tensor:
    """The codebook's values byte by byte ([k, code]: byte k of code's fp32 value), for the kernel's
    gather-free decoding of 8-bit codes."""
    return layout(cls, signed).tables["codebook"].view(torch.uint8).view(-1, 4).t().contiguous()


@functools.cache
def _int32_base_code(cls, signed: bool) -> Tensor:
    # the scalar loops' table (the vector loops use _near_code_table)
    return layout(cls, signed).tables["base_code"].to(torch.int32)


# ---- the op -------------------------------------------------------------------------------------------


# Defined with torch.library's low-level API, not custom_op: custom_op's Python autograd and
# version-counting wrappers cost 0.2-0.4 ms per call over a few hundred tensors, several times the
# rest of a small step's Python; the implementation bumps the version counters itself.
_LIBRARY = torch.library.Library("lowbit_optim", "FRAGMENT")
_LIBRARY.define(
    "fused_step_cpu(str optimizer, float[] hyper, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, "
    "Tensor(c!)[] state_tensors, int[] state_formats, Tensor(d!)[] corrections, Tensor(e!)[] addends) -> ()"
)


def fused_step_cpu(
    optimizer: str,
    hyper: list[float],
    params: list[Tensor],
    grads: list[Tensor],
    steps: list[Tensor],
    state_tensors: list[Tensor],
    state_formats: list[int],
    corrections: list[Tensor],
    addends: list[Tensor],
) -> None:
    """One step of every parameter with the kernel's ``optimizer`` update (see the module's doc)."""
    k = kernel()
    if optimizer not in k.optimizers:
        raise ValueError(f"the fused CPU kernel has no optimizer {optimizer!r} (it has {sorted(k.optimizers)})")
    spec = k.optimizers[optimizer]
    count = len(params)
    if len(hyper) != len(spec.hyper._fields_) or len(grads) != count or len(steps) != count or len(state_formats) != count * len(spec.states):
        names = [name for name, _ in spec.hyper._fields_]
        raise ValueError(
            f"fused_step_cpu({optimizer!r}) takes {len(names)} hyper-parameters ({', '.join(names)}), a gradient and a step "
            f"counter per parameter and {len(spec.states)} format keys per parameter ({', '.join(spec.states)}); got "
            f"{len(hyper)} hyper-parameters, {count} parameters, {len(grads)} gradients, {len(steps)} steps, {len(state_formats)} format keys"
        )
    if corrections and len(corrections) != count:
        raise ValueError(f"corrections holds {len(corrections)} tensors for {count} parameters: pass one per parameter (empty: none), or none at all")
    hyper_struct = _hyper_struct(k, optimizer, dict(zip((name for name, _ in spec.hyper._fields_), hyper)))
    w = _writers(k)
    entries = (k.structs["param_t"] * count)()  # zeros: absent states are kind none
    added, taken = iter(addends), 0
    per_param, required = len(spec.states), spec.states[: spec.required]
    states_at, states_end = w.states_at, w.states_at + per_param * w.state_size
    kinds = _plain_kind_codes(k)
    _checked.age(max(_CHECKED_KEPT, 2 * count))  # states replaced over a long run (loads, conversions)
    with memoryview(entries).cast("B") as buffer:
        for i, (param, grad, step) in enumerate(zip(params, grads, steps)):
            keys = tuple(state_formats[i * per_param : (i + 1) * per_param])
            given = _tensor_count(keys)
            inner = state_tensors[taken : taken + given]
            if len(inner) < given:
                raise ValueError("state_tensors holds fewer tensors than state_formats describe")
            taken += given
            numel = param.numel()
            # what check_inputs reads of the states, their addresses and storages' sizes included (a
            # storage resized to 0 and back smaller often keeps its address): the same says the same
            seen = (optimizer, keys, param.shape, *[(t.dtype, t.shape, t.is_contiguous(), t.is_cpu, t.data_ptr(), t.storage_offset(), t.untyped_storage().nbytes()) for t in inner])
            checked = _checked.get(seen)
            at = i * w.param_size
            if checked is None or not _fits(param, grad, step, numel, checked.counted):
                checked = _check_and_describe(k, w, buffer, at, spec, keys, inner, param, grad, step, required)
                _checked[seen] = checked
            else:
                buffer[at + states_at : at + states_end] = checked.states
            correction = corrections[i] if corrections and corrections[i].numel() else None
            if correction is not None:
                check_correction(param, correction)
            w.param.write(
                buffer, at, numel, kinds[param.dtype], kinds[grad.dtype], param.data_ptr(),
                grad.data_ptr(), step.data_ptr() if step.numel() else 0, correction.data_ptr() if correction is not None else 0,
            )  # fmt: skip
            for j, name in checked.addends:
                w.addend.write(buffer, at + states_at + j * w.state_size, _checked_addend(next(added, None), name, numel, param).data_ptr())
    if taken != len(state_tensors):
        raise ValueError("state_tensors holds more tensors than state_formats describe")
    if next(added, None) is not None:
        raise ValueError("addends holds more tensors than the given states keep outside their codes (StateTensor.has_addend)")
    result = k.lib.lowbit_step(spec.index, entries, count, ctypes.byref(hyper_struct), torch.get_num_threads())
    if result == 2:  # chunks_unsupported refuses such states first: a limit edited since
        raise ValueError("the fused CPU kernel's chunks of a parameter would exceed its buffers of MAX_CHUNK elements (csrc/abi.h; nothing was stepped)")
    if result != 0:
        raise MemoryError("the fused CPU kernel could not allocate its work list or factored states' column sums (nothing was stepped)")
    # what an in-place aten op does: autograd then refuses a backward through the old values
    torch.autograd.graph.increment_version([*params, *steps, *state_tensors, *corrections, *addends])


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A parameter's states that passed check_inputs: their state_t descriptions as bytes (addends
    left NULL), whether it counts steps, and (slot, name) of each state with an addend."""

    states: bytes
    counted: bool
    addends: tuple[tuple[int, str], ...]


class _KeptVerdicts:
    """check_inputs' verdicts by what it reads (_Checked): an entry per parameter the op steps (about
    2 KiB), and one more each time its states are replaced (a load, a conversion), which is never
    used again. In two generations: past a bound, the recent one becomes the older one and the older
    one's entries go, except those used again meanwhile, which move back. It ages only once an entry
    has been used again in it (a full cycle of the process's calls: every parameter of every
    optimizer was found in it), or past twice the bound (entries of replaced states alone), so that up
    to twice the bound's parameters, in calls of any size, are found again each step (clearing all at
    the bound had checked all 16800 parameters of three optimizers anew at every call). An optimizer
    that steps several times between the others' steps ends a cycle early: theirs may be checked anew."""

    def __init__(self):
        self.recent: dict = {}
        self.older: dict = {}
        self.cycled = False  # an entry of the recent generation was used again in it

    def get(self, key) -> "_Checked | None":
        found = self.recent.get(key)
        if found is not None:
            self.cycled = True
            return found
        found = self.older.pop(key, None)
        if found is not None:
            self.recent[key] = found
        return found

    def __setitem__(self, key, checked: "_Checked") -> None:
        self.recent[key] = checked

    def age(self, bound: int) -> None:
        if len(self.recent) > bound and (self.cycled or len(self.recent) > 2 * bound):
            self.older, self.recent, self.cycled = self.recent, {}, False


_checked = _KeptVerdicts()
_CHECKED_KEPT = 16384


def _check_and_describe(k, w: "_Writers", buffer, at: int, spec, keys: tuple, inner: list, param: Tensor, grad: Tensor, step: Tensor, required) -> _Checked:
    """Rebuild a parameter's states from their tensors, check them (a ValueError says what is wrong)
    and describe them into its param_t at byte ``at``."""
    tensors = iter(inner)
    states = {name: _rebuild(key, tensors, param) for name, key in zip(spec.states, keys)}
    check_inputs(param, grad, step, states, required)
    addends = []
    for j, (name, state) in enumerate(states.items()):
        if state is not None:
            _write_state(w, buffer, at + w.states_at + j * w.state_size, k, state)
            if isinstance(state, StateTensor) and state.has_addend:
                addends.append((j, name))
    described = bytes(buffer[at + w.states_at : at + w.states_at + len(spec.states) * w.state_size])
    return _Checked(described, any(s is not None for s in states.values()), tuple(addends))


def _fits(param: Tensor, grad: Tensor, step: Tensor, numel: int, counted: bool) -> bool:
    """Whether check_inputs would pass a parameter, its gradient and its step counter (checked at
    every call: they are not remembered); ``counted``: whether it has states."""
    return (
        _plain_fits(param, numel) and _plain_fits(grad, numel) and _counter_fits(step, counted)
        and storage_holds(param) and storage_holds(grad) and storage_holds(step)
    )  # fmt: skip


def _tensor_count(keys: tuple) -> int:
    """How many state tensors a parameter's format keys stand for (a ValueError for a key that names
    no format)."""
    count = _tensor_counts.get(keys)
    if count is None:
        for key in keys:
            if not 0 <= key < len(_formats):
                raise ValueError(f"format key {key} names no state format (format_key makes them)")
        count = _tensor_counts[keys] = sum(0 if key == ABSENT else 1 if key == PLAIN else len(_formats[key][0].inner_names) for key in keys)
    return count


_tensor_counts: dict = {}  # format keys of a parameter -> _tensor_count


_LIBRARY.impl("fused_step_cpu", fused_step_cpu, "CompositeExplicitAutograd")


@torch.library.register_fake("lowbit_optim::fused_step_cpu", lib=_LIBRARY)
def _fused_step_cpu_fake(optimizer, hyper, params, grads, steps, state_tensors, state_formats, corrections, addends) -> None:
    # FakeTensors (a trace) report their fake device; a real meta tensor among CPU ones dispatches
    # here too, where the step would silently not happen
    given = dict(params=params, grads=grads, steps=steps, state_tensors=state_tensors, corrections=corrections, addends=addends)
    for name, tensors in given.items():
        where = next((i for i, t in enumerate(tensors) if t.is_meta), None)
        if where is not None:
            raise ValueError(f"the fused CPU kernel cannot step tensors on the meta device: {name}[{where}] is one (nothing was stepped)")
    return None


def _checked_addend(addend: Tensor | None, name: str, numel: int, param: Tensor) -> Tensor:
    """``addend`` if it can be the part of a state of ``numel`` elements outside its codes: the C
    reads and writes numel fp32 values there."""
    if addend is None:
        raise refused(
            param, f"its {name} state keeps a part of its values outside its codes, and addends holds none for it (StateTensor.kernel_addend makes it)"
        )
    if addend.dtype != torch.float32 or not addend.is_contiguous() or not addend.is_cpu or addend.numel() != numel:
        raise refused(param, f"the addend of its {name} state is {describe_tensor(addend)}, not {numel} contiguous float32 values on the CPU")
    if not storage_holds(addend):
        raise refused(param, f"the storage of the addend of its {name} state {storage_shortfall(addend)}")
    return addend


def _rebuild(key: int, tensors, param: Tensor) -> Tensor | None:
    """The state that format key ``key`` and the next of ``tensors`` (enough of them:
    _tensor_count) stand for (None: absent)."""
    if key == ABSENT:
        return None
    if key == PLAIN:
        return next(tensors)
    cls, metadata = _formats[key]
    return cls.__tensor_unflatten__({name: next(tensors) for name in cls.inner_names}, metadata, param.shape, None)
