"""FSDP2 (``fully_shard``) with sharded optimizer states, and distributed checkpoints that reshard.

Runs on CPU with the gloo backend. One 2-rank job (this file run as a script, twice) goes through every
check in sequence and saves what it measured; the tests below only read those results, so the suite
pays for two processes, and their torch.compile graphs, once.

For each of the 8bit, 4bit and fp8 formats the job trains the same little model (one Linear per case
below) for a few steps twice: on one process without FSDP (the reference) and FSDP2-sharded over the 2
ranks, each rank taking half of every batch. It then checkpoints both with ``torch.distributed.checkpoint``
and loads the checkpoints 2 -> 2 (through ``optimizer.state_dict()`` and through
``get_state_dict`` / ``set_state_dict``), 2 -> 1 and 1 -> 2, and a ``full_state_dict=True`` one. The
8bit scenario runs the compiled step (on the local shards), the others run it eagerly.

Parameter cases (row-wise shards, as FSDP2 makes them):

- ``aligned``: 9 x 512, uneven shards (5 and 4 rows); shard boundaries fall on block boundaries, so
  resharding is bit-exact;
- ``unaligned``: 7 x 1000, uneven shards whose boundary falls inside a block: resharding requantizes
  the blocks that then mix two saved blocks;
- ``invariant``: 2 x 3072 = 6144 elements, quantized although each rank holds 3072 < min_quantize_numel;
- ``small``: 3 x 100 and its bias, in a group with min_quantize_numel=0: shards of 200, 100, 2 and 1
  elements, smaller than a block;
- ``one_row``: 1 x 4096: rank 1's shard is empty.

The tests at the end run in this process: the copies DCP makes between saved and wanted chunks, for
every registered format, single-process checkpoints between formats, and dcp.async_save.
"""

import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORLD = 2
FORMATS = ["8bit", "4bit", "fp8"]
COMPILED = {"8bit"}  # the others run the same step eagerly: each compiled format costs its own graphs
STEPS, MORE = 3, 2  # steps before the checkpoint, steps after it
BATCH = 4
CASES = {  # name -> (in_features, out_features): weight shape (out, in)
    "aligned": (512, 9),
    "unaligned": (1000, 7),
    "invariant": (3072, 2),
    "small": (100, 3),
    "one_row": (4096, 1),
}
ALIGNED = ["aligned.weight", "invariant.weight", "one_row.weight"]  # shard boundaries on block boundaries
UNALIGNED = ["unaligned.weight", "small.weight", "small.bias"]
JOB_TIMEOUT_S = 420


def _gloo_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


# one worker runs this file under `--dist loadgroup` (the README's command): its 2-rank job runs once
# without another worker waiting on the lock that shares it otherwise
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed"), pytest.mark.xdist_group("test_fsdp")]
needs_gloo = pytest.mark.skipif(not _gloo_available(), reason="needs torch.distributed with the gloo backend")


# ------------------------------------------------------------------------------------------------
# The job (runs in the 2 worker processes)
# ------------------------------------------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        for name, (fan_in, fan_out) in CASES.items():
            self.add_module(name, torch.nn.Linear(fan_in, fan_out, bias=name == "small"))

    def forward(self, inputs):
        return sum(((module(x) - 1) ** 2).mean() for module, x in zip(self.children(), inputs))


def _build(fmt: str, fsdp: bool, optimizer: str = "AdamW", **options):
    """The model (sharded or not) and ``optimizer`` over it; the small layer quantized too."""
    import lowbit_optim
    from torch.distributed.fsdp import fully_shard

    model = _Net()
    if fsdp:
        fully_shard(model)
    if optimizer == "MuonWithAdamW":  # it splits the model: Muon on the weights but one_row's (as its head), AdamW on the rest
        return model, lowbit_optim.MuonWithAdamW(model, head="one_row", state_format=fmt, min_quantize_numel=0, **options)
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.startswith("small.")]},
        {"params": list(model.small.parameters()), "min_quantize_numel": 0},
    ]
    if optimizer == "Muon":  # matrices only (the bias stays as it is)
        groups = [{**g, "params": [p for p in g["params"] if p.dim() == 2]} for g in groups]
    options = options or dict(lr=1e-2, compile=fmt in COMPILED)
    return model, getattr(lowbit_optim, optimizer)(groups, state_format=fmt, **options)


def _batch(step: int, rank: int, world: int):
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = [torch.randn(BATCH, fan_in, generator=generator) for fan_in, _ in CASES.values()]
    per_rank = BATCH // world
    return [x[rank * per_rank : (rank + 1) * per_rank] for x in inputs]


