"""The compiled step on a large parameter runs in slices of about COMPILED_CHUNK elements (an
optimizer that declares ``elementwise_step``), so its scratch never scales with the parameter: the
slices compute exactly what one call on the whole parameter computes, count the step once, and
share the graph of the whole. Under foreach the slices are FOREACH_ELEMENTS long, and a chunk's
graph takes at most that many elements."""

import pytest
import torch
from conftest import FORMATS
from optimizer_info import OPTIMIZERS
from test_optim import assert_same_bits
from torch._dynamo.utils import counters

from lowbit_optim import base

ELEMENTWISE = [o for o in OPTIMIZERS if o.cls.elementwise_step]
SHAPES = [(40, 125), (300,)]  # 5000 elements: 10 slices of 512 (and a short last one) at chunk 512


def run(opt_info, chunk: int, monkeypatch, steps: int = 3, dtype=torch.float32, shapes=SHAPES, **kwargs):
    monkeypatch.setattr(base, "COMPILED_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    opt = opt_info.make(params, fused=False, min_quantize_numel=0, **kwargs)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
    return params, opt


def record(monkeypatch, name: str, summary) -> list:
    """Spy on ``base.<name>``: ``summary`` of what each call returns, in order."""
    summaries, original = [], getattr(base, name)

    def spy(*args):
        result = original(*args)
        summaries.append(summary(result))
        return result

    monkeypatch.setattr(base, name, spy)
    return summaries


def record_pieces(monkeypatch) -> list[list[int]]:
    """The sizes of the slices of each call base._pieces cuts."""
    return record(monkeypatch, "_pieces", lambda pieces: [piece[0].numel() for piece in pieces])


def assert_same(a, b):
    (params_a, opt_a), (params_b, opt_b) = a, b
    for p, q in zip(params_a, params_b):
        assert_same_bits(p, q, tuple(p.shape))
        for name, value in opt_a.state[p].items():
            assert_same_bits(value, opt_b.state[q][name], (tuple(p.shape), name))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("opt_info", ELEMENTWISE, ids=str)
def test_slices_compute_what_the_whole_does(opt_info, fmt, monkeypatch):
    spec = opt_info.spec(fmt)
    if spec is None:
        pytest.skip(f"{fmt} holds none of {opt_info}'s states")
    kwargs = dict(state_format=spec, compile=False)
    assert_same(run(opt_info, 512, monkeypatch, **kwargs), run(opt_info, 1 << 30, monkeypatch, **kwargs))


@pytest.mark.parametrize("param_update", ["kahan", "int8-correction"])
def test_bf16_weights_with_a_buffer_in_slices(param_update, monkeypatch):
    kwargs = dict(state_format="4bit", compile=False, param_update=param_update)
    assert_same(run(OPTIMIZERS[0], 512, monkeypatch, dtype=torch.bfloat16, **kwargs), run(OPTIMIZERS[0], 1 << 30, monkeypatch, dtype=torch.bfloat16, **kwargs))


def test_factored_states_are_not_cut(monkeypatch):
    kwargs = dict(state_format={"exp_avg": "8bit", "exp_avg_sq": "factored"}, compile=False)
    pieces = record_pieces(monkeypatch)
    run(OPTIMIZERS[0], 512, monkeypatch, steps=1, **kwargs)
    assert [len(sizes) for sizes in pieces] == [1, 1]


def test_compiled_slices_share_the_graph_of_the_whole(monkeypatch):
    """Compiled: the slices give the unsliced bits, and the sliced run adds no graph to the 8bit
    step's (one per argument kinds, whatever the slice's size and offset)."""
    kwargs = dict(state_format="8bit", param_update="kahan", dtype=torch.bfloat16)
    whole = run(OPTIMIZERS[0], 1 << 30, monkeypatch, **kwargs)
    graphs = counters["stats"]["unique_graphs"]
    pieces = record_pieces(monkeypatch)
    sliced = run(OPTIMIZERS[0], 512, monkeypatch, **kwargs)
    assert counters["stats"]["unique_graphs"] == graphs
    assert [len(sizes) for sizes in pieces] == [10, 1] * 3  # 5000 elements in 512-element slices; 300 in one
    assert_same(sliced, whole)


def test_a_partial_last_slice_may_be_traced_first(monkeypatch):
    """The first graph of a configuration may be traced on slices (a large parameter stepped
    first), the last one ending in a partial block (5000 elements in slices of 1024 at block size
    128). The slices are detached views: dynamo failed to bind a view's size as its base's size
    minus its offset. No other test steps blocks of 128 compiled, so this one traces that graph
    (asserted: a graph cached by another test would hide the failure)."""
    kwargs = dict(state_format="8bit", block_size=128, shapes=[(5000,)])
    graphs = counters["stats"]["unique_graphs"]
    sliced = run(OPTIMIZERS[0], 1024, monkeypatch, **kwargs)
    assert counters["stats"]["unique_graphs"] > graphs, "another test traced this graph first: give this one a block size of its own"
    assert_same(sliced, run(OPTIMIZERS[0], 1 << 30, monkeypatch, **kwargs))


def test_foreach_chunks_hold_bounded_elements(monkeypatch):
    """foreach=True, compiled: a chunk holds at most FOREACH_ELEMENTS (here 2048) elements, so the
    300- and 1200-element parameters share one and the 5000-element one is cut into slices of 2048,
    each stepped by the per-parameter graph (a slice would fill a chunk alone); the bits of one
    call on each whole parameter."""
    monkeypatch.setattr(base, "FOREACH_ELEMENTS", 2048)
    chunks = record(monkeypatch, "_foreach_chunks", lambda result: [[call[0].numel() for _, call, _ in chunk] for chunk in result])
    pieces = record_pieces(monkeypatch)
    kwargs = dict(state_format="8bit", param_update="kahan", dtype=torch.bfloat16, shapes=[(40, 125), (300,), (30, 40)])
    together = run(OPTIMIZERS[0], 1 << 30, monkeypatch, foreach=True, **kwargs)
    assert chunks == [[[300, 1200]]] * 3
    assert pieces == [[2048, 2048, 904], [300], [1200]] * 3
    assert_same(together, run(OPTIMIZERS[0], 1 << 30, monkeypatch, foreach=False, **kwargs))


@pytest.mark.parametrize("device, sizes", [("cpu", [512] * 9 + [392]), ("meta", [2048, 2048, 904])])
def test_per_parameter_slices_are_longer_on_an_accelerator(monkeypatch, device, sizes):
    """One call per parameter (foreach=False): slices of COMPILED_CHUNK (here 512) elements on the
    CPU, whose scratch then stays in its caches; of FOREACH_ELEMENTS (here 2048) on an accelerator
    (meta stands in for one), where each call costs ~200 us of host time (measured on an H200)."""
    monkeypatch.setattr(base, "COMPILED_CHUNK", 512)
    monkeypatch.setattr(base, "FOREACH_ELEMENTS", 2048)
    monkeypatch.setattr(base, "compiled_step", lambda step_function: step_function)  # eager: meta has no kernels
    pieces = record_pieces(monkeypatch)
    param = torch.nn.Parameter(torch.randn(5000, device=device))
    opt = OPTIMIZERS[0].make([param], state_format="8bit", fused=False, foreach=False)
    param.grad = torch.ones_like(param)
    opt.step()
    assert pieces == [sizes]


def test_a_state_is_cut_only_where_its_class_hands_out_later_slices():
    """A state with whole-state tensors (a count of writes) is cut only where its class's
    later_slice matches its quantize_: a subclass with a quantize_ of its own, or a format that
    declares such tensors without a later_slice, is stepped whole instead of failing or drawing
    otherwise on a large parameter."""
    from lowbit_optim import BlockFloatState, OptimState8bit
    from lowbit_optim.stochastic_bf16 import StochasticBF16State

    class OwnQuantize(BlockFloatState):
        name = None

        def quantize_(self, x):
            super().quantize_(x)

    class CountsWithoutLaterSlice(OptimState8bit):
        name = None
        whole_state_names = ("scale",)

    assert BlockFloatState.zeros(512).slice_unit == 256 and StochasticBF16State.zeros(512).slice_unit == 256
    assert OwnQuantize.zeros(512).slice_unit is None and CountsWithoutLaterSlice.zeros(512).slice_unit is None
    assert OptimState8bit.zeros(512, block_size=64).slice_unit == 64
