"""FactoredState: a second moment kept as Adafactor's row and column sums (Shazeer & Stern, 2018).

A state of shape (rows, *rest) is seen as a rows x cols matrix V (cols = numel // rows; a 1-D state
is a column, rows = numel). It stores ``row = V.sum(1)`` and ``col = V.sum(0)``: rows + cols fp32
numbers instead of rows x cols, about 0.0065 bytes per element of a 768 x 3072 weight. Reading gives

    row[:, None] * col[None, :] / col.sum()

the rank-1 matrix with the same row and column sums (for nonnegative V the closest one in
I-divergence). Writing keeps only those sums. They are linear, so the Adam step's
``exp_avg_sq.lerp(grad**2, 1 - beta2)`` followed by ``copy_`` updates them exactly as Adafactor's
running averages of grad**2, bias correction included; the step's own update still uses the full
``lerp`` result of that step (factored past, exact present gradient). A 1-D state is stored exactly
(its one column sum cancels).

A row slice (``state[a:b]``, how DCP reads and writes checkpoint chunks that reshard) is a view: its
``row`` is the slice of the parent's, its ``col`` the parent's own, so it reads the parent's values,
and writing into it replaces its rows' share of the column sums. Those shares are the parent's as it
was before the first of a series of slice writes (a load's): after one slice is written the column
sums no longer split by the rank-1 rule, so later slices would take away the wrong share.

Only nonnegative states can be factored (a signed first moment's sums cancel): use it for
``exp_avg_sq``, e.g. ``state_format={"exp_avg": "4bit", "exp_avg_sq": "factored"}``.
"""

import weakref

import torch
from torch import Tensor

from .state import DEQUANTIZE_FIRST, KernelLayout, StateTensor, computes_as


