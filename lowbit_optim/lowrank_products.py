"""The low-rank states' matrix products, in one summation order on the CPU (csrc/products.h).

A LowRankState (lowrank.py) takes three products per write and one per read, each of a (rows x
cols) matrix with its rank (32 or 64) columns: ``outer(left, right)`` = left @ right.T,
``times(matrix, basis)`` = matrix @ basis and ``transposed_times(matrix, left)`` = matrix.T @ left;
its write's residual, ``residual(values, left, right)`` = values - outer(left, right), is the last
in one pass (in place in the fused kernel's buffer, which then needs no second one). On the CPU they come from the fused kernel's library, where every output is a chain of FMAs over the
shared index in increasing order: the compiled step (through the ops ``lowbit_optim::lowrank_product``
and ``lowrank_residual``, opaque to inductor), the eager step and the fused kernel all take them here, so they agree bit for
bit, on every build of the library (AVX-512, AVX2, portable) and any number of threads. torch's BLAS
fixes no order, and on the AMD EPYC of family 26 its MKL took these skinny shapes 2.1-2.9x the time
of the library's AVX-512 loops (README, Performance). Elsewhere (another device, or a CPU where the
library cannot be built) they are torch's products.
"""

import inspect
import pathlib
import sys
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .state import storage_holds, storage_shortfall


class _Kind(NamedTuple):
    function: str  # the library's
    dims: Callable  # (a, b) -> the C's (rows, cols, rank)
    shared: tuple[int, int]  # the dimensions of a and b that must agree
    shape: Callable  # (rows, cols, rank) -> the output's
    torch_product: Callable  # (a, b, out) -> torch's product (into out, unless None)


_KINDS = {
    "outer": _Kind("lowbit_outer", lambda a, b: (a.shape[0], b.shape[0], a.shape[1]), (1, 1), lambda r, c, k: (r, c), lambda a, b, out: torch.mm(a, b.T, out=out)),
    "times": _Kind("lowbit_times", lambda a, b: (*a.shape, b.shape[1]), (1, 0), lambda r, c, k: (r, k), lambda a, b, out: torch.mm(a, b, out=out)),
    "transposed_times": _Kind("lowbit_transposed_times", lambda a, b: (*a.shape, b.shape[1]), (0, 0), lambda r, c, k: (c, k), lambda a, b, out: torch.mm(a.T, b, out=out)),
}


def _shape(kind: str, a: Tensor, b: Tensor) -> tuple:
    return _KINDS[kind].shape(*_KINDS[kind].dims(a, b))


def outer(left: Tensor, right: Tensor, out: Tensor | None = None) -> Tensor:
    """left (rows x rank) @ right (cols x rank).T, into ``out`` (rows x cols) if given."""
    return _product("outer", left, right, out)


def times(matrix: Tensor, basis: Tensor, out: Tensor | None = None) -> Tensor:
    """matrix (rows x cols) @ basis (cols x rank), into ``out`` (rows x rank) if given."""
    return _product("times", matrix, basis, out)


def transposed_times(matrix: Tensor, left: Tensor, out: Tensor | None = None) -> Tensor:
    """matrix (rows x cols).T @ left (rows x rank), into ``out`` (cols x rank) if given."""
    return _product("transposed_times", matrix, left, out)


def residual(values: Tensor, left: Tensor, right: Tensor, out: Tensor | None = None) -> Tensor:
    """values (rows x cols) - left @ right.T, the product rounded as outer's: a low-rank state's
    residual, into ``out`` (which may be ``values``) if given."""
    if values.device.type != "cpu":
        product = outer(left, right)
        return values - product if out is None else torch.sub(values, product, out=out)
    if out is None:
        return torch.ops.lowbit_optim.lowrank_residual(values, left, right)
    return _into("outer", left, right, out, values)


def orthonormal(a: Tensor) -> Tensor:
    """The Q (rows x rank, contiguous) of a QR of ``a`` (rows x rank, rows >= rank): on the CPU the
    library's (csrc/orthonormal.h), the same bits on every build and thread count, its columns'
    signs perhaps not LAPACK's; elsewhere, or without the library, torch.linalg.qr's."""
    if a.device.type != "cpu":
        return torch.linalg.qr(a).Q
    return torch.ops.lowbit_optim.lowrank_orthonormal(a)


