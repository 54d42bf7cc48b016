"""A new optimizer-state format in ~30 lines: 8-bit codes on a linear grid.

A format is a subclass of ``lowbit_optim.CodebookState`` that defines

- ``name``: the key for ``state_format=...``; defining the class registers it;
- ``bits`` (8, or 4 for two codes per byte) and ``default_block_size`` (one fp32 scale per block);
- ``codebook(signed)``: at most 2**bits strictly increasing floats in [-1, 1] ([0, 1] unsigned).
  Each block is divided by its absmax, then every value is stored as the index of its nearest code.

The first moment uses the signed codebook, the second moment (never negative) the unsigned one.
(The built-in ``8bit-linear`` keeps signed states on this grid too, and nonnegative ones as ``8bit``.)
``test/conftest.py`` imports this file, so the whole test suite runs over this format as well.

Run ``python examples/custom_format.py`` to train a small model with it and with the built-in "8bit".
"""

import torch

import lowbit_optim


class OptimStateInt8Linear(lowbit_optim.CodebookState):
    """Uniformly spaced 8-bit codes: simpler than the dynamic-tree codebook of "8bit", but coarser
    for values far below their block's absmax."""

    name = "int8-linear"
    bits = 8
    default_block_size = 256

    @classmethod
    def codebook(cls, signed: bool) -> list[float]:
        if signed:
            return [k / 127 for k in range(-127, 128)]  # 255 codes, symmetric, with an exact zero
        # no zero: a small second moment must not round to 0, or the Adam update lr * m / sqrt(v) explodes
        return [(k + 1) / 256 for k in range(256)]


def _train(state_format: str, steps: int, seed: int = 0) -> tuple[float, float]:
    """Fit a small MLP to a random teacher network; return (final loss, optimizer bytes per param)."""
    torch.manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    x = torch.randn(1024, 32)
    with torch.no_grad():
        y = teacher(x)
    # the 256x256 weight (65536 elements) is large enough to be quantized; biases stay fp32
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)
    )
    opt = lowbit_optim.AdamW(model.parameters(), lr=3e-3, state_format=state_format)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x), y).item()
    return final, lowbit_optim.bytes_per_param(opt)


def main(steps: int = 60) -> dict:
    # fp32 is the reference: the quantized formats should match its loss at about a quarter of the memory
    results = {fmt: _train(fmt, steps) for fmt in ("int8-linear", "8bit", "fp32")}
    reference = results["fp32"][0]
    print(f"{'state format':<14}{'final loss':>14}{'vs fp32':>10}{'bytes/param':>13}   ({steps} steps)")
    for fmt, (loss, bpp) in results.items():
        print(f"{fmt:<14}{loss:>14.6e}{(loss / reference - 1) * 100:>+9.2f}%{bpp:>13.3f}")
    return results


if __name__ == "__main__":
    main()
