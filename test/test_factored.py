"""The factored second moment against float64 references: what it stores and reads, and the Adam
step it gives (Adafactor's factored statistics). Its tensor behaviour (copies, views, devices,
checkpoints, ops) is covered with every other format in test_formats.py and test_optim.py."""

import expecttest
import pytest
import torch

import lowbit_optim
from lowbit_optim import FactoredState
from lowbit_optim.factored import factor_shape

SHAPES = [(6, 50), (3, 4, 5), (1, 9), (9, 1), (7,), (1,), ()]


def nonnegative(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) * 10 ** torch.empty(shape).uniform_(-3, 3, generator=g)


def reference_factors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = factor_shape(x.shape)
    matrix = x.double().reshape(rows, cols)
    return matrix.sum(1), matrix.sum(0)


def reference_values(row: torch.Tensor, col: torch.Tensor, shape) -> torch.Tensor:
    total = col.sum()
    values = row[:, None] * col[None, :] / total if total > 0 else torch.zeros(row.numel(), col.numel(), dtype=torch.float64)
    return values.reshape(shape)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_stores_row_and_column_sums(shape):
    x = nonnegative(shape)
    state = FactoredState.from_float(x)
    row, col = reference_factors(x)
    assert state.row.dtype == state.col.dtype == torch.float32
    torch.testing.assert_close(state.row.double(), row, rtol=1e-6, atol=0)
    torch.testing.assert_close(state.col.double(), col, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reads_the_rank_one_matrix_with_those_sums(shape):
    state = FactoredState.from_float(nonnegative(shape))
    expected = reference_values(state.row.double(), state.col.double(), shape)
    got = state.dequantize()
    assert got.shape == torch.Size(shape) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)
    if got.dim() >= 2:
        # reading and writing again gives the same sums: the factorization is a projection
        again = FactoredState.from_float(got)
        torch.testing.assert_close(again.row, state.row, rtol=1e-5, atol=0)
        torch.testing.assert_close(again.col, state.col, rtol=1e-5, atol=0)


@pytest.mark.parametrize("scale", [1.0, 1e-39, 1e-44], ids=["normal", "subnormal", "subnormal, few bits"])
@pytest.mark.parametrize("shape", [(7,), (1,), (4096,)], ids=str)
def test_one_dimensional_states_are_exact(shape, scale):
    """Each value is its row's sum, read as row * (col / total) with col = total: exact, subnormal
    sums too (a total clamped to float32's smallest normal read 1e-39 as 8.5e-40)."""
    x = nonnegative(shape) * scale
    assert torch.equal(FactoredState.from_float(x).dequantize(), x)


def test_rank_one_states_are_exact_up_to_rounding():
    x = torch.outer(nonnegative(40, seed=1), nonnegative(30, seed=2))
    torch.testing.assert_close(FactoredState.from_float(x).dequantize(), x, rtol=1e-5, atol=0)


def test_zeros_and_zero_totals_read_as_zero():
    assert torch.equal(FactoredState.zeros((5, 6)).dequantize(), torch.zeros(5, 6))
    assert torch.equal(FactoredState.from_float(torch.zeros(5, 6)).dequantize(), torch.zeros(5, 6))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_poisons_every_value(bad):
    """Its row and column sums, and the total every value divides by, become non-finite: the state
    turns non-finite as a whole (a blockwise state loses its block), never silently finite."""
    x = nonnegative((6, 50))
    x[2, 7] = bad
    assert not torch.isfinite(FactoredState.from_float(x).dequantize()).any()


