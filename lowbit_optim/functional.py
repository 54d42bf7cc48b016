"""Plain step functions (Adam, SGD, Lion, AdEMAMix, Muon), written as if every state were an fp32 tensor.

torch.compile traces them through the state subclasses' dispatch (reading dequantizes, ``copy_``
quantizes), so the same function serves fp32, bf16 and every quantized format. Hyper-parameters
arrive as 0-d tensors so that changing them never recompiles.

They are public (``lowbit_optim.adam_step`` etc.), so each first checks what the optimizers check
when they are built (_check_call): a wrong call is refused before any tensor is written. Compiled
yourself, a Muon step matches torch.optim.Muon with ``options=muon_step.inductor_options``.
"""

import math

import torch
from torch import Tensor

from . import precision
from .state import StateTensor


def _check_call(param: Tensor, param_extra: Tensor | None, param_update: str, step, signed: dict, numbers: dict, *, counts: bool = True) -> None:
    """Raise where a step function is called as no optimizer calls it: ``step`` not a counter
    tensor (where it ``counts``), a number (``numbers``, by name) not a tensor, a state that can
    be negative (``signed``, by name) held unsigned (it would be clamped at 0, or be a factored
    state's garbage), or ``param_update``'s buffer missing."""
    if counts and not isinstance(step, Tensor):
        raise TypeError(f"step must be the step counter, a 0-d float32 tensor counted in place (e.g. torch.zeros(())), not {type(step).__name__}")
    for name, value in numbers.items():
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{name} must be a 0-d tensor, e.g. torch.tensor({value!r}), not {type(value).__name__}: the step functions "
                "take their numbers as tensors, so that a compiled step never recompiles when one changes"
            )
    for name, state in signed.items():
        if isinstance(state, StateTensor) and not state.signed:
            raise ValueError(
                f"{name} can be negative, but it is an unsigned {type(state).__name__}: make it with signed=True, "
                "in a format that holds signed values (not 'factored')"
            )
    precision.checked_mode(param, param_extra, param_update)


def _unless_v_is_zero(update: Tensor, v: Tensor) -> Tensor:
    """Adam's and AdEMAMix's ``update``, but none where the second moment ``v`` is 0: a first moment
    there comes of rounding alone (8bit and fp8 round a v far below its block's largest to 0; fp32, a
    gradient whose square underflows), and m / eps would throw the weight (by 5.5 at lr 1e-2 where
    torch.optim's moved it 0.0067). The kernel's is csrc/update.h's."""
    return torch.where(v == 0, 0.0, update)


def _second_moment(exp_avg_sq: Tensor, g: Tensor, one_minus_beta2: Tensor) -> Tensor:
    """Adam's and AdEMAMix's second moment, ``exp_avg_sq.lerp(g², 1 - beta2)``. Where ``g²`` overflows
    fp32 (a finite gradient element above ~1.8e19) the moment is ``(v - w v) + (w g) g`` instead:
    multiplying by ``w = 1 - beta2`` before the second factor, as torch.optim does, keeps a spike up to
    ~5.8e20 finite where an inf moment would NaN the next step. The kernel's is csrc/update.h's."""
    v, square = exp_avg_sq.float(), g.square()
    spike = (v - one_minus_beta2 * v) + (one_minus_beta2 * g) * g
    return torch.where(square.isinf() & g.isfinite(), spike, v.lerp(square, one_minus_beta2))


