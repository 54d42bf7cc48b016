"""Train a 4-billion-parameter transformer in 24 GiB: 4-bit states, 24-bit weights, the step in backward.

fp32 AdamW needs 16 bytes per parameter (weights 4, gradients 4, states 8): on a 24 GiB machine it stops
near 1.3B parameters. Here each parameter costs about 4.1 bytes of tensors (4.4-4.5 at the measured peak):

- weights in bf16 with an int8 correction (``param_update="int8-correction"``: 24-bit master weights, 3
  bytes), built directly in bf16 (no fp32 copy ever exists);
- AdamW's two moments in 4-bit codes with block scales (~1.07 bytes);
- ``step_in_backward=True``: each parameter is stepped as soon as backward has produced its gradient,
  and the gradient is freed, so gradients never add up to a model's worth;
- ``max_grad_norm=1.0``: gradients clipped with the larger of the previous step's global norm and this
  step's norm so far (the step in backward cannot wait for this step's).

It trains the char GPT of train_char_gpt.py (Python's help text, nothing downloaded) for a few steps and
prints each step's loss and the process's peak memory per parameter::

    python examples/train_large_model.py                                     # 4.0B parameters, 8 steps
    python examples/train_large_model.py --layers 2 --d-model 256 --steps 30 # a small check (seconds)
"""

import argparse
import time

import torch
from train_char_gpt import GPT, CharDataset, get_batch, load_text

import lowbit_optim


def peak_rss_bytes() -> int:
    """The process's peak resident memory (Linux: VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def train(args) -> dict:
    dataset = CharDataset(load_text())
    start = time.perf_counter()
    model = GPT.empty_then_init(dataset.vocab_size, args.block_size, args.layers, args.d_model, args.heads, dtype=torch.bfloat16, seed=args.seed)
    n = sum(p.numel() for p in model.parameters())
    print(f"{n / 1e9:.2f}B parameters ({args.layers} blocks of width {args.d_model}), built in {time.perf_counter() - start:.0f} s")
    opt = lowbit_optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        state_format="4bit",
        param_update="int8-correction",
        step_in_backward=True,
        max_grad_norm=1.0,
    )
    generator = torch.Generator().manual_seed(args.seed)
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        _, loss = model(*get_batch(dataset.train, args.batch_size, args.block_size, generator))
        loss.backward()  # steps every parameter and frees its gradient
        opt.step()  # nothing left to step: kept so the loop reads as usual
        opt.zero_grad()
        losses.append(loss.item())
        print(f"step {step + 1:3d}  loss {losses[-1]:.4f}  {time.perf_counter() - start:6.1f} s  peak {peak_rss_bytes() / 2**30:.1f} GiB")
    peak = peak_rss_bytes()
    print(f"peak memory {peak / 2**30:.1f} GiB = {peak / n:.2f} bytes/param (everything: Python, torch, data, activations)")
    print(f"optimizer state (moments and int8 corrections) {lowbit_optim.bytes_per_param(opt):.2f} bytes/param; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return {"params": n, "losses": losses, "peak_bytes": peak}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=20, help="transformer blocks (12 d^2 parameters each)")
    p.add_argument("--d-model", type=int, default=4096, help="embedding width")
    p.add_argument("--heads", type=int, default=32, help="attention heads")
    p.add_argument("--steps", type=int, default=8, help="training steps")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per step")
    p.add_argument("--block-size", type=int, default=64, help="context length in characters")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate (without warm-up; 1e-5 diverges a 1.2B slice of this model, torch AdamW too)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batches")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
