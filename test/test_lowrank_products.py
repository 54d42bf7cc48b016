"""lowrank_products: the low-rank states' products, each output a chain of FMAs in order (csrc/products.h),
and their QR, in one order too (csrc/orthonormal.h)."""

import re

import pytest
import torch
from conftest import torch_threads
from test_fused_cpu import BUILDS, kernel_built_with

from lowbit_optim import fused_cpu, kernel_abi, lowrank_products

KINDS = ("outer", "times", "transposed_times")
# (rows, cols, rank): tails of every tile and vector (rows of 4 and 8, columns of 8 and of two
# vectors, ranks of one vector), transposed_times' blocks of 256 rows, and vectors of one element
SHAPES = [(1, 1, 1), (5, 3, 2), (9, 33, 17), (37, 70, 32), (130, 47, 64), (300, 1, 1), (1, 300, 1), (513, 20, 31)]

# (rows, rank) of QRs: empty ones, one leaf of 256 rows or fewer than 512 (square, rank 1, ranks past
# a chunk of 16 columns), leaves whose R's make one leaf, and 4200 x 32, whose stacked R's (512 rows)
# are leaves again
QR_SHAPES = [(0, 0), (600, 0), (1, 1), (5, 3), (32, 32), (33, 17), (300, 7), (511, 64), (600, 32), (1100, 64), (4200, 32)]

pytestmark = pytest.mark.skipif(fused_cpu.library() is None, reason="the fused kernel's library cannot be built here")