def _train(model, opt, first: int, steps: int, rank: int, world: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        loss = model(_batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _values(t) -> torch.Tensor:
    """Full dequantized fp32 values of a (possibly sharded, possibly quantized) tensor."""
    from lowbit_optim import OptimState

    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return (t.dequantize() if isinstance(t, OptimState) else t).float()


def _params(model) -> dict:
    return dict(model.named_parameters())


def _full_states(model, opt) -> dict:
    """name -> {"exp_avg": values, "exp_avg_sq": values, "step": float}; a collective for sharded ones."""
    return {
        name: {key: (float(v) if key == "step" else _values(v)) for key, v in opt.state.get(p, {}).items()}
        for name, p in _params(model).items()
    }


def _local_states(model, opt) -> dict:
    """name -> {state: a format's inner tensors (codes and scale; bf16-sr's values and count of
    writes) or a plain local tensor}, cloned, for bit-exact comparisons."""
    out = {}
    for name, p in _params(model).items():
        out[name] = {}
        for key, v in opt.state.get(p, {}).items():
            v = _local(v)
            inner = v.__tensor_flatten__()[0] if hasattr(v, "__tensor_flatten__") else None
            out[name][key] = tuple(getattr(v, attr).clone() for attr in inner) if inner else v.clone()
    return out


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def _rel_error(values: dict, reference: dict) -> dict:
    """name.state -> max |difference| / max |reference|."""
    out = {}
    for name, states in reference.items():
        for key in ("exp_avg", "exp_avg_sq"):
            ref = states[key]
            out[f"{name}.{key}"] = float((values[name][key] - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
    return out


def _differing_fraction(values: dict, reference: dict) -> dict:
    """name.state -> the fraction of elements that differ by more than 1e-5 x max |reference|."""
    out = {}
    for name, states in reference.items():
        for key in ("exp_avg", "exp_avg_sq"):
            ref = states[key]
            out[f"{name}.{key}"] = float(((values[name][key] - ref).abs() > 1e-5 * ref.abs().max()).double().mean())
    return out


def _save(model, opt, path, no_dist=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, no_dist=no_dist)


def _load(model, opt, path, no_dist=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, _optimizers(opt))  # creates the optimizer states (a step with lr 0)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    set_state_dict(model, _optimizers(opt), model_state_dict=state["model"], optim_state_dict=state["optim"])


def _optimizers(opt):
    """The optimizer, or MuonWithAdamW's two: DCP's helpers take either, and a checkpoint saved of
    one (_save: the optimizer) loads into the other (_load)."""
    return getattr(opt, "optimizers", opt)


def _init_states(model, opt):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lr = opt.param_groups[0]["lr"]
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad()


def _scenario(fmt: str, rank: int, world: int, workdir: pathlib.Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    import lowbit_optim

    out = {}
    ckpt_fsdp, ckpt_direct, ckpt_ref, ckpt_back = (str(workdir / f"{fmt}-{n}") for n in ("fsdp", "direct", "ref", "back"))

    # -- training: FSDP2 on 2 ranks, and the 1-process reference (rank 0)
    model, opt = _build(fmt, fsdp=True)
    out["fsdp_losses"] = _train(model, opt, 0, STEPS, rank, world)
    out["state_kinds"] = {
        name: {key: [type(_local(v)).__name__, list(_local(v).shape), list(v.shape)] for key, v in opt.state[p].items() if key != "step"}
        for name, p in _params(model).items()
    }
    out["bytes_per_param"] = lowbit_optim.bytes_per_param(opt)  # this rank's states per element of its shards
    fsdp_states = _full_states(model, opt)
    fsdp_params = {name: _values(p) for name, p in _params(model).items()}
    saved_local = _local_states(model, opt)
    # for torch.optim: each DTensor's local state dequantized, laid out as before
    dequantized, ordered = lowbit_optim.dequantize_state_dict(opt.state_dict())["state"], [p for g in opt.param_groups for p in g["params"]]
    out["dequantized_plain"] = all(
        type(_local(v)) is torch.Tensor and torch.equal(_local(v), _values(_local(opt.state[ordered[key]][k])))
        for key, s in dequantized.items() for k, v in s.items() if k != "step"
    )  # fmt: skip
    saved_params = {name: _local(p).detach().clone() for name, p in _params(model).items()}
    _save(model, opt, ckpt_fsdp)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt_direct)
    # full_state_dict=True gathers every state's exact values (DTensor.full_tensor()); loading them
    # quantizes each rank's part anew
    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    out["full_sd_plain"] = all(type(v) is torch.Tensor for s in optim_sd["state"].values() for k, v in s.items() if k != "step")
    model7, opt7 = _build(fmt, fsdp=True)
    _init_states(model7, opt7)
    set_state_dict(model7, opt7, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    out["full_sd_error"] = _rel_error(_full_states(model7, opt7), fsdp_states)
    if rank == 0:
        ref_model, ref_opt = _build(fmt, fsdp=False)
        out["ref_losses"] = _train(ref_model, ref_opt, 0, STEPS, 0, 1)
        out["ref_state_kinds"] = {
            name: {key: type(v).__name__ for key, v in ref_opt.state[p].items() if key != "step"} for name, p in _params(ref_model).items()
        }
        ref_states = _full_states(ref_model, ref_opt)
        ref_codes = _local_states(ref_model, ref_opt)
        out["fsdp_vs_ref"] = _rel_error(fsdp_states, ref_states)
        out["fsdp_vs_ref_differing"] = _differing_fraction(fsdp_states, ref_states)
        out["fsdp_vs_ref_params"] = max(float((fsdp_params[n] - p.detach()).abs().max()) for n, p in _params(ref_model).items())
        ref_params = {name: p.detach().clone() for name, p in _params(ref_model).items()}
        _save(ref_model, ref_opt, ckpt_ref, no_dist=True)
        out["ref_more_losses"] = _train(ref_model, ref_opt, STEPS, MORE, 0, 1)
    dist.barrier()

    # -- FSDP2 training goes on; then 2 -> 2 resumes must repeat it bit for bit
    out["fsdp_more_losses"] = _train(model, opt, STEPS, MORE, rank, world)
    final_local = _local_states(model, opt)
    final_params = {name: _local(p).detach().clone() for name, p in _params(model).items()}

    model2, opt2 = _build(fmt, fsdp=True)
    _load(model2, opt2, ckpt_fsdp)
    out["resume_loaded_exact"] = _same_tree(_local_states(model2, opt2), saved_local) and _same_tree(
        {n: _local(p).detach() for n, p in _params(model2).items()}, saved_params
    )
    out["resume_losses"] = _train(model2, opt2, STEPS, MORE, rank, world)
    out["resume_final_exact"] = _same_tree(_local_states(model2, opt2), final_local) and _same_tree(
        {n: _local(p).detach() for n, p in _params(model2).items()}, final_params
    )

    model3, opt3 = _build(fmt, fsdp=True)  # the direct flow: optimizer.state_dict() / load_state_dict()
    _init_states(model3, opt3)
    state = {"model": model3.state_dict(), "optim": opt3.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_direct)
    model3.load_state_dict(state["model"])
    opt3.load_state_dict(state["optim"])
    out["direct_loaded_exact"] = _same_tree(_local_states(model3, opt3), saved_local)
    out["direct_more_losses"] = _train(model3, opt3, STEPS, MORE, rank, world)

    # -- 2 -> 1: rank 0 loads the FSDP checkpoint into the model without FSDP
    if rank == 0:
        model4, opt4 = _build(fmt, fsdp=False)
        _load(model4, opt4, ckpt_fsdp, no_dist=True)
        loaded = _full_states(model4, opt4)
        out["2to1_params_exact"] = all(torch.equal(fsdp_params[n], p.detach()) for n, p in _params(model4).items())
        out["2to1_steps"] = [loaded[n]["step"] for n in loaded]
        out["2to1_error"] = _rel_error(loaded, fsdp_states)
        out["2to1_staging_left"] = any(hasattr(v, "_dcp_staging") for s in opt4.state.values() for v in s.values())
        out["2to1_more_losses"] = _train(model4, opt4, STEPS, MORE, 0, 1)
    dist.barrier()

    # -- 1 -> 2: both ranks load the reference checkpoint into FSDP2; then back 2 -> 1
    model5, opt5 = _build(fmt, fsdp=True)
    _load(model5, opt5, ckpt_ref)
    loaded = _full_states(model5, opt5)
    loaded_params = {name: _values(p) for name, p in _params(model5).items()}
    out["1to2_kinds"] = {name: type(_local(opt5.state[p]["exp_avg"])).__name__ for name, p in _params(model5).items()}
    _save(model5, opt5, ckpt_back)
    out["1to2_more_losses"] = _train(model5, opt5, STEPS, MORE, rank, world)
    if rank == 0:
        out["1to2_error"] = _rel_error(loaded, ref_states)
        out["1to2_params_exact"] = all(torch.equal(loaded_params[n], p) for n, p in ref_params.items())
        model6, opt6 = _build(fmt, fsdp=False)
        _load(model6, opt6, ckpt_back, no_dist=True)
        back = _local_states(model6, opt6)
        out["round_trip_exact"] = {name: _same_tree(back[name], ref_codes[name]) for name in back}
    dist.barrier()
    return out


# SGD, Lion, AdEMAMix, Muon and MuonWithAdamW with 8bit state: the same sharding and DCP machinery as
# AdamW's (base.py), so one cheap scenario each (eager step): they train sharded and a 2 -> 2 DCP
# checkpoint resumes exactly (MuonWithAdamW's saved through DCP's helpers given it, loaded given its two optimizers)
OTHER_OPTIMIZERS = {
    "SGD": dict(lr=1e-3, momentum=0.9), "Lion": dict(lr=1e-3), "AdEMAMix": dict(lr=1e-2), "Muon": dict(lr=2e-2), "MuonWithAdamW": dict(lr=2e-2),
}  # fmt: skip
ADEMAMIX_RECIPE = {"exp_avg": "8bit-linear", "exp_avg_slow": "10bit-sr", "exp_avg_sq": "10bit-sr"}  # the README's
ADEMAMIX_BF16_SR = {"exp_avg": "8bit-linear", "exp_avg_slow": "bf16-sr", "exp_avg_sq": "bf16-sr"}  # its 16-bit alternative
ADEMAMIX_ALL_8BIT = {"exp_avg": "8bit-linear", "exp_avg_slow": "8bit-lowrank", "exp_avg_sq": "8bit-log"}  # low-rank in the kernel


# 2 ranks against 1 process after STEPS + MORE steps, where shard boundaries fall on block boundaries:
# only gradient sums in another order part them (observed at most 6.1e-7, Muon's aligned matrix bit for
# bit). Where they fall inside a block, each rank quantizes its own blocks, so a state can sit a code
# step apart and move the updates of the steps after it: a few lr (observed: Lion 2e-3 at lr 1e-3, a
# flipped sign; AdEMAMix 1.5e-3 at 1e-2, Muon 3.4e-4 at 2e-2, SGD 7.7e-5 at 1e-3).
ALIGNED_PARAM_ATOL = 1e-6


def _build_other(name: str, fsdp: bool, fmt: str = "8bit", fused: bool = False):
    # the eager reference step (nothing to compile in the ranks' processes), or the fused kernel alone
    return _build(fmt, fsdp, name, **OTHER_OPTIMIZERS[name], **(dict(fused=True) if fused else dict(compile=False)))


def _other_optimizer_scenario(name: str, rank: int, world: int, workdir: pathlib.Path, fmt: str = "8bit", fused: bool = False) -> dict:
    out = {}
    label = fmt if isinstance(fmt, str) else "-".join(fmt.values())
    checkpoint = str(workdir / f"{name}-{label}-fsdp")
    model, opt = _build_other(name, True, fmt, fused)
    out["losses"] = _train(model, opt, 0, STEPS, rank, world)
    out["state_kinds"] = {
        n: {key: [type(v).__name__, type(_local(v)).__name__] for key, v in opt.state.get(p, {}).items() if key != "step"} for n, p in _params(model).items()
    }
    out["kernel_stepped"] = sum(verdict is None for *_, verdict in opt.__dict__.get("_kernel_verdicts", {}).values())  # parameters
    saved_local = _local_states(model, opt)
    _save(model, opt, checkpoint)
    out["more_losses"] = _train(model, opt, STEPS, MORE, rank, world)
    final_local = _local_states(model, opt)
    final_params = {n: _local(p).detach().clone() for n, p in _params(model).items()}
    out["final_full"] = {n: p.detach().full_tensor() for n, p in _params(model).items()}  # collective: every rank

    resumed_model, resumed = _build_other(name, True, fmt, fused)
    _load(resumed_model, resumed, checkpoint)
    out["loaded_exact"] = _same_tree(_local_states(resumed_model, resumed), saved_local)
    out["resume_losses"] = _train(resumed_model, resumed, STEPS, MORE, rank, world)
    out["resume_final_exact"] = _same_tree(_local_states(resumed_model, resumed), final_local) and _same_tree(
        {n: _local(p).detach() for n, p in _params(resumed_model).items()}, final_params
    )
    if rank == 0:
        out.update(_one_process(*_build_other(name, False, fmt, fused)))
    dist.barrier()
    return out


def _one_process(model, opt) -> dict:
    """The reference: STEPS + MORE steps in one process, its losses and final parameters."""
    losses = _train(model, opt, 0, STEPS + MORE, 0, 1)
    return {"ref_losses": losses, "ref_final": {n: p.detach().clone() for n, p in _params(model).items()}}


def _step_in_backward_scenario(rank: int, world: int) -> dict:
    """4bit AdamW on FSDP2 twice, stepping after backward and in it (each hook sees its reduced local
    shard), with 2 micro-batches per step: the local parameters and states must be the same bits."""
    out = {}
    runs = []
    for in_backward in (False, True):
        model, opt = _build("4bit", True, lr=1e-2, step_in_backward=in_backward)
        for step in range(STEPS):
            for micro in range(2):
                loss = model(_batch(2 * step + micro, rank, world))
                if micro == 0 and in_backward:
                    with opt.accumulating():
                        loss.backward()
                else:
                    loss.backward()
            out.setdefault("grads_left", []).append(any(p.grad is not None for p in model.parameters()))
            opt.step()
            opt.zero_grad()
        runs.append((_params(model), _local_states(model, opt)))
    out["grads_left"] = out["grads_left"][STEPS:]  # the in-backward run's
    out["params_exact"] = _same_tree({n: _local(p).detach() for n, p in runs[0][0].items()}, {n: _local(p).detach() for n, p in runs[1][0].items()})
    out["states_exact"] = _same_tree(runs[0][1], runs[1][1])
    out.update(_clipping_in_backward(rank, world))
    return out


def _clipping_in_backward(rank: int, world: int, max_grad_norm: float = 0.05) -> dict:
    """max_grad_norm in backward on FSDP2: each hook clips with the larger of the previous step's
    global norm and this rank's norm so far; the step's global norm is summed over the ranks at the
    end. The reference steps after backward and clips each local gradient by that rule (the hooks'
    order recorded by a hook of its own)."""
    import lowbit_optim

    (model, opt), (ref, ref_opt) = (_build("8bit", True, "SGD", lr=0.1, momentum=0.9, **extra) for extra in (dict(step_in_backward=True, max_grad_norm=max_grad_norm), {}))
    order = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(order.append)
    pairs = dict(zip(model.parameters(), ref.parameters()))
    norms, references, previous = [], [], torch.zeros(())
    for step in range(STEPS):
        order.clear()
        model(_batch(step, rank, world)).backward()
        ref(_batch(step, rank, world)).backward()
        square_sum = torch.zeros(())
        local_norms = [torch.linalg.vector_norm(_local(p.grad), 2, dtype=torch.float32) for p in ref.parameters()]
        for p in [pairs[q] for q in order]:
            square_sum += torch.linalg.vector_norm(_local(p.grad), 2, dtype=torch.float32).square()
            _local(p.grad).mul_(torch.clamp(max_grad_norm / (torch.maximum(square_sum.sqrt(), previous) + 1e-6), max=1.0))
        total = torch.stack(local_norms).double().square().sum()
        dist.all_reduce(total)
        previous = total.sqrt().float()
        ref_opt.step()
        ref_opt.zero_grad()
        norms.append(float(opt.last_grad_norm))
        references.append(float(previous))
    return {
        "clipped_norms": norms,
        "clipped_reference_norms": references,
        "clipped_params_exact": _same_tree({n: _local(p).detach() for n, p in _params(model).items()}, {n: _local(p).detach() for n, p in _params(ref).items()}),
        "clipping_bites": all(n > max_grad_norm for n in references) and isinstance(opt, lowbit_optim.SGD),
    }


def _muon_float64_scenario(rank: int, world: int) -> dict:
    """Muon's sharded step (muon_fsdp) after a parameter was made float64 through .data: refused?"""
    from torch.distributed.tensor import distribute_tensor

    model, opt = _build_other("Muon", True, "fp32")
    _train(model, opt, 0, 1, rank, world)
    weight = next(p for p in model.parameters() if p.dim() == 2)
    weight.data = weight.data.double()
    weight.grad = distribute_tensor(torch.zeros(weight.shape, dtype=torch.float64), weight.device_mesh, weight.placements)
    try:
        opt.step()
    except TypeError as error:
        return {"refused": str(error)}
    return {"refused": None}


def _optimizer_before_fully_shard_scenario(rank: int, world: int) -> dict:
    """The optimizer built before fully_shard holds the parameters it replaced: its step warns,
    stepping after backward and in it (whose hooks sit on the replaced parameters)."""
    import warnings

    import lowbit_optim
    from torch.distributed.fsdp import fully_shard

    out = {}
    for in_backward in (False, True):
        model = _Net()
        opt = lowbit_optim.AdamW(model.parameters(), lr=1e-2, state_format="8bit", compile=False, step_in_backward=in_backward)
        fully_shard(model)
        model(_batch(0, rank, world)).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        out[in_backward] = {"warnings": [str(w.message) for w in caught], "stepped": len(opt.state)}
    return out


def _broadcast_from_rank0_scenario(rank: int, world: int) -> dict:
    """set_optimizer_state_dict(full_state_dict=True, broadcast_from_rank0=True) of a model without
    FSDP: rank 0's states go as their values, which the other ranks requantize. Rank 0 warns (and
    names the fix), where the replicas silently drifted apart; every rank then steps on."""
    import warnings

    import lowbit_optim
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    model = _Net()
    opt = lowbit_optim.AdamW(model.parameters(), lr=1e-2, state_format="8bit", compile=False)
    model(_batch(0, 0, 1)).backward()
    opt.step()
    saved = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(model, opt, saved if rank == 0 else {}, options=options)
    opt.step()
    return {"warnings": [str(w.message) for w in caught]}


def _sequence_parallel_scenario(rank: int, world: int) -> dict:
    """Tensor parallelism with sequence parallelism: a LayerNorm's Replicate weight and bias get
    Partial(sum) gradients (each rank's part of the sum over its shard of the sequence). The step
    reduces them, as torch.optim's DTensor arithmetic does (it had stepped each rank's part: half the
    update, the replicas apart), and max_grad_norm's norm counts a Replicate gradient once (it had
    counted it once a rank): both as torch.optim and get_total_norm give them. Muon refuses a matrix
    that tensor parallelism shards by columns, or HSDP over a 2-D mesh, naming it and the fix."""
    import lowbit_optim
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))

    def built():
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
        plan = {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))}
        return parallelize_module(block, mesh, plan)

    sequence = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(rank))  # this rank's shard of the sequence
    out = {}
    for name, make in (("torch", lambda ps: torch.optim.SGD(ps, lr=1.0)), ("lowbit", lambda ps: lowbit_optim.SGD(ps, lr=1.0))):
        block = built()
        opt = make(block.parameters())
        block(sequence).square().mean().backward()
        out["grad placements"] = [str(p.grad.placements) for p in block[0].parameters()]
        opt.step()
        out[name] = [p.detach().full_tensor() for p in block.parameters()]
        out[f"{name} norm replica"] = [p.detach().to_local().clone() for p in block[0].parameters()]
    block = built()
    block(sequence).square().mean().backward()
    out["total norm"] = torch.nn.utils.get_total_norm([p.grad for p in block.parameters()]).full_tensor()
    block = built()
    opt = lowbit_optim.AdamW(block.parameters(), lr=1e-3, step_in_backward=True, max_grad_norm=1e9)
    block(sequence).square().mean().backward()
    opt.step()
    out["last_grad_norm"] = opt.last_grad_norm
    try:
        lowbit_optim.Muon([block[2].weight])  # RowwiseParallel's: Shard(1)
    except ValueError as refused:
        out["Muon's refusal"] = str(refused)
    from torch.distributed.fsdp import fully_shard

    hybrid = fully_shard(torch.nn.Linear(8, 16), mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard")))
    try:
        lowbit_optim.Muon([hybrid.weight])  # HSDP's: (Replicate(), Shard(0)) over a 2-D mesh
    except ValueError as refused:
        out["Muon's refusal of HSDP"] = str(refused)
    return out


def _same_tree(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_same_tree(a[k], b[k]) if isinstance(a[k], dict) else _same(a[k], b[k]) for k in a)


def _job(rank: int, world: int, workdir: pathlib.Path) -> None:
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world, timeout=timedelta(seconds=180))
    torch.set_num_threads(1)
    results: dict = {}
    path = workdir / f"results{rank}.pt"
    for fmt in FORMATS:
        start = time.perf_counter()
        try:
            results[fmt] = _scenario(fmt, rank, world, workdir)
        except Exception:
            results[fmt] = {"error": traceback.format_exc()}
            torch.save(results, path)
            raise  # the ranks may now disagree on which collective comes next: stop here
        results[fmt]["seconds"] = time.perf_counter() - start
        torch.save(results, path)
    special = {
        "step_in_backward": _step_in_backward_scenario,
        # Muon with 8bit-lowrank momentum: each rank keeps the low-rank part of its own rows; fused=True,
        # as "Muon" runs the eager reference step
        "muon_lowrank": lambda rank, world: _other_optimizer_scenario("Muon", rank, world, workdir, "8bit-lowrank", fused=True),
        "ademamix_recipe": lambda rank, world: _other_optimizer_scenario("AdEMAMix", rank, world, workdir, ADEMAMIX_RECIPE),
        "ademamix_bf16_sr": lambda rank, world: _other_optimizer_scenario("AdEMAMix", rank, world, workdir, ADEMAMIX_BF16_SR),
        "ademamix_all_8bit": lambda rank, world: _other_optimizer_scenario("AdEMAMix", rank, world, workdir, ADEMAMIX_ALL_8BIT, fused=True),
        "muon_float64": _muon_float64_scenario,
        "optimizer_before_fully_shard": _optimizer_before_fully_shard_scenario,
        "broadcast_from_rank0": _broadcast_from_rank0_scenario,
        "sequence_parallel": _sequence_parallel_scenario,
    }
    for name in [*OTHER_OPTIMIZERS, *special]:
        start = time.perf_counter()
        try:
            results[name] = special[name](rank, world) if name in special else _other_optimizer_scenario(name, rank, world, workdir)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            torch.save(results, path)
            raise
        results[name]["seconds"] = time.perf_counter() - start
        torch.save(results, path)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Running the job once per test session, and the tests
