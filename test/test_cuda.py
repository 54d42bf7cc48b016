"""The GPU path (skipped without CUDA; CI has none): every optimizer x every format steps on a CUDA
device and computes what the CPU computes, up to codes flipped by round-off; its checkpoint loads on
the CPU with the same bits.

Both devices step the same parameters with the same fixed gradients (test_optimizers.gradients):
gradients computed on each device by a model's backward differ in round-off, and Adam-like steps,
which normalize tiny gradients to full-size updates, carry such a difference into every later step.

On the GPU the step is the compiled one (the fused kernel is CPU-only), by default in foreach
chunks. It is compiled here for AdamW with every format and for every optimizer with the formats the
compiled matrix covers (optimizer_info.COMPILED_FORMATS); the other cells step eagerly, which runs
the same format handlers on CUDA tensors without a compile per cell. The CPU side steps eagerly.
The per-parameter graph (foreach=False), with a parameter cut into slices, has a test of its own.
"""

import pytest
import torch
from conftest import FORMATS, format_info
from optimizer_info import COMPILED_FORMATS, OPTIMIZERS
from test_optim import COMPILED_PARAM_ATOL, assert_same_bits, save_and_load
from test_optimizers import assert_agree_but_for_flipped_codes, gradients, run, states_of
from torch import nn

from lowbit_optim import StateTensor
from lowbit_optim.lowrank import LowRankState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = [pytest.param(o, f, id=f"{o.name}-{f.name}") for o in OPTIMIZERS for f in FORMATS if o.spec(f) is not None]
STEPS = 3


def stepped(opt_info, info, device: str, **kwargs) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    return run(lambda params: opt_info.make(params, state_format=opt_info.spec(info), **kwargs), gradients(opt_info, STEPS), opt_info, device)


def device_param_tol(opt_info, states: dict) -> dict | None:
    """A low-rank part is matrix products and QRs, which each device sums in its own order: its
    values differ by about 1e-6 of the largest, and a step that is not normalized (SGD) moves a
    parameter by lr times that (emulated on the CPU with float64 products and QRs: up to 0.8e-6 x lr
    x the largest momentum, SGD with 8bit-lowrank after 3 steps). None: the comparison's own
    tolerance (an optimizer's compiled_param_tol stays)."""
    if opt_info.compiled_param_tol is not None or not any(isinstance(s, LowRankState) and s.rank for s in states.values()):
        return None
    largest = max(float((s.dequantize() if isinstance(s, StateTensor) else s).abs().max()) for s in states.values())
    return dict(rtol=0.0, atol=COMPILED_PARAM_ATOL + 2e-6 * opt_info.lr * largest)


@pytest.mark.parametrize("opt_info, info", CASES)
def test_cuda_steps_like_the_cpu(opt_info, info):
    compile = opt_info.name == "AdamW" or info.name in COMPILED_FORMATS
    cuda_params, cuda_opt = stepped(opt_info, info, "cuda", compile=compile)
    cpu_params, cpu_opt = stepped(opt_info, info, "cpu", compile=False, fused=False)
    cuda_states = states_of(cuda_opt, cuda_params)
    for key, state in cuda_states.items():
        inner = state._inner().values() if isinstance(state, StateTensor) else [state]
        assert state.is_cuda and all(t.is_cuda for t in inner), key
    # the tolerance from the CPU's states: a GPU bug that inflated its own must not widen it
    cpu_states = states_of(cpu_opt, cpu_params)
    assert_agree_but_for_flipped_codes([(cuda_params, cuda_opt), (cpu_params, cpu_opt)], opt_info, info, device_param_tol(opt_info, cpu_states))

    # a GPU checkpoint resumes on the CPU: the states arrive with their bits
    resumed_params = [nn.Parameter(p.detach().cpu()) for p in cuda_params]
    resumed = opt_info.make(resumed_params, state_format=opt_info.spec(info), compile=False, fused=False)
    resumed.load_state_dict(save_and_load(cuda_opt.state_dict()))
    for key, state in states_of(resumed, resumed_params).items():
        assert state.device.type == "cpu", key
        assert_same_bits(state, cuda_states[key].cpu(), key)


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_cuda_per_parameter_slices_step_like_the_cpu(fmt, monkeypatch):
    """foreach=False on the GPU: one graph call per parameter, and per slice of one above the slice
    size (made the CPU's COMPILED_CHUNK here, 1M, from the GPU's 8M: 1.1M elements, a slice of 1M
    and one of 51,424, ending in a partial block)."""
    import lowbit_optim.base as base

    monkeypatch.setattr(base, "FOREACH_ELEMENTS", base.COMPILED_CHUNK)
    sliced = []
    pieces = base._pieces
    monkeypatch.setattr(base, "_pieces", lambda call, limit: sliced.append(len(pieces(call, limit))) or pieces(call, limit))
    adamw = next(o for o in OPTIMIZERS if o.name == "AdamW")
    runs = []
    for device, kwargs in (("cuda", dict(foreach=False)), ("cpu", dict(compile=False, fused=False))):
        g = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(shape, generator=g).to(device)) for shape in ((1100, 1000), (71,))]
        opt = adamw.make(params, state_format=fmt, **kwargs)
        for _ in range(STEPS):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(device)
            opt.step()
        runs.append((params, opt))
        assert 2 in sliced, (device, sliced)  # the 1.1M-element parameter went in two slices
        sliced.clear()
    assert_agree_but_for_flipped_codes(runs, adamw, format_info(fmt))


def test_cuda_step_inside_a_cuda_graph_compile():
    """torch.compile(mode="reduce-overhead") around opt.step(): a CUDA graph would replay the
    kernels of one step without its Python (step counts and lr frozen); the step op is tagged
    cudagraph_unsafe, so each step is the eager one's, bit for bit."""
    from test_drop_in import assert_same_training
    from test_optim import make_mlp

    import lowbit_optim

    models = [make_mlp().cuda() for _ in range(2)]
    opts = [lowbit_optim.AdamW(m.parameters(), lr=1e-3, state_format="8bit") for m in models]
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(0)).cuda()
    compiled_step = torch.compile(opts[1].step, mode="reduce-overhead")
    for step in range(4):
        for model, step_fn in ((models[0], opts[0].step), (models[1], compiled_step)):
            model(x).square().mean().backward()
            step_fn()
            model.zero_grad()
        for opt in opts:
            opt.param_groups[0]["lr"] = 1e-3 / (step + 2)
    assert_same_training(models[0], opts[0], models[1], opts[1])
