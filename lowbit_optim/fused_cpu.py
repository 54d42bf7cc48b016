"""The fused CPU kernel as the optimizers use it: which parameters it can step, and the call.

The compiled step (a functional.py step under torch.compile) defines the numerics and serves every
device and format. On the CPU, inductor turns it into several passes (moments, block absmax,
encoding) with scalar table gathers; the C kernel (csrc/) computes the same numbers in one pass per
chunk of blocks, for plain fp32/bf16 states and every format that declares a kernel layout
(``StateTensor.kernel_layout``: codebook formats, also with stochastic rounding, FP8 e4m3, factored,
bf16 with stochastic rounding, block floats, and low-rank states, whose low-rank part ``step`` computes
beside the kernel).
Factored states it steps with one difference: it sums rows and columns in double, in its own order,
so their sums can differ from the compiled step's in the last bit. bf16 parameters it rounds to
nearest or keeps with an int8-correction (24-bit weights); anything else (a format with its own
encoding, stochastic or Kahan parameter updates) takes the compiled step.

How it is put together (README, Design): kernel_build.py compiles csrc/ once per machine;
kernel_abi.py reads the C's structures from the library; kernel_op.py is the torch op
``lowbit_optim::fused_step_cpu`` that checks plain tensors and marshals them into those structures.
This module says what the kernel takes and turns an optimizer's states into the op's arguments.
The core package still needs nothing but torch (the library is called through ctypes).

An optimizer with an update in the kernel (csrc/update.h) calls ``step(name, items, hyper)`` with
its hyper-parameters by the C struct's field names; ``adam_step``, ``sgd_step``, ``lion_step`` and
``ademamix_step`` are Adam's, SGD's, Lion's and AdEMAMix's; each takes the parameters'
int8-corrections beside its items (``corrections``, None where a parameter has none).
``muon_momentum`` is Muon's part before its Newton-Schulz iterations, which it leaves to the caller.
"""

import torch
from torch import Tensor

from . import kernel_abi, kernel_op
from .kernel_op import check_inputs, chunk_unit, kernel_kind  # noqa: F401 - part of this module's interface
from .state import StateTensor, not_plain

_PLAIN_DTYPES = (torch.float32, torch.bfloat16)
_NO_CORRECTION = torch.empty(0, dtype=torch.int8)
_NO_COUNTER = torch.empty(0, dtype=torch.float32)


def library():
    """The compiled kernel's ctypes library; None where it cannot be built (``unsupported_reason``
    says why)."""
    kernel = kernel_abi.load()[0]
    return kernel.lib if kernel is not None else None


def unsupported_reason(param: Tensor, grad: Tensor, step: Tensor, states: dict, param_update: str) -> str | None:
    """Why the fused kernel cannot step this parameter with this gradient (None if it can)."""
    return grad_unsupported_reason(grad) or param_unsupported_reason(param, step, states, param_update)


def grad_unsupported_reason(grad: Tensor) -> str | None:
    """What in a gradient the kernel cannot read (None if nothing): the part that may change every step."""
    if grad.dtype not in _PLAIN_DTYPES:
        return f"gradient dtype {grad.dtype} (it takes float32 and bfloat16)"
    if grad.layout != torch.strided:
        return f"a {grad.layout} gradient"
    return None


def param_unsupported_reason(param: Tensor, step: Tensor, states: dict, param_update: str) -> str | None:
    """Why the kernel cannot step this parameter with these states, whatever its gradient (None if it
    can): fixed while the parameter keeps its states, so an optimizer decides it once (base.py)."""
    kernel, why = kernel_abi.load()
    if kernel is None:
        return why
    if param.device.type != "cpu":
        return f"the parameter is on {param.device.type}, not the CPU"
    if param.dtype not in _PLAIN_DTYPES:
        return f"parameter dtype {param.dtype} (it takes float32 and bfloat16)"
    if step is not None and (step.dtype != torch.float32 or step.device.type != "cpu"):
        return f"a step counter of dtype {step.dtype} on {step.device.type} (it takes a float32 CPU tensor)"
    if param_update not in ("nearest", "int8-correction"):
        return f"param_update={param_update!r} (it rounds bf16 parameters to nearest, or keeps an int8-correction)"
    for name, state in states.items():
        problem = kernel_op.state_unsupported(name, state)
        if problem:
            return problem
    return kernel_op.chunks_unsupported(list(states.values()))


