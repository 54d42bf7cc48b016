"""The fused CPU kernel's structures as the C declares them: read from the library, never copied.

csrc/abi.h declares each structure Python fills (a parameter, a state, each optimizer's
hyper-parameters) once, as a list of fields that also fills a table the library exports (name,
offset, size, type of every field; the kinds by KernelLayout's names; limits; the optimizers). This
module builds the ctypes structures from that table when the library loads and checks every field's
offset and size and every structure's size against the C's offsetof and sizeof: a mismatch refuses
the library, naming the field. A Python mistake in a field's name raises instead of setting nothing.
"""

import ctypes
import functools
import struct
import threading
import warnings
from dataclasses import dataclass

from . import kernel_build
from .user_frame import outside_stacklevel

_SCALARS = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u64": ctypes.c_uint64, "f32": ctypes.c_float, "f64": ctypes.c_double, "ptr": ctypes.c_void_p}


class LayoutMismatch(OSError):
    """The C's table and the ctypes structure built from it disagree (an ABI this module misreads)."""


class Struct(ctypes.Structure):
    """A structure built from the C's table. No __dict__ (empty __slots__): setting a field it lacks
    raises an AttributeError, where plain ctypes would keep an attribute the C never sees."""

    __slots__ = ()


@dataclass(frozen=True)
class Field:
    structure: str
    name: str
    type: str  # a scalar code (_SCALARS) or the name of a structure
    offset: int
    size: int
    count: int


@dataclass(frozen=True)
class Optimizer:
    """An update function of the kernel: its number, hyper-parameter structure and state names (in
    param_t.state's order; the first ``required`` must be given, the others are optional)."""

    index: int
    hyper: type
    states: tuple[str, ...]
    required: int


class Kernel:
    """The loaded library with its structures (``structs[name]``), kinds (KernelLayout.kind or dtype
    name -> number), limits and optimizers."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        fields = list(_rows(lib.lowbit_abi_field, row_types("lowbit_abi_field"), Field))
        self.structs = _build_structs(fields)
        constants = list(_rows(lib.lowbit_abi_constant, row_types("lowbit_abi_constant"), lambda *row: row))
        self.kinds = {name: value for group, name, value in constants if group == "kind"}
        self.limits = {name: value for group, name, value in constants if group == "limit"}
        self.optimizers = {
            name: Optimizer(i, self.structs[hyper], tuple(states.split(",")), required)
            for i, (name, hyper, states, required) in enumerate(_rows(lib.lowbit_abi_optimizer, row_types("lowbit_abi_optimizer"), lambda *row: row))
        }
        too_many = [name for name, o in self.optimizers.items() if len(o.states) > self.limits["max_states"]]
        if too_many:
            raise LayoutMismatch(f"optimizers {too_many} name more states than param_t holds ({self.limits['max_states']})")
        _declare_functions(lib, self.structs)

    def hyper(self, optimizer: str, values: dict) -> Struct:
        """The optimizer's hyper-parameter structure filled from ``values`` (field name -> number):
        exactly its fields, or a ValueError naming the missing and unknown ones."""
        cls = self.optimizers[optimizer].hyper
        fields = _hyper_fields(cls)
        if values.keys() != {name for name, _ in fields}:
            names = [name for name, _ in fields]
            raise ValueError(
                f"the kernel's {optimizer} update takes the hyper-parameters {names}: "
                f"missing {sorted(set(names) - set(values))}, unknown {sorted(set(values) - set(names))}"
            )
        return cls(*(_number(name, values[name], integral) for name, integral in fields))


@functools.cache
def _hyper_fields(cls) -> tuple[tuple[str, bool], ...]:
    """A hyper-parameter structure's fields in order, each with whether it is an integer (a flag)."""
    return tuple((name, issubclass(ctype, (ctypes.c_int32, ctypes.c_int64))) for name, ctype in cls._fields_)


class Packer(struct.Struct):
    """Writes adjacent scalar fields of a structure into a buffer of such structures in one call
    (``packer``): a loop filling hundreds of them per step spends less than with ctypes' setters."""

    def __init__(self, fmt: str, offset: int):
        super().__init__(fmt)
        self.offset = offset

    def write(self, buffer, base: int, *values) -> None:
        """Write ``values`` (pointers as integers, 0 for NULL) into the structure at byte ``base``."""
        self.pack_into(buffer, base + self.offset, *values)


_PACK_CODES = {ctypes.c_int32: "i", ctypes.c_int64: "q", ctypes.c_uint64: "Q", ctypes.c_float: "f", ctypes.c_double: "d", ctypes.c_void_p: "Q"}


def packer(cls: type, *names: str) -> Packer:
    """A Packer of the scalar fields ``names`` of structure ``cls``, in the order they lie: their
    offsets and types are the structure's (the C's table), and no other field may lie between them
    (the pad bytes it writes are zeros)."""
    types, fields = dict(cls._fields_), sorted(((getattr(cls, n).offset, n) for n, _ in cls._fields_))
    first, last = getattr(cls, names[0]), getattr(cls, names[-1])
    between = [n for offset, n in fields if first.offset <= offset < last.offset + last.size and n not in names]
    if between or [n for _, n in fields if n in names] != list(names):
        raise LayoutMismatch(f"fields {names} of {cls.__name__} are not adjacent, in this order (between them: {between})")
    fmt, at = "=", first.offset
    for name in names:
        field = getattr(cls, name)
        code = _PACK_CODES[types[name]]
        if struct.calcsize(code) != field.size:
            raise LayoutMismatch(f"field {cls.__name__}.{name} takes {field.size} bytes, not {struct.calcsize(code)}")
        fmt += "x" * (field.offset - at) + code
        at = field.offset + field.size
    return Packer(fmt, first.offset)