# ------------------------------------------------------------------------------------------------


def _run_job(workdir: pathlib.Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    logs = [open(workdir / f"log{rank}.txt", "w") for rank in range(WORLD)]
    procs = [
        subprocess.Popen([sys.executable, __file__, str(rank), str(WORLD), str(workdir)], env=env, stdout=log, stderr=subprocess.STDOUT)
        for rank, log in enumerate(logs)
    ]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    results = []
    for rank in range(WORLD):
        path = workdir / f"results{rank}.pt"
        found = torch.load(path, weights_only=False) if path.exists() else {}
        found["log"] = (workdir / f"log{rank}.txt").read_text()[-6000:]
        found["returncode"] = procs[rank].returncode
        results.append(found)
    return results


def _run_job_once(shared: pathlib.Path) -> list[dict]:
    """Under pytest-xdist, the first worker that needs the job runs it; the others wait and read it."""
    import fcntl

    with open(shared / "lowbit_fsdp_job.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / "lowbit_fsdp_job.pt"
        if not done.exists():
            with tempfile.TemporaryDirectory(prefix="lowbit_fsdp_") as workdir:
                torch.save(_run_job(pathlib.Path(workdir)), done)
        return torch.load(done, weights_only=False)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    if os.environ.get("PYTEST_XDIST_WORKER") and sys.platform != "win32":
        return _run_job_once(tmp_path_factory.getbasetemp().parent)  # this session's, shared by its workers
    with tempfile.TemporaryDirectory(prefix="lowbit_fsdp_") as workdir:
        return _run_job(pathlib.Path(workdir))


@pytest.fixture(params=FORMATS)
def result(request, job):
    """(rank 0's, rank 1's) results for one format; fails with the job's traceback if it broke."""
    fmt = request.param
    for rank, found in enumerate(job):
        if fmt not in found:
            pytest.fail(f"rank {rank} has no results for {fmt} (exit code {found['returncode']}); its log ends with:\n{found['log']}")
        if "error" in found[fmt]:
            pytest.fail(f"rank {rank} failed on {fmt}:\n{found[fmt]['error']}")
    return fmt, job[0][fmt], job[1][fmt]


def _half_step(fmt: str, state: str) -> float:
    """The largest error of one quantization relative to the block's absmax: half the widest code gap."""
    from conftest import format_info

    return format_info(fmt).max_rounding_error(signed=state == "exp_avg")


def _check_within(errors: dict, fmt: str, names: list[str], half_steps: int) -> None:
    """Each name's relative state errors are at most ``half_steps`` half code steps."""
    for name in names:
        for state in ("exp_avg", "exp_avg_sq"):
            bound = half_steps * _half_step(fmt, state) * 1.001  # 1.001: the errors are computed in fp32
            assert errors[f"{name}.{state}"] <= bound, (name, state, errors[f"{name}.{state}"], bound)


@needs_gloo
def test_quantize_decision_depends_on_global_shape(result):
    fmt, rank0, rank1 = result
    expected_class = {"8bit": "OptimState8bit", "4bit": "OptimState4bit", "fp8": "OptimStateFp8"}[fmt]
    for name, kinds in rank0["ref_state_kinds"].items():
        assert set(kinds.values()) == {expected_class}, (name, kinds)  # everything is quantized here
    for found in (rank0, rank1):
        for name, states in found["state_kinds"].items():
            for key, (cls, local_shape, global_shape) in states.items():
                assert cls == rank0["ref_state_kinds"][name][key], (name, key, cls)
    # 6144 elements: quantized, although each rank holds 3072 (< min_quantize_numel = 4096)
    assert rank0["state_kinds"]["invariant.weight"]["exp_avg"] == [expected_class, [1, 3072], [2, 3072]]
    assert rank1["state_kinds"]["invariant.weight"]["exp_avg"] == [expected_class, [1, 3072], [2, 3072]]
    # uneven shards, shards smaller than a block, an empty shard: states of the local shard's shape
    assert [r["state_kinds"]["aligned.weight"]["exp_avg"][1] for r in (rank0, rank1)] == [[5, 512], [4, 512]]
    assert [r["state_kinds"]["small.weight"]["exp_avg"][1] for r in (rank0, rank1)] == [[2, 100], [1, 100]]
    assert [r["state_kinds"]["small.bias"]["exp_avg"][1] for r in (rank0, rank1)] == [[2], [1]]
    assert [r["state_kinds"]["one_row.weight"]["exp_avg"][1] for r in (rank0, rank1)] == [[1, 4096], [0, 4096]]
    # two 1-byte (or half-byte) moments plus scales and the padding of tiny shards; fp32 Adam: 8
    assert all(1 < r["bytes_per_param"] < 3 for r in (rank0, rank1)), [r["bytes_per_param"] for r in (rank0, rank1)]


@needs_gloo
def test_two_ranks_match_one(result):
    fmt, rank0, rank1 = result
    assert rank0["fsdp_losses"] == rank1["fsdp_losses"]  # all-reduced
    # the first steps agree to rounding; later ones differ by what the different quantization blocks did
    assert rank0["fsdp_losses"][:2] == pytest.approx(rank0["ref_losses"][:2], rel=1e-5)
    assert rank0["fsdp_losses"] == pytest.approx(rank0["ref_losses"], rel=1e-2)
    assert rank0["fsdp_vs_ref_params"] < 0.5 * 1e-2 * STEPS  # half of lr x steps, the most Adam can move
    # where shard boundaries are block boundaries the 2 ranks hold the very blocks of the 1-rank run:
    # states agree to rounding (a rounding difference may flip a code: two half steps)
    _check_within(rank0["fsdp_vs_ref"], fmt, ALIGNED, half_steps=2)
    from conftest import format_info

    if not format_info(fmt).stochastic:  # nearest rounding: few codes flip, and a whole state agrees
        assert max(rank0["fsdp_vs_ref_differing"][f"{n}.{s}"] for n in ALIGNED for s in ("exp_avg", "exp_avg_sq")) < 0.01
        assert min(rank0["fsdp_vs_ref"][f"{n}.exp_avg"] for n in ALIGNED) < 1e-5
    # stochastic rounding draws anew for a value that moved by 2**-13 of itself (quant.dither): the few
    # codes that differ after the first step move the parameters, hence every later gradient, by more
    # than that, and after 3 steps most codes differ from the 1-rank run's (each by a code step), as
    # between two seeds of the dither (a 1e-7 relative perturbation of one step's gradient does the same)
    # elsewhere each step rounds differently on each side (two half steps per step)
    _check_within(rank0["fsdp_vs_ref"], fmt, UNALIGNED, half_steps=2 * STEPS)


@needs_gloo
def test_resume_same_world_size_is_exact(result):
    fmt, rank0, rank1 = result
    for found in (rank0, rank1):
        # get_state_dict / dcp.save / dcp.load / set_state_dict
        assert found["resume_loaded_exact"] and found["resume_final_exact"]
        assert found["resume_losses"] == found["fsdp_more_losses"]
        # optimizer.state_dict() / dcp / optimizer.load_state_dict()
        assert found["direct_loaded_exact"]
        assert found["direct_more_losses"] == found["fsdp_more_losses"]


@needs_gloo
def test_full_state_dict(result):
    fmt, rank0, rank1 = result
    for found in (rank0, rank1):
        assert found["full_sd_plain"]
        assert found["dequantized_plain"]  # dequantize_state_dict (for torch.optim) of sharded states
        _check_within(found["full_sd_error"], fmt, ALIGNED + UNALIGNED, half_steps=1)


@needs_gloo
def test_reshard_two_to_one(result):
    fmt, rank0, _ = result
    assert rank0["2to1_params_exact"]
    assert rank0["2to1_steps"] == [float(STEPS)] * len(rank0["2to1_steps"])
    assert not rank0["2to1_staging_left"]
    errors = rank0["2to1_error"]
    for name in ALIGNED:  # bit-exact: shard boundaries fall on block boundaries
        assert errors[f"{name}.exp_avg"] == 0 and errors[f"{name}.exp_avg_sq"] == 0, errors
    # blocks that mix two saved blocks are requantized once from the exact saved values
    _check_within(errors, fmt, UNALIGNED, half_steps=1)
    # training goes on where it stopped, now on 1 rank (close to the 2-rank continuation)
    assert rank0["2to1_more_losses"] == pytest.approx(rank0["fsdp_more_losses"], rel=1e-2)


@needs_gloo
def test_reshard_one_to_two(result):
    fmt, rank0, rank1 = result
    assert rank0["1to2_params_exact"]
    errors = rank0["1to2_error"]
    for name in ALIGNED:
        assert errors[f"{name}.exp_avg"] == 0 and errors[f"{name}.exp_avg_sq"] == 0, errors
    _check_within(errors, fmt, UNALIGNED, half_steps=1)
    assert rank0["1to2_more_losses"] == rank1["1to2_more_losses"]
    assert rank0["1to2_more_losses"] == pytest.approx(rank0["ref_more_losses"], rel=1e-2)
    # 1 -> 2 -> 1 gives back the very codes and scales where shard boundaries are block boundaries
    for name in ALIGNED:
        assert rank0["round_trip_exact"][name], rank0["round_trip_exact"]


@pytest.fixture(params=list(OTHER_OPTIMIZERS))
def other_result(request, job):
    """(rank 0's, rank 1's) results of one of OTHER_OPTIMIZERS with 8bit state."""
    name = request.param
    for rank, found in enumerate(job):
        if name not in found:
            pytest.fail(f"rank {rank} has no results for {name} (exit code {found['returncode']}); its log ends with:\n{found['log']}")
        if "error" in found[name]:
            pytest.fail(f"rank {rank} failed on {name}:\n{found[name]['error']}")
    return name, job[0][name], job[1][name]


@needs_gloo
def test_other_optimizers_train_sharded_and_resume_exactly(other_result):
    """SGD, Lion, AdEMAMix, Muon and MuonWithAdamW with 8bit state under fully_shard on 2 ranks: every state a DTensor
    over an 8bit local state (the small group's too: min_quantize_numel=0), the losses those of 1
    process (the first step's to rounding), and a DCP checkpoint (get_state_dict / dcp.save / dcp.load
    / set_state_dict) resumes bit-exactly: the same codes and scales, then the same losses, states and
    parameters as the run that went on. Muon (matrices only; the bias keeps no state) gathers each
    matrix's update to one rank, orthogonalizes it there and scatters the rows back: one matrix
    (one_row) has an empty shard on rank 1, others uneven shards. MuonWithAdamW (its own split: AdamW
    on one_row's weight, named its head, and the bias) is saved through DCP's helpers given it, and
    loaded given its two optimizers."""
    name, rank0, rank1 = other_result
    for found in (rank0, rank1):
        for param, kinds in found["state_kinds"].items():
            if name == "Muon" and param == "small.bias":
                assert kinds == {}
                continue
            assert set(map(tuple, kinds.values())) == {("DTensor", "OptimState8bit")}, (param, kinds)
        assert found["loaded_exact"] and found["resume_final_exact"]
        assert found["resume_losses"] == found["more_losses"]
    losses = rank0["losses"] + rank0["more_losses"]
    assert rank0["losses"] == rank1["losses"]  # all-reduced
    # AdamW's 8bit moments of an aligned matrix may sit a code apart (test_two_ranks_match_one): observed
    # 4.6e-5 at lr 2e-2 on the one MuonWithAdamW steps with AdamW
    aligned = [n for n in ALIGNED if not (name == "MuonWithAdamW" and n == "one_row.weight")]
    for n, reference in rank0["ref_final"].items():  # the parameters of 1 process (see ALIGNED_PARAM_ATOL)
        final = rank0["final_full"][n]
        torch.testing.assert_close(final, reference, rtol=0, atol=4 * OTHER_OPTIMIZERS[name]["lr"], msg=n)
        if n in aligned:  # the gradient sums' round-off may put a value at a decision threshold a code apart:
            # an element or two (observed: 1 of 4608, 4.3e-5 at lr 1e-2, AdEMAMix)
            assert int(((final - reference).abs() > ALIGNED_PARAM_ATOL).sum()) <= 2, n
    assert losses[0] == pytest.approx(rank0["ref_losses"][0], rel=1e-6)
    assert losses == pytest.approx(rank0["ref_losses"], rel=1e-2)  # observed within 2e-4


def _sharded_and_resumed(job, name: str, optimizer: str) -> list[dict]:
    """Both ranks' results of the special scenario ``name`` (an _other_optimizer_scenario run of
    ``optimizer``) after the checks such scenarios share: a DCP checkpoint loads and resumes
    bit-exactly, the ranks agree on the losses, and the parameters stay within a few lr of one
    process's (each rank's states are its own rows' and draw by its own blocks)."""
    results = [found.get(name) for found in job]
    for rank, result in enumerate(results):
        if result is None or "error" in result:
            pytest.fail(f"rank {rank}: {result['error'] if result else job[rank]['log']}")
    rank0, rank1 = results
    for found in results:
        assert found["loaded_exact"] and found["resume_final_exact"]
        assert found["resume_losses"] == found["more_losses"]
    assert rank0["losses"] == rank1["losses"]
    for n, reference in rank0["ref_final"].items():
        torch.testing.assert_close(rank0["final_full"][n], reference, rtol=0, atol=4 * OTHER_OPTIMIZERS[optimizer]["lr"], msg=n)
    assert rank0["losses"] + rank0["more_losses"] == pytest.approx(rank0["ref_losses"], rel=1e-2)
    return results


@needs_gloo
def test_muon_with_lowrank_momentum_trains_sharded_and_resumes_exactly(job):
    """Muon with 8bit-lowrank momentum under fully_shard on 2 ranks, fused=True: the fused CPU kernel
    computes each rank's rows' momentum (before the iterations gather them). Each rank's momentum
    rows are a low-rank part of their own plus codes (not one process's factors), so the parameters
    stay within a few lr of one process's, as where a shard boundary cuts an 8bit block; a DCP
    checkpoint loads each rank's state whole (codes, scales and factors) and resumes bit-exactly."""
    for found in _sharded_and_resumed(job, "muon_lowrank", "Muon"):
        assert found["kernel_stepped"] > 0, found["kernel_stepped"]
        kinds = {tuple(kind) for param, states in found["state_kinds"].items() for kind in states.values()}
        assert kinds == {("DTensor", "OptimState8bitLowRank")}, found["state_kinds"]


@needs_gloo
@pytest.mark.parametrize(
    "scenario, slow_kinds",
    [("ademamix_recipe", ("BlockFloatState",) * 2), ("ademamix_bf16_sr", ("StochasticBF16State",) * 2), ("ademamix_all_8bit", ("OptimState8bitLowRank", "LogBlockFloatState"))],
)
def test_ademamix_recipe_trains_sharded_and_resumes_exactly(job, scenario, slow_kinds):
    """AdEMAMix with the README's recipe (8bit-linear fast momentum, 10bit-sr slow momentum and
    second moment), with both slow averages in bf16-sr, and with every state in 8 bits (the slow
    momentum low-rank, each rank's rows with factors of their own, fused=True: the kernel steps it
    through its addend) under fully_shard on 2 ranks: each rank's shard of a stochastic state keeps
    its own count of writes, a DCP checkpoint restores codes, values, factors and counts and resumes
    bit-exactly, and the parameters stay within a few lr of one process's (the stochastic roundings
    of a shard draw by its own block indices)."""
    for found in _sharded_and_resumed(job, scenario, "AdEMAMix"):
        assert (found["kernel_stepped"] > 0) == (scenario == "ademamix_all_8bit")  # the others: the eager reference step
        kinds = {key: tuple(kind) for states in found["state_kinds"].values() for key, kind in states.items()}
        assert kinds == {"exp_avg": ("DTensor", "OptimState8bitLinear"), "exp_avg_slow": ("DTensor", slow_kinds[0]),
                         "exp_avg_sq": ("DTensor", slow_kinds[1])}, found["state_kinds"]  # fmt: skip


@needs_gloo
def test_muon_refuses_a_sharded_parameter_made_float64(job):
    """Muon's sharded step (muon_fsdp) checks what the base class's step checks of each parameter: one
    made float64 through .data after construction is refused, with the constructor's message."""
    for rank, found in enumerate(job):
        result = found.get("muon_float64")
        assert result is not None and "error" not in result, f"rank {rank}: {result}"
        assert result["refused"] and "float64 parameters are not supported" in result["refused"], (rank, result)


@needs_gloo
def test_an_optimizer_built_before_fully_shard_warns_at_its_step(job):
    """fully_shard replaces the module's parameters: an optimizer built before it holds the old
    ones, which get no gradient (torch.optim then steps nothing, silently). Its step warns and
    names the fix, also with step_in_backward=True (its hooks, on the old parameters, never run)."""
    for rank, found in enumerate(job):
        result = found.get("optimizer_before_fully_shard")
        assert result is not None and "error" not in result, f"rank {rank}: {result}"
        for in_backward in (False, True):
            assert result[in_backward]["stepped"] == 0
            assert any("no gradient" in w and "build it after fully_shard" in w for w in result[in_backward]["warnings"]), (rank, in_backward, result)


@needs_gloo
def test_broadcast_from_rank0_warns_where_the_states_are_sent(job):
    """broadcast_from_rank0 sends a state's values; the ranks that receive them requantize them, and may
    hold other states (replicas drifting apart, as a review measured): the sending rank warns and names
    the fix (dequantize_state_dict first, or a load on every rank). The broadcast still completes."""
    for rank, found in enumerate(job):
        result = found.get("broadcast_from_rank0")
        assert result is not None and "error" not in result, f"rank {rank}: {result}"
        warned = any("broadcast as its values" in w and "dequantize_state_dict" in w for w in result["warnings"])
        assert warned == (rank == 0), (rank, result)


@needs_gloo
def test_partial_gradients_of_sequence_parallelism_are_reduced(job):
    for rank, found in enumerate(job):
        result = found.get("sequence_parallel")
        assert result is not None and "error" not in result, f"rank {rank}: {result}"
        assert result["grad placements"] == ["(Partial(sum),)"] * 2  # (what makes this case: else it tests nothing)
        for ours, theirs in zip(result["lowbit"], result["torch"]):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        torch.testing.assert_close(result["last_grad_norm"], result["total norm"], rtol=1e-6, atol=0)
        assert "a parameter of shape (16, 32) has placements (Shard(dim=1),) over a 1-D mesh: step it with AdamW" in result.get("Muon's refusal", "")
        assert "over a 2-D mesh: Muon does not step a matrix sharded over a 2-D mesh (HSDP, " in result.get("Muon's refusal of HSDP", "")
    for ours, theirs in zip(job[0]["sequence_parallel"]["lowbit norm replica"], job[1]["sequence_parallel"]["lowbit norm replica"]):
        assert torch.equal(ours, theirs)  # the Replicate parameters stay replicas


@needs_gloo
def test_step_in_backward_equals_stepping_after_backward(job):
    """FSDP2 calls each sharded parameter's post-accumulate-grad hooks after its reduce-scatter: the
    step in backward sees the reduced local shard and gives the bits of stepping after backward, with
    gradient accumulation, and leaves no gradient behind; max_grad_norm clips by its rule (this rank's
    norm so far, the previous step's global norm) and reports the global norm."""
    for rank, found in enumerate(job):
        result = found.get("step_in_backward")
        if result is None or "error" in result:
            pytest.fail(f"rank {rank}: {result['error'] if result else found['log']}")
        assert result["params_exact"] and result["states_exact"]
        assert result["grads_left"] == [False] * STEPS
        assert result["clipping_bites"] and result["clipped_params_exact"]
        assert result["clipped_norms"] == pytest.approx(result["clipped_reference_norms"], rel=1e-6)


# ------------------------------------------------------------------------------------------------
# In one process: how DCP's copies between saved and wanted chunks treat quantized states
# ------------------------------------------------------------------------------------------------

# (shape, rows of the first of two shards): shard boundaries on or off block boundaries
SPLITS = [((10, 512), 5), ((5, 1024), 3), ((600, 9), 300), ((3, 100), 2), ((7000,), 3500), ((3,), 2), ((1, 300), 1)]


def _blockwise_formats():
    from conftest import BLOCKWISE_FORMATS

    return BLOCKWISE_FORMATS


@pytest.mark.parametrize("info", _blockwise_formats(), ids=str)
@pytest.mark.parametrize("shape, cut", SPLITS, ids=str)
def test_shard_view_reshards(info, shape, cut):
    """2 -> 1 and 1 -> 2 copies, as dcp.load makes them: exact where the shard boundary is a block
    boundary (or the blocks' elements come from one saved block), else within half a code step; a
    whole-state inner tensor (10bit-sr's count of writes) as saved."""
    from conftest import reshard
    from lowbit_optim.distributed import ShardView

    fmt = info.fmt
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    x = x if fmt.holds_signed else x.abs()  # (a format of nonnegative states only)
    one = fmt.from_float(x)  # the 1-rank layout, and the 2-rank one below (each shard padded alone)
    two = [fmt.from_float(one.dequantize()[:cut]), fmt.from_float(one.dequantize()[cut:])]
    assert isinstance(one.__get_tensor_shard__(None), ShardView)  # what DCP reads and writes
    for t in (one, *two):
        for name in fmt.whole_state_names:
            getattr(t, name).fill_(41)

    joined, split = reshard(fmt, one, two, cut)
    for t in (joined, *split):
        assert all(getattr(t, name).eq(41).all() for name in fmt.whole_state_names), {name: getattr(t, name) for name in fmt.whole_state_names}

    row = x.numel() // shape[0]
    on_blocks = cut * row % fmt.default_block_size == 0
    for got, want in ((joined.dequantize(), torch.cat([t.dequantize() for t in two])), (torch.cat([t.dequantize() for t in split]), one.dequantize())):
        if on_blocks:
            assert torch.equal(got, want)
        else:
            assert (got - want).abs().max() <= info.max_rounding_error(signed=True) * want.abs().max() * 1.001
    assert not any(hasattr(t, "_dcp_staging") for t in (joined, *split))  # every block was written
    if x.numel() < fmt.default_block_size:  # a single saved block: its elements keep code and scale
        assert torch.equal(torch.cat([t.dequantize() for t in split]), one.dequantize())


def test_shard_view_plain_tensors():
    """A plain (fp32) checkpoint into a quantized state quantizes it; a quantized one into a plain state
    dequantizes it."""
    from lowbit_optim import OptimState8bit
    from lowbit_optim.distributed import ShardView

    x = torch.randn(600, 9, generator=torch.Generator().manual_seed(0))
    state = OptimState8bit.zeros(x.shape)
    ShardView(state)[:300].copy_(x[:300])
    ShardView(state)[300:].copy_(x[300:])
    assert torch.equal(state.dequantize(), OptimState8bit.from_float(x).dequantize())
    plain = torch.zeros(600, 9)
    plain[100:400].copy_(ShardView(state)[100:400])
    assert torch.equal(plain[100:400], state.dequantize()[100:400])
    with pytest.raises(NotImplementedError, match="dim 0"):
        ShardView(state)[:, :3]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_between_formats(tmp_path):
    """dcp.save / dcp.load without a process group: an 8-bit checkpoint loads bit-exactly into 8-bit
    state, converts into 4-bit and fp32 state, and into the states DCP does not view in rows (bf16-sr,
    factored); torch.optim.AdamW's checkpoint loads into 8-bit state."""
    import torch.distributed.checkpoint as dcp

    import lowbit_optim

    def trained(optimizer_class, **kwargs):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 72)  # a 4608-element weight: quantized; the bias: fp32
        opt = optimizer_class(model.parameters(), lr=1e-2, **kwargs)
        for _ in range(2):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    def load(state_format, path):
        model, opt = trained(lowbit_optim.AdamW, state_format=state_format, compile=False)  # states to load into
        state = opt.state_dict()
        # torch.optim.AdamW's param groups lack lowbit_optim's keys (state_format, ...): partial load
        dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        opt.load_state_dict(state)
        return opt.state[model.weight]

    _, opt8 = trained(lowbit_optim.AdamW, state_format="8bit", compile=False)
    dcp.save(opt8.state_dict(), checkpoint_id=tmp_path / "8bit", no_dist=True)
    saved = next(s for s in opt8.state.values() if isinstance(s["exp_avg"], lowbit_optim.OptimState))
    same = load("8bit", tmp_path / "8bit")
    assert torch.equal(same["exp_avg"].codes, saved["exp_avg"].codes) and torch.equal(same["exp_avg_sq"].scale, saved["exp_avg_sq"].scale)
    assert torch.equal(load("fp32", tmp_path / "8bit")["exp_avg"], saved["exp_avg"].dequantize())
    assert torch.equal(
        load("4bit", tmp_path / "8bit")["exp_avg"].dequantize(), lowbit_optim.OptimState4bit.from_float(saved["exp_avg"].dequantize()).dequantize()
    )

    # rounded stochastically: within one bf16 step
    torch.testing.assert_close(load("bf16-sr", tmp_path / "8bit")["exp_avg"].dequantize(), saved["exp_avg"].dequantize(), rtol=2**-7, atol=0)
    factored = load({"exp_avg": "8bit", "exp_avg_sq": "factored"}, tmp_path / "8bit")["exp_avg_sq"]
    assert torch.equal(factored.dequantize(), lowbit_optim.FactoredState.from_float(saved["exp_avg_sq"].dequantize()).dequantize())

    _, torch_opt = trained(torch.optim.AdamW)
    dcp.save(torch_opt.state_dict(), checkpoint_id=tmp_path / "torch", no_dist=True)
    exp_avg = next(s["exp_avg"] for s in torch_opt.state.values() if s["exp_avg"].numel() > 4096)
    loaded = load("8bit", tmp_path / "torch")["exp_avg"]
    assert torch.equal(loaded.dequantize(), lowbit_optim.OptimState8bit.from_float(exp_avg).dequantize())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_of_first_release_4bit(tmp_path):
    """A DCP checkpoint whose "4bit" states predate format_version (torchao's codebooks then) loads
    as 4bit-torchao: bit-exactly into a 4bit-torchao optimizer, converted into a 4bit one."""
    import torch.distributed.checkpoint as dcp

    import lowbit_optim

    def stepped(state_format, seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(64, 72)  # a 4608-element weight: quantized
        opt = lowbit_optim.AdamW(model.parameters(), lr=1e-2, state_format=state_format)
        for _ in range(2):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = stepped("4bit-torchao", 0)
    saved = opt.state[model.weight]
    first_release = {}
    for key in ("exp_avg", "exp_avg_sq"):
        s = saved[key]
        first_release[key] = lowbit_optim.OptimState4bit(s.codes, s.scale, s.shape, s.block_size, s.signed)
        del first_release[key].__dict__["format_version"]
    state_dict = opt.state_dict()
    state_dict["state"] = {**state_dict["state"], 0: {**state_dict["state"][0], **first_release}}
    dcp.save(state_dict, checkpoint_id=tmp_path, no_dist=True)

    for state_format in ("4bit-torchao", "4bit"):
        other_model, other = stepped(state_format, 1)
        state = other.state_dict()
        dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
        other.load_state_dict(state)
        loaded = other.state[other_model.weight]["exp_avg"]
        if state_format == "4bit-torchao":
            assert torch.equal(loaded.codes, saved["exp_avg"].codes) and torch.equal(loaded.scale, saved["exp_avg"].scale)
        else:
            expected = lowbit_optim.OptimState4bit.from_float(saved["exp_avg"].dequantize()).dequantize()
            assert type(loaded) is lowbit_optim.OptimState4bit and torch.equal(loaded.dequantize(), expected)


def _quantized_format_names():
    from conftest import QUANTIZED_FORMATS

    return [info.name for info in QUANTIZED_FORMATS]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("state_format", _quantized_format_names())
def test_dcp_async_save_writes_the_states(tmp_path, state_format):
    """dcp.async_save stages each state through ``new_empty`` of its shape and sets the staged copies
    of its inner tensors on what that returns: a state of the same kind, so that the checkpoint holds
    the states, bit for bit (a plain, uninitialized tensor had been written in their place)."""
    import torch.distributed.checkpoint as dcp

    import lowbit_optim
    from conftest import format_info

    def stepped(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(64, 72)
        spec = state_format if format_info(state_format).fmt.holds_signed else {"exp_avg": "8bit", "exp_avg_sq": state_format}
        opt = lowbit_optim.AdamW(model.parameters(), lr=1e-2, state_format=spec, min_quantize_numel=0, compile=False)
        for _ in range(2):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
        return opt

    saved = stepped(0)
    dcp.async_save(saved.state_dict(), checkpoint_id=tmp_path, no_dist=True).result()
    loaded = stepped(1)
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    loaded.load_state_dict(state)
    for a, b in zip(saved.state.values(), loaded.state.values()):
        for name in a:
            assert type(a[name]) is type(b[name]) and torch.equal(a[name].dequantize(), b[name].dequantize()), name


if __name__ == "__main__":  # one rank of the job: test_fsdp.py RANK WORLD WORKDIR
    _job(int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3]))