def block_size_unsupported_reason(block_size: int) -> str | None:
    """Why the kernel cannot step blockwise states of ``block_size`` (None if it can, or if there is
    no kernel: param_unsupported_reason says that)."""
    kernel, _ = kernel_abi.load()
    return None if kernel is None else kernel_op.block_size_unsupported(block_size)


def step(optimizer: str, items: list[tuple], hyper: dict, corrections: list[Tensor | None] | None = None) -> None:
    """Step every (param, grad, step, *states) of ``items`` with the kernel's ``optimizer`` update:
    ``states`` in the order the C names them (None where absent), ``hyper`` by the C struct's field
    names, ``corrections`` the parameters' int8-corrections (None: none). The tensors must be local
    and contiguous (a caller steps a contiguous copy of any other, as base.py does). Parameters whose states all lie in their codes go in one
    call; one with a state that keeps a part outside them (StateTensor.has_addend) in a call of its
    own, between that state's kernel_addend and kernel_residual, whose values then go through the
    kernel's encoders (``assign``): one parameter's fp32 values at a time. So an error raised partway
    (the checks come first: only a failure of the products or an interrupt) leaves the parameters
    before it stepped."""
    if not items:
        return
    corrections = corrections or [None] * len(items)
    whole, apart = [], []
    for item, correction in zip(items, corrections):
        added = [s for s in item[3:] if isinstance(s, StateTensor) and s.has_addend]
        (apart if added else whole).append((item, correction, added))
    if whole:
        _call(optimizer, [item for item, _, _ in whole], hyper, [c for _, c, _ in whole])
    if not apart:
        return
    # an addend per such state, sized for the largest parameter and reused by the others: fresh
    # memory costs a page fault per 4 KiB (the products took twice as long)
    buffers = torch.empty(max(len(added) for *_, added in apart), max(item[0].numel() for item, *_ in apart), dtype=torch.float32)
    names = _state_names(optimizer)
    for item, correction, added in apart:
        for name, state in zip(names, item[3:]):  # the factors of those are read here, before the op checks them with the rest
            if state is None or not any(state is s for s in added):
                continue
            try:
                state.check_layout()
            except ValueError as error:
                raise kernel_op.refused(item[0], f"its {name} state: {error}") from None
        addends = [s.kernel_addend(buffers[i, : s.numel()]) for i, s in enumerate(added)]
        _call(optimizer, [item], hyper, [correction], addends)
        residuals = [s.kernel_residual(values) for s, values in zip(added, addends)]
        _call("assign", [(values, values, torch.zeros(1, dtype=torch.float32), codes) for codes, values in residuals], {})  # a counter it needs, unused


def _state_names(optimizer: str) -> tuple[str, ...]:
    """The names of the kernel's ``optimizer``'s states, in the order its items hold them."""
    return kernel_op.kernel().optimizers[optimizer].states


def _call(optimizer: str, items: list[tuple], hyper: dict, corrections: list[Tensor | None] = (), addends: list[Tensor] = ()) -> None:
    """The op on ``items`` (step's), ``addends`` those of their states that have one, in order."""
    params, grads, steps, tensors, keys = [], [], [], [], []
    for param, grad, counter, *states in items:
        params.append(param)
        grads.append(grad)
        steps.append(counter if counter is not None else _NO_COUNTER)  # a parameter without states
        for state in states:
            keys.append(kernel_op.format_key(state))
            if isinstance(state, StateTensor):
                tensors.extend(getattr(state, name) for name in state.inner_names)
            elif state is not None:
                tensors.append(state)
    given = [c if c is not None else _NO_CORRECTION for c in corrections] if any(c is not None for c in corrections) else []
    try:
        torch.ops.lowbit_optim.fused_step_cpu(optimizer, kernel_op.hyper_values(optimizer, hyper), params, grads, steps, tensors, keys, given, list(addends))
    except RuntimeError:  # the dispatcher's own refusal of a lazily negated tensor it would write, before the op's checks
        names = _state_names(optimizer)
        for (param, grad, counter, *states), correction in zip(items, [*corrections, *[None] * len(items)]):
            written = [*kernel_op.tensors_of(param, grad, counter, dict(zip(names, states))), ("int8-correction", correction)]
            for what, t in written:
                if what != "gradient" and t is not None and not_plain(t):  # (a negated gradient is read: the dispatcher resolves it)
                    raise kernel_op.refused(param, f"its {what} is {not_plain(t)}") from None
        raise