def adam_step(
    param: Tensor,
    grad: Tensor,
    step: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    param_extra: Tensor | None,
    lr: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    weight_decay: Tensor,
    eps: Tensor,
    one_minus_beta1: Tensor,
    one_minus_beta2: Tensor,
    *,
    decoupled_weight_decay: bool,
    maximize: bool,
    param_update: str,
) -> None:
    """One Adam (or AdamW, with ``decoupled_weight_decay``) update of one parameter, in fp32.

    ``1 - beta`` arrives precomputed in float64 (rounded once to fp32), like torch.optim and torchao
    do with Python floats; the order of operations follows torchao so 8-bit runs match it closely.
    ``param_update`` says how the fp32 result lands in a bf16 parameter (see precision.py);
    ``param_extra`` is that mode's buffer (Kahan compensation or int8 correction), if any.
    """
    numbers = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, one_minus_beta1=one_minus_beta1, one_minus_beta2=one_minus_beta2)
    _check_call(param, param_extra, param_update, step, dict(exp_avg=exp_avg), numbers)
    step.add_(1)
    start = precision.read_param(param, param_extra, param_update)
    p = start
    g = grad.float()
    if maximize:
        g = -g
    if decoupled_weight_decay:
        p = p - lr * weight_decay * p
    else:
        g = g + weight_decay * p

    # keep the fp32 moments for this step's update; only the stored copies are quantized
    m = exp_avg.float().lerp(g, one_minus_beta1)
    v = _second_moment(exp_avg_sq, g, one_minus_beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if max_exp_avg_sq is not None:
        v = max_exp_avg_sq.float().maximum(v)
        max_exp_avg_sq.copy_(v)

    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = v.sqrt() / bias_correction2.sqrt() + eps
    p = p - _unless_v_is_zero(lr * (m / bias_correction1) / denom, v)

    precision.write_param(param, param_extra, start, p, param_update)


def sgd_step(
    param: Tensor,
    grad: Tensor,
    step: Tensor | None,
    momentum_buffer: Tensor | None,
    param_extra: Tensor | None,
    lr: Tensor,
    momentum: Tensor,
    weight_decay: Tensor,
    one_minus_dampening: Tensor,
    *,
    nesterov: bool,
    maximize: bool,
    param_update: str,
) -> None:
    """One step of torch.optim.SGD (L2 weight decay, momentum with dampening, Nesterov).

    Without momentum there is no buffer (and no step counter). With it, the first step stores the
    gradient itself in the buffer, as torch.optim does, and later ones ``momentum * buf + (1 -
    dampening) * g``.
    """
    numbers = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, one_minus_dampening=one_minus_dampening)
    _check_call(param, param_extra, param_update, step, dict(momentum_buffer=momentum_buffer), numbers, counts=momentum_buffer is not None)
    start = precision.read_param(param, param_extra, param_update)
    g = grad.float()
    if maximize:
        g = -g
    g = g + weight_decay * start
    if momentum_buffer is not None:
        step.add_(1)
        buf = torch.where(step == 1, g, momentum_buffer.float() * momentum + one_minus_dampening * g)
        momentum_buffer.copy_(buf)
        g = g + momentum * buf if nesterov else buf
    precision.write_param(param, param_extra, start, start - lr * g, param_update)


def lion_step(
    param: Tensor,
    grad: Tensor,
    step: Tensor,
    exp_avg: Tensor,
    param_extra: Tensor | None,
    lr: Tensor,
    weight_decay: Tensor,
    one_minus_beta1: Tensor,
    one_minus_beta2: Tensor,
    *,
    maximize: bool,
    param_update: str,
) -> None:
    """One Lion step (Chen et al. 2023): the sign of an interpolation between the momentum and the
    gradient (beta1), then the momentum moves towards the gradient (beta2); decoupled weight decay."""
    numbers = dict(lr=lr, weight_decay=weight_decay, one_minus_beta1=one_minus_beta1, one_minus_beta2=one_minus_beta2)
    _check_call(param, param_extra, param_update, step, dict(exp_avg=exp_avg), numbers)
    step.add_(1)
    start = precision.read_param(param, param_extra, param_update)
    g = grad.float()
    if maximize:
        g = -g
    p = start - lr * weight_decay * start
    m = exp_avg.float()
    direction = m.lerp(g, one_minus_beta1)
    # NaN where the direction is not finite, as Adam's update is: sign() gives 0 for NaN, and a NaN
    # gradient would silently freeze its parameter element (its momentum NaN for good)
    p = p - lr * torch.where(direction.isfinite(), direction.sign(), torch.nan)
    exp_avg.copy_(m.lerp(g, one_minus_beta2))
    precision.write_param(param, param_extra, start, p, param_update)