def _number(name: str, value, integral: bool):
    # every integer field is a flag: a C int32, which a larger integer would wrap (2**32 to 0)
    if integral and not (isinstance(value, (bool, int, float)) and value in (0, 1)):
        raise ValueError(f"hyper-parameter {name} of the kernel is a flag (0 or 1), got {value!r}")
    return int(value) if integral else float(value)


# The library's tables (fused_step.c): each row's strings, then its integers
TABLES = {"lowbit_abi_field": (3, 3), "lowbit_abi_constant": (2, 1), "lowbit_abi_optimizer": (3, 1)}


def row_types(table: str) -> list:
    """The ctypes types of a row of ``table``, in order."""
    strings, integers = TABLES[table]
    return [ctypes.c_char_p] * strings + [ctypes.c_int64] * integers


def _rows(function, types, make):
    """Every row of one of the library's tables: function(i, out...) returns 0 past the end."""
    outs = [t() for t in types]
    function.argtypes = [ctypes.c_int64, *(ctypes.POINTER(t) for t in types)]
    function.restype = ctypes.c_int
    i = 0
    while function(i, *(ctypes.byref(o) for o in outs)):
        values = [o.value.decode() if isinstance(o, ctypes.c_char_p) else o.value for o in outs]
        yield make(*values)
        i += 1


def _build_structs(fields: list[Field]) -> dict[str, type]:
    """ctypes structures from the table, each checked field by field against the C's layout."""
    by_struct: dict[str, list[Field]] = {}
    for f in fields:
        by_struct.setdefault(f.structure, []).append(f)
    structs: dict[str, type] = {}

    def build(name: str) -> type:
        if name in structs:
            return structs[name]
        rows = by_struct.get(name)
        if rows is None:
            raise LayoutMismatch(f"the table names a structure {name!r} it does not describe")
        members = sorted((f for f in rows if f.name), key=lambda f: f.offset)
        ctypes_fields = []
        for f in members:
            element = _SCALARS.get(f.type) or build(f.type)
            ctypes_fields.append((f.name, element * f.count if f.count != 1 else element))
        cls = type(name, (Struct,), {"__slots__": (), "_fields_": ctypes_fields})
        for f in members:
            got = getattr(cls, f.name)
            if (got.offset, got.size) != (f.offset, f.size):
                raise LayoutMismatch(
                    f"field {name}.{f.name} ({f.type}) lies at offset {f.offset} with {f.size} bytes in C, at "
                    f"{got.offset} with {got.size} in its ctypes structure"
                )
        size = next(f.size for f in rows if not f.name)
        if ctypes.sizeof(cls) != size:
            raise LayoutMismatch(f"{name} takes {size} bytes in C, {ctypes.sizeof(cls)} as a ctypes structure")
        structs[name] = cls
        return cls

    for name in by_struct:
        build(name)
    return structs


def _declare_functions(lib: ctypes.CDLL, structs: dict[str, type]) -> None:
    """The entry points' prototypes (csrc/fused_step.c, csrc/products.h, csrc/orthonormal.h, csrc/test_hooks.h)."""
    state, param = ctypes.POINTER(structs["state_t"]), ctypes.POINTER(structs["param_t"])
    prototypes = {
        "lowbit_step": ([ctypes.c_int64, param, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int], ctypes.c_int),
        "lowbit_decode": ([state, ctypes.c_int64, ctypes.c_void_p], None),
        "lowbit_encode": ([state, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], None),
        "lowbit_quantize": ([state, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64], None),
        "lowbit_divide": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p], None),
    }
    factors = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # a, b, rows, cols, rank
    prototypes |= {name: ([*factors, ctypes.c_void_p, ctypes.c_int], ctypes.c_int) for name in ("lowbit_times", "lowbit_transposed_times")}
    prototypes["lowbit_outer"] = ([*factors, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int)  # and a minuend (or NULL)
    prototypes["lowbit_orthonormal"] = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int], ctypes.c_int)  # a, rows, rank, q
    for name, (argtypes, restype) in prototypes.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype


_BUILDING = threading.Lock()  # threads stepping their first steps at once: one build, none loads it half-written


@functools.cache
def load() -> tuple[Kernel | None, str | None]:
    """(the kernel, None), or (None, why it is unavailable). Built on first use; a failed build warns
    once (steps then take the compiled step)."""
    try:
        with _BUILDING:
            library = kernel_build.build()
        kernel = Kernel(ctypes.CDLL(str(library)))
    except kernel_build.NoCompiler as error:
        return None, str(error)
    except OSError as error:  # a failed build, an unloadable library, a LayoutMismatch
        why = f"building it failed ({error})" if not isinstance(error, LayoutMismatch) else f"its structures do not match ({error})"
        if error.errno in kernel_build.UNWRITABLE:
            why += "; it is built in torch's inductor cache: set TORCHINDUCTOR_CACHE_DIR to a writable directory"
        warnings.warn(
            f"lowbit_optim: the fused CPU kernel is unavailable, steps use torch.compile instead (fused=True refuses to), and low-rank states' products "
            f"fall back to torch's matmul (another summation order: compiled and eager steps agree, but not bit for bit with a "
            f"built kernel): {why}",
            stacklevel=outside_stacklevel(),
        )
        return None, why
    return kernel, None