def _orthonormal(a: Tensor) -> Tensor:
    _check_tall(a)
    from . import kernel_abi  # imported here, as in _into

    kernel = kernel_abi.load()[0]
    if kernel is None:
        return torch.linalg.qr(a).Q.contiguous()
    a = a.contiguous()
    _check_storage("lowrank_orthonormal", a=a)
    q = torch.empty_like(a)
    if kernel.lib.lowbit_orthonormal(a.data_ptr(), a.shape[0], a.shape[1], q.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"lowrank_orthonormal: out of memory for the QR of a {a.shape[0]} x {a.shape[1]} matrix")
    return q


def _check_tall(a: Tensor, device: bool = True) -> None:
    """What lowbit_orthonormal reads: a float32 matrix (on the CPU) with no more columns than rows."""
    if a.dtype != torch.float32 or a.dim() != 2 or (device and a.device.type != "cpu"):
        raise ValueError(f"lowrank_orthonormal: a is a {a.dim()}-D {a.dtype} tensor on {a.device}, not a float32 matrix on the CPU")
    if a.shape[0] < a.shape[1]:
        raise ValueError(f"lowrank_orthonormal: a {tuple(a.shape)} matrix has more columns than rows (a QR's Q would not be {tuple(a.shape)})")


def _product(kind: str, a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    if a.device.type != "cpu":
        return _KINDS[kind].torch_product(a, b, out)
    if out is None:
        return torch.ops.lowbit_optim.lowrank_product(kind, a, b)
    return _into(kind, a, b, out)


def fingerprint() -> str:
    """The text that defines these products' and QR's numbers, this module's and the C's (for a
    format's numerics fingerprint)."""
    return inspect.getsource(sys.modules[__name__]) + "".join((pathlib.Path(__file__).parent / "csrc" / name).read_text() for name in ("products.h", "orthonormal.h"))


def _check(kind: str, a: Tensor, b: Tensor, device: bool = True, minuend: bool = False) -> None:
    """What the C reads: two float32 matrices (on the CPU) whose shared dimension agrees (``minuend``:
    the factors of a residual, whose errors then say so)."""
    if kind not in _KINDS:
        raise ValueError(f"lowrank_product: kind {kind!r} is none of {sorted(_KINDS)}")
    op = _op_name(kind, minuend)
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.float32 or t.dim() != 2 or (device and t.device.type != "cpu"):
            raise ValueError(f"{op}: {name} is a {t.dim()}-D {t.dtype} tensor on {t.device}, not a float32 matrix on the CPU")
    i, j = _KINDS[kind].shared
    if a.shape[i] != b.shape[j]:
        raise ValueError(f"{op}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not agree in the dimension they share")


def _op_name(kind: str, minuend: bool) -> str:
    """How errors name the call: lowrank_residual (outer with a minuend) or lowrank_product(kind)."""
    return "lowrank_residual" if minuend else f"lowrank_product({kind!r})"


def _into(kind: str, a: Tensor, b: Tensor, out: Tensor | None = None, minuend: Tensor | None = None) -> Tensor:
    """The product into ``out`` (None: a new matrix; outer with a minuend: the minuend less it): the
    library's, or torch's where it cannot be built."""
    _check(kind, a, b, minuend=minuend is not None)
    op, shape = _op_name(kind, minuend is not None), _shape(kind, a, b)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif out.is_neg():  # the C writes its memory, which would hold the values negated
        raise ValueError(f"{op}: out is a lazily negated view (torch's neg bit): pass out.resolve_neg()")
    # the C reads memory, not values: a lazily negated input is negated first (the op's calls are by torch's dispatcher)
    a, b, minuend = (t if t is None else t.resolve_neg() for t in (a, b, minuend))
    for name, t in (("out", out), ("the minuend", minuend)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu"):
            raise ValueError(f"{op}: {name} is a {t.dtype} {tuple(t.shape)} tensor on {t.device}, not a contiguous float32 {shape} CPU matrix")
    # the C reads its inputs while it writes out (restrict): out may be the minuend itself, nothing else of theirs
    shared = [name for name, t in (("a", a), ("b", b), ("the minuend", minuend)) if t is not None and _shares_memory(t, out)]
    if shared and not (shared == ["the minuend"] and minuend.data_ptr() == out.data_ptr()):
        raise ValueError(f"{op}: out shares memory with {' and '.join(shared)} (only a residual may be written over its minuend)")
    # imported here: kernel_build imports stochastic_bf16, whose format registers after lowrank's
    from . import kernel_abi

    kernel = kernel_abi.load()[0]
    if kernel is None:
        if minuend is None:
            return _KINDS[kind].torch_product(a, b, out)
        return torch.sub(minuend, _KINDS[kind].torch_product(a, b, torch.empty_like(out)), out=out)
    a, b = a.contiguous(), b.contiguous()
    _check_storage(op, a=a, b=b, out=out, minuend=minuend)
    rows, cols, rank = _KINDS[kind].dims(a, b)
    minuend_at = [minuend.data_ptr() if minuend is not None else None] if kind == "outer" else []  # outer's argument alone
    if getattr(kernel.lib, _KINDS[kind].function)(a.data_ptr(), b.data_ptr(), rows, cols, rank, *minuend_at, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"{op}: out of memory for a {rows} x {cols} matrix's product")
    return out


def _check_storage(op: str, **tensors: Tensor | None) -> None:
    """The C reads each of ``tensors`` (contiguous) from its data pointer: its storage must hold it."""
    for name, t in tensors.items():
        if t is not None and not storage_holds(t):
            raise ValueError(f"{op}: the storage of {name} {storage_shortfall(t)}")


def _shares_memory(t: Tensor, u: Tensor) -> bool:
    """Whether the storages of t and u overlap (both on the CPU): a view of either counts as either."""
    t_bytes, u_bytes = t.untyped_storage(), u.untyped_storage()
    if not t_bytes.nbytes() or not u_bytes.nbytes():
        return False
    return t_bytes.data_ptr() < u_bytes.data_ptr() + u_bytes.nbytes() and u_bytes.data_ptr() < t_bytes.data_ptr() + t_bytes.nbytes()


_LIBRARY = torch.library.Library("lowbit_optim", "FRAGMENT")
_LIBRARY.define("lowrank_product(str kind, Tensor a, Tensor b) -> Tensor")
_LIBRARY.impl("lowrank_product", lambda kind, a, b: _into(kind, a, b), "CPU")
_LIBRARY.define("lowrank_residual(Tensor values, Tensor left, Tensor right) -> Tensor")
_LIBRARY.impl("lowrank_residual", lambda values, left, right: _into("outer", left, right, minuend=values.contiguous()), "CPU")


_LIBRARY.define("lowrank_orthonormal(Tensor a) -> Tensor")
_LIBRARY.impl("lowrank_orthonormal", _orthonormal, "CPU")


@torch.library.register_fake("lowbit_optim::lowrank_orthonormal", lib=_LIBRARY)
def _lowrank_orthonormal_fake(a: Tensor) -> Tensor:
    _check_tall(a, device=False)
    return a.new_empty(a.shape)


@torch.library.register_fake("lowbit_optim::lowrank_product", lib=_LIBRARY)
def _lowrank_product_fake(kind: str, a: Tensor, b: Tensor) -> Tensor:
    _check(kind, a, b, device=False)
    return a.new_empty(_shape(kind, a, b))


@torch.library.register_fake("lowbit_optim::lowrank_residual", lib=_LIBRARY)
def _lowrank_residual_fake(values: Tensor, left: Tensor, right: Tensor) -> Tensor:
    _check("outer", left, right, device=False, minuend=True)
    shape = _shape("outer", left, right)
    if values.dtype != torch.float32 or values.dim() != 2 or tuple(values.shape) != shape:
        raise ValueError(f"lowrank_residual: values are a {values.dtype} {tuple(values.shape)} tensor, not a float32 {shape} matrix")
    return values.new_empty(shape)