def ademamix_step(
    param: Tensor,
    grad: Tensor,
    step: Tensor,
    exp_avg: Tensor,
    exp_avg_slow: Tensor,
    exp_avg_sq: Tensor,
    param_extra: Tensor | None,
    lr: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    weight_decay: Tensor,
    eps: Tensor,
    one_minus_beta1: Tensor,
    one_minus_beta2: Tensor,
    alpha: Tensor,
    t_alpha: Tensor,
    beta3: Tensor,
    t_beta3: Tensor,
    *,
    maximize: bool,
    schedule_alpha: bool,
    schedule_beta3: bool,
    param_update: str,
) -> None:
    """One AdEMAMix step (Pagliardini et al. 2024) as bitsandbytes computes it: Adam's fast first
    moment and second moment, plus a slow first moment (beta3) weighted by ``alpha``; decoupled
    weight decay.

    ``alpha``, ``beta3`` and their warm-up lengths arrive in float64: with ``schedule_alpha`` alpha
    rises linearly to its value over ``t_alpha`` steps; with ``schedule_beta3`` beta3 rises from
    beta1 over ``t_beta3`` steps along bitsandbytes' schedule (linear in 1 / log(beta)). Both are
    computed in float64 and rounded once, so that ``1 - beta3`` (about 1e-4) keeps its precision.
    The warm-up of beta3 takes logarithms: it needs beta1 > 0 (AdEMAMix checks it; this does not).
    """
    numbers = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, one_minus_beta1=one_minus_beta1,
                   one_minus_beta2=one_minus_beta2, alpha=alpha, t_alpha=t_alpha, beta3=beta3, t_beta3=t_beta3)  # fmt: skip
    _check_call(param, param_extra, param_update, step, dict(exp_avg=exp_avg, exp_avg_slow=exp_avg_slow), numbers)
    step.add_(1)
    start = precision.read_param(param, param_extra, param_update)
    g = grad.float()
    if maximize:
        g = -g
    p = start - lr * weight_decay * start

    n = step.double()
    if schedule_alpha:
        alpha = torch.minimum(n * alpha / t_alpha, alpha)
    if schedule_beta3:
        log_beta1, log_beta3 = beta1.double().log(), beta3.log()
        fraction = n / t_beta3
        beta3 = torch.minimum(torch.exp(log_beta1 * log_beta3 / ((1 - fraction) * log_beta3 + fraction * log_beta1)), beta3)
    alpha, one_minus_beta3 = alpha.float(), (1 - beta3).float()

    m = exp_avg.float().lerp(g, one_minus_beta1)
    m_slow = exp_avg_slow.float().lerp(g, one_minus_beta3)
    v = _second_moment(exp_avg_sq, g, one_minus_beta2)
    exp_avg.copy_(m)
    exp_avg_slow.copy_(m_slow)
    exp_avg_sq.copy_(v)

    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = v.sqrt() / bias_correction2.sqrt() + eps
    p = p - _unless_v_is_zero(lr * (m / bias_correction1 + alpha * m_slow) / denom, v)
    precision.write_param(param, param_extra, start, p, param_update)


def muon_step(
    param: Tensor,
    grad: Tensor,
    step: Tensor,
    momentum_buffer: Tensor,
    param_extra: Tensor | None,
    lr: Tensor,
    decay: Tensor,
    momentum: Tensor,
    one_minus_momentum: Tensor,
    eps: Tensor,
    *,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    adjust_lr_fn: str | None,
    param_update: str,
) -> None:
    """One Muon step of one matrix, torch.optim.Muon's formula: the momentum (Nesterov's look-ahead
    with ``nesterov``) orthogonalized by Newton-Schulz iterations in bf16, decoupled weight decay
    (``decay`` = 1 - lr * weight_decay, rounded once from float64), and an lr scaled by the
    matrix's shape (``adjust_lr_fn``). Unlike the other step functions it sees the parameter's
    shape (``Muon.flat_step = False``): the iterations need the whole matrix. Its three parts run
    apart on FSDP2-sharded matrices (muon_fsdp.py): the elementwise ones on each rank's rows.
    Compiled yourself, it takes ``options=muon_step.inductor_options`` to round as eager does.
    """
    numbers = dict(lr=lr, decay=decay, momentum=momentum, one_minus_momentum=one_minus_momentum, eps=eps)
    _check_call(param, param_extra, param_update, step, dict(momentum_buffer=momentum_buffer), numbers)
    if param.dim() != 2:
        raise ValueError(f"muon_step steps matrices, got a parameter of shape {tuple(param.shape)}: step it with adam_step, as Muon's users give it to AdamW")
    check_adjust_lr_fn(adjust_lr_fn)
    update = muon_momentum(grad, step, momentum_buffer, momentum, one_minus_momentum, nesterov=nesterov)
    muon_finish(param, param_extra, update, lr, decay, eps, ns_coefficients=ns_coefficients, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, param_update=param_update)


