"""A new optimizer in ~30 lines: RMSprop with its running average of squared gradients in any state format.

An optimizer is a subclass of ``lowbit_optim.LowBitOptimizer`` that declares

- ``step_function``: one parameter's step, written as if every state were an fp32 tensor (reading a
  state dequantizes it, ``copy_`` quantizes). Numbers arrive as 0-d tensors (changing them never
  recompiles); ``precision.read_param`` / ``write_param`` apply the ``param_update`` mode of bf16 weights;
- ``states``: what it keeps per parameter (``signed=False``: never negative, as a second moment);
- ``_step_arguments(group)``: the step function's numbers and flags, from a param group.

Everything else (state formats per group, checkpoints, bf16 weights, FSDP2, compiled steps) is
inherited. ``test/conftest.py`` imports this file: the suite runs it through every state format and,
since ``torch_name`` names it, checks its fp32 state against torch.optim.RMSprop.
"""

import torch

import lowbit_optim
from lowbit_optim import precision


def rmsprop_step(param, grad, step, square_avg, param_extra, lr, alpha, one_minus_alpha, eps, weight_decay, *, param_update):
    step.add_(1)
    p = precision.read_param(param, param_extra, param_update)
    g = grad.float() + weight_decay * p
    v = square_avg.float() * alpha + one_minus_alpha * g * g
    square_avg.copy_(v)
    precision.write_param(param, param_extra, p, p - lr * g / (v.sqrt() + eps), param_update)


class RMSprop(lowbit_optim.LowBitOptimizer):
    """torch.optim.RMSprop (without momentum or centering), its square average in any state format."""

    step_function = staticmethod(rmsprop_step)
    states = (lowbit_optim.State("square_avg", signed=False, decay=lambda group: group["alpha"]),)  # its beta (checked for signed states)
    torch_name = "RMSprop"
    elementwise_step = True  # each element's update reads that element alone: large parameters step in slices

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, **options):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay), **options)

    def _step_arguments(self, group):
        return (group["lr"], group["alpha"], 1 - group["alpha"], group["eps"], group["weight_decay"]), {}


if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    x, y = torch.randn(512, 64), torch.randn(512, 1)
    opt = RMSprop(model.parameters(), lr=1e-3, state_format="8bit")
    for step in range(101):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  state bytes/param {lowbit_optim.bytes_per_param(opt):.3f}")