def adam_step(items: list[tuple], group: dict, corrections=None) -> None:
    """Step every (param, grad, step, exp_avg, exp_avg_sq, max_exp_avg_sq or None) of ``group``
    with Adam / AdamW (functional.adam_step's numbers; max_exp_avg_sq is used where amsgrad)."""
    amsgrad = group["amsgrad"]
    for param, _grad, _step, _m, _v, max_exp_avg_sq in items:
        if amsgrad and max_exp_avg_sq is None:
            raise kernel_op.refused(param, "its max_exp_avg_sq state is missing (amsgrad=True needs it)")
    hyper = dict(_adam_moment_hyper(group, *group["betas"]), decoupled_weight_decay=group["decoupled_weight_decay"])
    step("adam", [(*item[:5], item[5] if amsgrad else None) for item in items], hyper, corrections)


def sgd_step(items: list[tuple], group: dict, corrections=None) -> None:
    """Step every (param, grad, step or None, momentum_buffer or None) of ``group`` with SGD
    (functional.sgd_step's numbers; without momentum there is neither buffer nor counter)."""
    hyper = dict(
        lr=float(group["lr"]),
        momentum=group["momentum"],
        weight_decay=group["weight_decay"],
        one_minus_dampening=1 - group["dampening"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
    )
    step("sgd", items, hyper, corrections)


def lion_step(items: list[tuple], group: dict, corrections=None) -> None:
    """Step every (param, grad, step, exp_avg) of ``group`` with Lion (functional.lion_step's numbers)."""
    beta1, beta2 = group["betas"]
    hyper = dict(lr=float(group["lr"]), weight_decay=group["weight_decay"], one_minus_beta1=1 - beta1, one_minus_beta2=1 - beta2, maximize=group["maximize"])
    step("lion", items, hyper, corrections)


def ademamix_step(items: list[tuple], group: dict, corrections=None) -> None:
    """Step every (param, grad, step, exp_avg, exp_avg_slow, exp_avg_sq) of ``group`` with AdEMAMix
    (functional.ademamix_step's numbers: the warm-ups of alpha and beta3 in float64, in the kernel's
    prepare)."""
    beta1, beta2, beta3 = group["betas"]
    t_alpha, t_beta3 = group["t_alpha"], group["t_beta3"]
    hyper = dict(
        _adam_moment_hyper(group, beta1, beta2),
        alpha=float(group["alpha"]),
        t_alpha=float(t_alpha or 1),
        beta3=float(beta3),
        t_beta3=float(t_beta3 or 1),
        schedule_alpha=t_alpha is not None,
        schedule_beta3=t_beta3 is not None,
    )
    step("ademamix", items, hyper, corrections)


def muon_momentum(items: list[tuple], group: dict) -> None:
    """Muon's momentum (functional.muon_momentum's numbers) for every (output, grad, step,
    momentum_buffer) of ``group``: the kernel updates the buffer and writes into ``output`` (bf16
    where the iterations are to start from it) what the Newton-Schulz iterations orthogonalize."""
    momentum = group["momentum"]
    step("muon", items, dict(momentum=momentum, one_minus_momentum=1 - momentum, nesterov=group["nesterov"]))


def _adam_moment_hyper(group: dict, beta1: float, beta2: float) -> dict:
    """The hyper-parameters Adam and AdEMAMix share (their two Adam moments), by the C fields' names."""
    return dict(
        lr=float(group["lr"]),
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        one_minus_beta1=1 - beta1,
        one_minus_beta2=1 - beta2,
        maximize=group["maximize"],
    )