def test_dcp_round_trip(tmp_path):
    """torch.distributed.checkpoint saves and loads it in one process, to the same sums."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    state = FactoredState.from_float(nonnegative((6, 50)))
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"v": state}, checkpoint_id=tmp_path)
    loaded = FactoredState.zeros((6, 50))
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"v": loaded}, checkpoint_id=tmp_path)
    assert torch.equal(loaded.row, state.row) and torch.equal(loaded.col, state.col)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_row_and_col_swapped_is_refused(tmp_path):
    """A (48, 96) parameter's second moment with its 96 column sums as rows and 48 row sums as
    columns fits its element count, and would be read as the other grouping at every later step:
    refused at the load, from a file (torch.load) and through DCP (whose copy_ reads it)."""
    import torch.distributed.checkpoint as dcp

    def trained():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(48, 96))
        opt = lowbit_optim.AdamW([p], state_format={"exp_avg": "8bit", "exp_avg_sq": "factored"}, compile=False)
        p.grad = torch.randn(48, 96)
        opt.step()
        return opt

    saved = trained().state_dict()
    state = saved["state"][0]["exp_avg_sq"]
    state.row, state.col = state.col.clone(), state.row.clone()
    message = r"row and col hold sums of 96 rows and 48 columns, where its shape groups 48 rows of 96 \(row and col swapped\?\)"
    with pytest.raises(ValueError, match=r"checkpoint state 'exp_avg_sq' of parameter 0 \(shape \(48, 96\)\) is corrupt: " + message):
        trained().load_state_dict(saved)
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    target = trained().state_dict()
    with pytest.raises(dcp.api.CheckpointException, match="copy_ from a checkpoint's state, which is corrupt: " + message):
        dcp.load(target, checkpoint_id=tmp_path, no_dist=True)


@pytest.mark.parametrize("shape", [(9, 64), (9, 4, 16), (300,)], ids=str)
def test_row_slices_read_the_parent(shape):
    state = FactoredState.from_float(nonnegative(shape))
    part = state[2:7]
    assert part.part and part.shape == (5, *shape[1:])
    assert torch.equal(part.dequantize(), state.dequantize()[2:7])
    assert part.row.untyped_storage().data_ptr() == state.row.untyped_storage().data_ptr() and part.col is state.col


@pytest.mark.parametrize("destination", ["zeros", "stepped"])
def test_row_slices_assemble_the_whole(destination):
    """How DCP loads resharded chunks: writing every row slice leaves the row and column sums of
    everything written, as if it had been written at once, into a fresh all-zero state or one that has
    stepped (whose later slices' old shares are the state's before the first write, not after it), and
    again in a second load; DCP writes through detached views."""
    x = nonnegative((9, 64))
    row, col = reference_factors(x)
    for source in (x, FactoredState.from_float(x)):  # plain values, or a saved state (its values)
        state = FactoredState.zeros((9, 64)) if destination == "zeros" else FactoredState.from_float(nonnegative((9, 64), seed=3))
        for load in range(2):
            for rows in (slice(0, 4), slice(4, 9)):  # e.g. the chunks two ranks saved, loaded on one
                state.detach()[rows].copy_(source[rows])
            torch.testing.assert_close(state.row.double(), row, rtol=1e-6, atol=0)
            # (the old sums cancel in fp32: a few ulps of theirs; the shares after the first write were 20 % off)
            torch.testing.assert_close(state.col.double(), col, rtol=1e-5, atol=0)


def test_row_slices_reshard_chunks_of_other_ranks():
    """DCP loading 3 ranks' chunks on 2 (9 rows: 3 + 3 + 3 into 5 + 4) writes a slice of a saved
    chunk into a slice of a new one: each new state then holds the row and column sums of the saved
    values of its rows (a slice's column sums were copied raw: the whole saved chunk's replaced the
    new state's)."""
    saved = [FactoredState.from_float(nonnegative((3, 64), seed=i)) for i in range(3)]
    values = torch.cat([s.dequantize() for s in saved]).double()
    writes = {(0, 5): [((0, 3), 0, (0, 3)), ((3, 5), 1, (0, 2))], (5, 9): [((0, 1), 1, (2, 3)), ((1, 4), 2, (0, 3))]}
    for (start, end), chunks in writes.items():
        state = FactoredState.zeros((end - start, 64))
        for (a, b), i, (c, d) in chunks:
            state.detach()[a:b].copy_(saved[i].detach()[c:d])
        torch.testing.assert_close(state.row.double(), values[start:end].sum(1), rtol=1e-6, atol=0)
        torch.testing.assert_close(state.col.double(), values[start:end].sum(0), rtol=1e-5, atol=0)


def test_a_series_of_slice_writes_left_unfinished_ends_at_the_next_write_of_the_whole():
    """A load that raised after some slices, then steps: a later slice write takes its
    share from the sums as they are, not from those before the unfinished series."""
    state = FactoredState.from_float(nonnegative((9, 64), seed=1))
    state.detach()[0:4].copy_(nonnegative((4, 64), seed=2))
    state.row.mul_(3.0), state.col.mul_(3.0)  # a step's write in place (the kernel's, the compiled step's)
    row, col = state.row.double().clone(), state.col.double().clone()
    y = nonnegative((5, 64), seed=4)
    state.detach()[4:9].copy_(y)
    torch.testing.assert_close(state.col.double(), col - row[4:9].sum() / col.sum() * col + y.double().sum(0), rtol=1e-5, atol=0)


def test_writing_a_row_slice_replaces_its_share_of_the_column_sums():
    """Over a non-zero state a slice's share of the column sums is what its values hold (its row sums'
    fraction of each column sum); a write replaces that share with the new values' column sums."""
    state = FactoredState.from_float(nonnegative((9, 64), seed=1))
    row, col = state.row.double().clone(), state.col.double().clone()
    y = nonnegative((3, 64), seed=2)
    state[2:5].copy_(y)
    expected_col = col - row[2:5].sum() / col.sum() * col + y.double().sum(0)
    torch.testing.assert_close(state.col.double(), expected_col, rtol=1e-5, atol=0)
    torch.testing.assert_close(state.row[2:5].double(), y.double().sum(1), rtol=1e-6, atol=0)
    assert torch.equal(state.row[:2].double(), row[:2]) and torch.equal(state.row[5:].double(), row[5:])


def test_memory_is_rows_plus_columns():
    state = FactoredState.zeros((768, 3072))
    assert (state.row.numel(), state.col.numel()) == (768, 3072)
    assert sum(t.nbytes for t in state._inner().values()) == 4 * (768 + 3072)


# ------------------------------------------------------------------------------------------------
# The Adam step with a factored second moment
# ------------------------------------------------------------------------------------------------

LR, BETAS, EPS, WD, STEPS = 1e-2, (0.9, 0.99), 1e-8, 0.1, 5


def reference_adamw(p0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """AdamW in float64 whose stored second moment is factored after every step: this step's update
    uses v = beta2 * (factored v) + (1 - beta2) * g**2, and only v's row and column sums are kept."""
    p, m = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64)
    row, col = reference_factors(torch.zeros_like(p0))
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p - LR * WD * p
        m = m + (1 - BETAS[0]) * (g - m)
        v_stored = reference_values(row, col, p.shape)
        v = v_stored + (1 - BETAS[1]) * (g * g - v_stored)
        row, col = reference_factors(v)
        denom = v.sqrt() / (1 - BETAS[1] ** t) ** 0.5 + EPS
        p = p - LR * (m / (1 - BETAS[0] ** t)) / denom
    return p


@pytest.mark.parametrize("shape", [(48, 80), (300,)], ids=str)
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_adamw_matches_float64_reference(shape, compile):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(shape))
    grads = [torch.randn(shape) * 10 ** torch.empty(shape).uniform_(-2, 1) for _ in range(STEPS)]
    expected = reference_adamw(param.detach(), grads)
    opt = lowbit_optim.AdamW(
        [param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, min_quantize_numel=0, compile=compile,
        state_format={"exp_avg": "fp32", "exp_avg_sq": "factored"},
    )  # fmt: skip
    for g in grads:
        param.grad = g
        opt.step()
    assert type(opt.state[param]["exp_avg_sq"]) is FactoredState
    torch.testing.assert_close(param.detach().double(), expected, rtol=1e-5, atol=1e-6)


class TestMessages(expecttest.TestCase):
    def test_signed_states_are_refused(self):
        with self.assertRaises(ValueError) as caught:
            lowbit_optim.AdamW([torch.nn.Parameter(torch.zeros(64, 64))], state_format="factored")
        self.assertExpectedInline(str(caught.exception), """the 'factored' state format holds nonnegative states only: use it for exp_avg_sq, e.g. state_format={'exp_avg': '4bit', 'exp_avg_sq': 'factored'}""")
        with self.assertRaises(ValueError):
            FactoredState.from_float(torch.randn(4, 4), signed=True)

    def test_slicing_other_rows_is_refused(self):
        with self.assertRaises(NotImplementedError) as caught:
            FactoredState.zeros((4, 8)).view(-1)[0:2]
        self.assertExpectedInline(str(caught.exception), """FactoredState ('factored' state format) of shape (32,) factors 4 rows: only a view whose first dimension is those rows can be sliced; call .dequantize() first, and to write, copy_ the edited values back (v = state.dequantize(); v[...] = x; state.copy_(v)); a whole optimizer state dict: lowbit_optim.dequantize_state_dict(sd)""")

    def test_repr(self):
        self.assertExpectedInline(repr(FactoredState.zeros((3, 4, 5), dtype=torch.bfloat16)), """FactoredState(shape=(3, 4, 5), signed=False, factors=(3, 20), dtype=torch.bfloat16, device=cpu)""")