def factor_shape(shape: torch.Size) -> tuple[int, int]:
    """(rows, cols) of the matrix a state of ``shape`` is factored as."""
    rows = shape[0] if len(shape) >= 2 else shape.numel()
    return rows, (shape.numel() // rows if rows else 0)


class FactoredState(StateTensor):
    """Nonnegative state as row and column sums of its (rows, numel // rows) matrix."""

    name = "factored"
    inner_names = ("row", "col")
    inner_dtypes = (torch.float32, torch.float32)
    holds_signed = False
    holds_elements = False  # a maximum spread over rows and columns shrinks where it is largest
    nonnegative = {"row": "sums of squares", "col": "sums of squares"}
    default_block_size = None  # no blocks: block_size is accepted and ignored

    row: Tensor
    col: Tensor

    @staticmethod
    def __new__(cls, row: Tensor, col: Tensor, shape, signed: bool = False, part: bool = False, dtype=torch.float32):
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=row.device)

    def __init__(self, row: Tensor, col: Tensor, shape, signed: bool = False, part: bool = False, dtype=torch.float32):
        super().__init__()
        self.row, self.col = row, col
        self.signed = signed
        self.part = part  # a row slice of a larger state: col holds the sums over all its rows
        self.block_size = None

    @classmethod
    def zeros(cls, shape, signed: bool = False, block_size: int | None = None, device=None, dtype=None):
        cls.check_signed(signed)
        shape = torch.Size((shape,) if isinstance(shape, int) else shape)
        rows, cols = factor_shape(shape)
        return cls(torch.zeros(rows, dtype=torch.float32, device=device), torch.zeros(cols, dtype=torch.float32, device=device), shape, signed, False, dtype or torch.float32)

    def _meta(self) -> tuple:
        return (self.signed, self.part)

    def _same_layout(self, other: Tensor) -> bool:
        # a row slice's col holds its parent's column sums: a write replaces its share of them (quantize_)
        return not self.part and super()._same_layout(other)

    def check_values(self) -> None:
        # (no decoding pass: its values are products of the row and column sums, checked nonnegative)
        if self.part:  # a loaded state is a parameter's, whole: a row slice's col sums another state's rows
            raise ValueError("a row slice of a larger factored state (part=True), where it holds a whole parameter's")
        found, wanted = (self.row.numel(), self.col.numel()), factor_shape(self.shape)
        if found != wanted:  # sizes that fit another grouping of its elements (row and col swapped): read as that
            raise ValueError(f"row and col hold sums of {found[0]} rows and {found[1]} columns, where its shape groups {wanted[0]} rows of {wanted[1]} (row and col swapped?)")

    def _check_sizes(self) -> None:
        if not isinstance(self.part, bool):
            raise ValueError(f"part is {self.part!r}, not a bool")
        # rows x cols may split the elements other than factor_shape does: a view keeps its owner's sums
        rows, cols = self.row.numel(), self.col.numel()
        if rows * cols != self.numel():
            raise ValueError(f"row and col hold sums of {rows} rows and {cols} columns: {rows * cols} elements, not {self.numel()}")

    def _describe(self) -> dict:
        return {"signed": self.signed, "factors": (self.row.numel(), self.col.numel())} | ({"part": True} if self.part else {})

    @classmethod
    def kernel_layout(cls, signed: bool) -> KernelLayout | None:
        return KernelLayout("factored") if computes_as(cls, FactoredState, "quantize_", "dequantize", "_total") else None

    def _total(self) -> Tensor:
        # an all-zero state (total 0) reads as zeros; a subnormal total divides as it is (a 1-D state
        # reads back exactly), NaN stays NaN
        total = self.col.sum()
        return torch.where(total == 0, 1.0, total)

    def quantize_(self, x: Tensor) -> None:
        matrix = x.float().reshape(self.row.numel(), self.col.numel())
        if self.part:  # replace this part's share of the parent's column sums
            before = _sums_before_slice_writes(self)
            self.col.copy_(self.col - self.row.sum() / before["total"] * before["col"] + matrix.sum(0))
            before["after"] = self.col.clone()  # a later slice of the series finds col as this one left it
        else:
            self.col.copy_(matrix.sum(0))
        self.row.copy_(matrix.sum(1))

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        # NaN or inf anywhere poisons every value (adding total - total, 0 or NaN: an infinite total
        # alone would read as zeros)
        total = self._total()
        values = self.row[:, None] * (self.col / total)[None, :] + (total - total)
        return values.view(self.shape).to(dtype or self.dtype)

    def _rows(self, start: int, end: int) -> "FactoredState":
        if self.dim() == 0 or self.shape[0] != self.row.numel():
            raise NotImplementedError(
                f"{type(self).__name__} ('factored' state format) of shape {tuple(self.shape)} factors {self.row.numel()} "
                f"rows: only a view whose first dimension is those rows can be sliced; {DEQUANTIZE_FIRST}"
            )
        return type(self)(self.row[start:end], self.col, (end - start, *self.shape[1:]), self.signed, True, self.dtype)


# A parent's column sums and total before a series of slice writes, which rows have been written, and
# col as the last of them left it, keyed by the storage its col and its slices' share (alive while the
# state is); dropped once every row is written. (col's version counter does not move: the writes are
# below autograd, in the subclass's dispatch.)
_SLICE_WRITES = weakref.WeakKeyDictionary()


def _sums_before_slice_writes(part: FactoredState) -> dict:
    """The parent's sums before this series of slice writes: taken now where none is under way, where
    col was written since the series' last slice (a step, a whole write: the series was left
    unfinished), or where this slice's rows were written already (a new series)."""
    key, rows = part.col.untyped_storage(), part.row.untyped_storage().nbytes() // part.row.element_size()
    first, count = part.row.storage_offset(), part.row.numel()
    writes = _SLICE_WRITES.get(key)
    if (
        writes is None or writes["written"].numel() != rows or not torch.equal(writes["after"], part.col)
        or bool(writes["written"][first : first + count].any())
    ):  # fmt: skip
        col = part.col.clone()
        writes = _SLICE_WRITES[key] = {"col": col, "total": part._total(), "written": torch.zeros(rows, dtype=torch.bool), "after": col}
    writes["written"][first : first + count] = True
    if bool(writes["written"].all()):
        del _SLICE_WRITES[key]
    return writes