def muon_finish(
    param: Tensor, param_extra: Tensor | None, update: Tensor, lr: Tensor, decay: Tensor, eps: Tensor, *,
    ns_coefficients: tuple[float, float, float], ns_steps: int, adjust_lr_fn: str | None, param_update: str,
) -> None:  # fmt: skip
    """Muon's step after the momentum, for a whole matrix: the iterations, then the apply. The fused
    CPU kernel computes the momentum and leaves this to one graph per matrix (two graphs, one call
    each, had cost a 64 x 64 matrix's step more than the compiled step's one)."""
    orthogonal = newton_schulz(update, ns_coefficients, ns_steps, eps)
    muon_apply(param, param_extra, orthogonal, lr, decay, shape=param.shape, adjust_lr_fn=adjust_lr_fn, param_update=param_update)


def muon_momentum(grad: Tensor, step: Tensor, momentum_buffer: Tensor, momentum: Tensor, one_minus_momentum: Tensor, *, nesterov: bool) -> Tensor:
    """Muon's part before the iterations, elementwise: count the step, update the momentum buffer,
    and return what is orthogonalized (the momentum, or Nesterov's look-ahead)."""
    step.add_(1)
    g = grad.float()
    m = momentum_buffer.float().lerp(g, one_minus_momentum)
    momentum_buffer.copy_(m)
    return g.lerp(m, momentum) if nesterov else m


def muon_apply(
    param: Tensor, param_extra: Tensor | None, orthogonal: Tensor, lr: Tensor, decay: Tensor, *, shape, adjust_lr_fn: str | None, param_update: str
) -> None:
    """Muon's part after the iterations, elementwise: decoupled weight decay and the orthogonalized
    update at the lr for a matrix of ``shape`` (the whole matrix's, also for a shard's rows)."""
    start = precision.read_param(param, param_extra, param_update)
    adjusted_lr = (lr * muon_lr_ratio(shape, adjust_lr_fn)).float()
    p = start * decay - adjusted_lr * orthogonal.float()
    precision.write_param(param, param_extra, start, p, param_update)


# the bf16 iterations round as eager (torch.optim.Muon) does, not with inductor's fp32 intermediates
muon_step.inductor_options = {"emulate_precision_casts": True}


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: Tensor) -> Tensor:
    """The quintic Newton-Schulz iteration of Muon (Jordan et al. 2024; torch.optim.Muon's
    coefficients and order of operations), in bf16: ``update`` with its singular values pushed
    towards 1 (those of a well-conditioned matrix into about [0.5, 1.2]; the smallest of an
    ill-conditioned or low-rank one stay far below). ``eps`` (a 0-d tensor: changing it never
    recompiles) bounds the norm it divides by, in bf16 as torch.optim.Muon's."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps.to(x.dtype))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


# the parts compiled alone (muon_parts.py) compile with muon_step's options
newton_schulz.inductor_options = muon_momentum.inductor_options = muon_apply.inductor_options = muon_finish.inductor_options = muon_step.inductor_options


def check_adjust_lr_fn(adjust_lr_fn) -> None:
    """Raise a ValueError unless ``adjust_lr_fn`` is one muon_lr_ratio knows (Muon's constructor, and
    muon_step before it writes anything: an unknown one had been taken as "original")."""
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"invalid adjust_lr_fn {adjust_lr_fn!r}: use None, 'original' or 'match_rms_adamw'")


def muon_lr_ratio(shape, adjust_lr_fn: str | None) -> float:
    """torch.optim.Muon's lr scale for a (rows, cols) matrix: sqrt(max(1, rows / cols)) ("original",
    the default), 0.2 * sqrt(max(rows, cols)) ("match_rms_adamw", an update of AdamW's RMS)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))