def factors(kind, rows, cols, rank, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind in ("outer", "residual"):
        return torch.randn(rows, rank, generator=g), torch.randn(cols, rank, generator=g)
    return torch.randn(rows, cols, generator=g), torch.randn(cols if kind == "times" else rows, rank, generator=g)


def tall(rows, rank, seed=0):
    """A matrix whose columns' sizes differ by 1e4, as a momentum's strong and weak directions."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=g) * torch.logspace(0, -4, rank)


def product(kind, a, b):
    if kind == "orthonormal":
        return lowrank_products.orthonormal(a)
    if kind == "residual":  # of values made from the factors' sizes
        values = torch.linspace(-1, 1, a.shape[0] * b.shape[0]).view(a.shape[0], b.shape[0])
        return lowrank_products.residual(values, a, b)
    return getattr(lowrank_products, kind)(a, b)


def chained(kind, a, b):
    """Each output as fp32 FMAs over the shared index in increasing order from +0, emulated in
    float64 (a product of two fp32 numbers is exact there; the sum is rounded to fp32 after each
    term, which can differ from one FMA's rounding only by double rounding, not seen with these seeds)."""
    terms = {
        "outer": lambda j: a[:, j, None] * b[None, :, j],
        "times": lambda j: a[:, j, None] * b[None, j, :],
        "transposed_times": lambda j: a[j, :, None] * b[None, j, :],
    }[kind]
    shared = a.shape[1] if kind in ("outer", "times") else a.shape[0]
    a, b = a.double(), b.double()
    acc = torch.zeros(lowrank_products._shape(kind, a, b), dtype=torch.float64)
    for j in range(shared):
        acc = (terms(j) + acc).float().double()
    return acc.float()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_each_output_is_a_chain_of_fmas_in_order(kind, shape):
    a, b = factors(kind, *shape)
    assert torch.equal(product(kind, a, b), chained(kind, a, b))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_residual_is_the_values_less_the_rounded_product(shape):
    """residual takes outer's product, rounded, from the values: in one pass, or in place."""
    left, right = factors("outer", *shape)
    values = torch.randn(shape[0], shape[1])
    expected = values - chained("outer", left, right)
    assert torch.equal(lowrank_products.residual(values, left, right), expected)
    in_place = values.clone()
    assert lowrank_products.residual(in_place, left, right, out=in_place) is in_place
    assert torch.equal(in_place, expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(0, 5, 3), (4, 0, 3), (4, 5, 0)], ids=str)
def test_empty_sizes(kind, shape):
    """No rows, no columns or rank 0: the products of empty sums are zeros."""
    a, b = factors(kind, *shape)
    assert torch.equal(product(kind, a, b), chained(kind, a, b))


def test_an_output_over_an_input_is_refused():
    """The C reads its inputs while it writes: an output may overlap none of them, but for a residual
    written over its own values."""
    m = torch.randn(8, 8)
    with pytest.raises(ValueError, match="out shares memory with b"):
        lowrank_products.times(torch.randn(8, 8), m, out=m)
    left, right, buffer = torch.randn(8, 2), torch.randn(8, 2), torch.randn(65)
    with pytest.raises(ValueError, match="out shares memory with the minuend"):
        lowrank_products.residual(buffer[:64].view(8, 8), left, right, out=buffer[1:].view(8, 8))
    values = torch.randn(8, 8)
    expected = values - chained("outer", left, right)
    assert torch.equal(lowrank_products.residual(values, left, right, out=values), expected)


@pytest.mark.parametrize("shape", QR_SHAPES, ids=str)
def test_orthonormal_is_the_q_of_a_qr(shape):
    """Orthonormal columns that span the matrix's: float64 LAPACK's Q but for the columns' signs."""
    a = tall(*shape)
    q = lowrank_products.orthonormal(a).double()
    reference = torch.linalg.qr(a.double()).Q
    signs = (q * reference).sum(0).sign()
    assert torch.allclose(q, reference * signs, rtol=0, atol=2e-5)
    assert torch.allclose(q.T @ q, torch.eye(shape[1], dtype=torch.float64), rtol=0, atol=2e-6)


@pytest.mark.parametrize("shape", [(40, 8), (600, 32)], ids=str)
def test_orthonormal_columns_of_a_rank_deficient_matrix(shape):
    """Zeros, or columns that repeat: still orthonormal columns (a low-rank state's first write, or a
    momentum of fewer directions than the rank), whose span holds the matrix's."""
    rows, rank = shape
    repeated = tall(rows, 2).repeat(1, rank // 2)
    for a in (torch.zeros(shape), repeated):
        q = lowrank_products.orthonormal(a).double()
        assert torch.allclose(q.T @ q, torch.eye(rank, dtype=torch.float64), rtol=0, atol=2e-6)
        assert torch.allclose(q @ (q.T @ a.double()), a.double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("flag", BUILDS.values(), ids=BUILDS.keys())
def test_every_build_and_thread_count_gives_the_same_bits(flag):
    cases = [(kind, factors(kind, *shape, seed=1)) for kind in (*KINDS, "residual") for shape in SHAPES]
    cases += [("orthonormal", (tall(*shape, seed=1), None)) for shape in QR_SHAPES]
    expected = [product(kind, a, b) for kind, (a, b) in cases]
    with kernel_built_with(flag):
        for count in (1, 2, 3):
            with torch_threads(count):
                for (kind, (a, b)), reference in zip(cases, expected):
                    assert torch.equal(product(kind, a, b), reference), (kind, a.shape, b.shape, count)


def test_compiled_products_are_the_eager_ones():
    """Opaque to inductor (the ops lowbit_optim::lowrank_product, lowrank_residual and
    lowrank_orthonormal), so a compiled step cannot sum them in an order of its own; the factors may
    be views (a QR's column-major Q)."""
    def products(m, q, left):
        return (
            lowrank_products.times(m, q), lowrank_products.transposed_times(m, left), lowrank_products.outer(left, q) * 2,
            lowrank_products.residual(m, left, q).view(-1) + 1, lowrank_products.orthonormal(left * 2),
        )  # fmt: skip

    step = torch.compile(products, dynamic=True, fullgraph=True)
    for rows, cols in ((40, 24), (300, 1), (7, 130)):
        m = torch.randn(rows, cols)
        q, left = torch.linalg.qr(torch.randn(cols, min(rows, cols, 8))).Q, torch.randn(rows, min(rows, cols, 8))
        eager = products(m, q, left)
        assert torch.equal(eager[0], chained("times", m, q))  # the column-major Q read as its values
        for got, want in zip(step(m, q, left), eager):
            assert torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_into_a_buffer(kind):
    a, b = factors(kind, 37, 70, 32)
    out = torch.full(lowrank_products._shape(kind, a, b), float("nan"))
    assert getattr(lowrank_products, kind)(a, b, out=out) is out
    assert torch.equal(out, product(kind, a, b))


@pytest.mark.parametrize("kind", KINDS)
def test_lazily_negated_inputs_are_read_as_their_values(kind):
    """A neg-bit view's memory holds its values negated: the C, which reads memory, gets them resolved
    (through the op, torch's dispatcher resolves them; into a buffer, the library)."""
    a, b = factors(kind, 5, 7, 3)
    expected = product(kind, -a, b)
    assert torch.equal(getattr(lowrank_products, kind)(a._neg_view(), b), expected)
    assert torch.equal(getattr(lowrank_products, kind)(a._neg_view(), b, out=torch.empty_like(expected)), expected)
    if kind == "outer":
        values = torch.randn(expected.shape)
        assert torch.equal(lowrank_products.residual((-values)._neg_view(), a, b._neg_view(), out=torch.empty_like(values)), values - expected)
    with pytest.raises(ValueError, match=re.escape("out is a lazily negated view (torch's neg bit): pass out.resolve_neg()")):
        getattr(lowrank_products, kind)(a, b, out=torch.empty_like(expected)._neg_view())


def freed(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage resized to nothing in place (as FSDP frees memory): same shape, no bytes."""
    t.untyped_storage().resize_(0)
    return t


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: lowrank_products.times(torch.randn(4, 5), torch.randn(6, 2)), "do not agree in the dimension they share"),
        (lambda: lowrank_products.outer(torch.randn(4, 2), torch.randn(6, 3)), "do not agree in the dimension they share"),
        (lambda: lowrank_products.transposed_times(torch.randn(4, 5), torch.randn(5, 2)), "do not agree in the dimension they share"),
        (lambda: lowrank_products.times(torch.randn(4, 5, dtype=torch.float64), torch.randn(5, 2)), "not a float32 matrix"),
        (lambda: lowrank_products.times(torch.randn(20), torch.randn(5, 2)), "not a float32 matrix"),
        (lambda: lowrank_products.outer(torch.randn(4, 2), torch.randn(6, 2), out=torch.empty(6, 4)), "out is a torch.float32 (6, 4) tensor"),
        (lambda: lowrank_products.outer(torch.randn(4, 2), torch.randn(6, 2), out=torch.empty(6, 4).T), "not a contiguous float32 (4, 6)"),
        (lambda: torch.ops.lowbit_optim.lowrank_product("inner", torch.randn(4, 2), torch.randn(2, 3)), "kind 'inner' is none of"),
        (lambda: lowrank_products.residual(torch.randn(4, 5), torch.randn(4, 2), torch.randn(6, 2)), "lowrank_residual: the minuend is a torch.float32 (4, 5) tensor"),
        (lambda: lowrank_products.residual(torch.randn(6, 4).T, torch.randn(4, 2), torch.randn(6, 2), out=torch.empty(4, 6)), "lowrank_residual: the minuend is a torch.float32 (4, 6) tensor on cpu, not a contiguous"),
        (lambda: lowrank_products.residual(torch.randn(4, 6), torch.randn(4, 2), torch.randn(6, 3)), "lowrank_residual: shapes (4, 2) and (6, 3) do not agree"),
        (lambda: lowrank_products.orthonormal(torch.randn(3, 4)), "lowrank_orthonormal: a (3, 4) matrix has more columns than rows"),
        (lambda: lowrank_products.orthonormal(torch.randn(4, 3, dtype=torch.float64)), "lowrank_orthonormal: a is a 2-D torch.float64 tensor"),
        (lambda: lowrank_products.orthonormal(torch.randn(12)), "lowrank_orthonormal: a is a 1-D torch.float32 tensor"),
        (lambda: lowrank_products.orthonormal(freed(torch.randn(600, 32))), "lowrank_orthonormal: the storage of a holds 0 bytes, not the 76800"),
        (lambda: lowrank_products.times(torch.randn(4, 600), freed(torch.randn(600, 32))), "lowrank_product('times'): the storage of b holds 0 bytes"),
        (lambda: lowrank_products.outer(torch.randn(4, 2), torch.randn(6, 2), out=freed(torch.empty(4, 6))), "lowrank_product('outer'): the storage of out holds 0 bytes"),
    ],
)
def test_bad_inputs_are_refused_before_the_c_reads_them(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_compiling_a_residual_of_mismatched_values_fails_as_the_op_would():
    """The op's fake (what compiling runs) refuses the values the op refuses."""
    with pytest.raises(RuntimeError, match=re.escape("values are a torch.float32 (4, 5) tensor, not a float32 (4, 6) matrix")):
        torch.compile(lowrank_products.residual, fullgraph=True)(torch.randn(4, 5), torch.randn(4, 2), torch.randn(6, 2))


def test_without_the_library_the_products_and_qrs_are_torchs(monkeypatch):
    monkeypatch.setattr(kernel_abi, "load", lambda: (None, "no compiler"))
    for kind in KINDS:
        a, b = factors(kind, 37, 70, 32)
        reference = {"outer": lambda: a @ b.T, "times": lambda: a @ b, "transposed_times": lambda: a.T @ b}[kind]()
        assert torch.equal(product(kind, a, b), reference)
    left, right = factors("outer", 37, 70, 32)
    values = torch.randn(37, 70)
    expected = values - left @ right.T
    assert torch.equal(lowrank_products.residual(values, left, right), expected)
    assert torch.equal(lowrank_products.residual(values, left, right, out=values), expected)
    # LAPACK's own bits may move with its workspace's alignment (MKL without CBWR): the call is what counts
    calls, qr = [], torch.linalg.qr
    monkeypatch.setattr(torch.linalg, "qr", lambda x: calls.append(x) or qr(x))
    a = tall(600, 32)
    q = lowrank_products.orthonormal(a)
    assert len(calls) == 1 and calls[0] is a and q.is_contiguous()
    torch.testing.assert_close(q, qr(a).Q, rtol=0, atol=1e-6)
