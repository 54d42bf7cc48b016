"""Plain step functions, written as if every state were an fp32 tensor.

torch.compile traces them through the state subclasses' dispatch (reading dequantizes, ``copy_``
quantizes), so the same function serves fp32, bf16 and every quantized format. Hyper-parameters
arrive as 0-d tensors so that changing them never recompiles.
"""

from torch import Tensor

from . import precision


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
    v = exp_avg_sq.float().lerp(g.square(), one_minus_beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if max_exp_avg_sq is not None:
        v = max_exp_avg_sq.float().maximum(v)
        max_exp_avg_sq.copy_(v)

    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = v.sqrt() / bias_correction2.sqrt() + eps
    p = p - lr * (m / bias_correction1) / denom

    precision.write_param(param, param_extra, start, p, param_update)
