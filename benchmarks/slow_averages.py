"""How slow a moving average each state format holds: the norm of an average kept in the format
against the same average in fp32, after many writes.

An average m <- beta * m + (1 - beta) * g of noisy gradients of a square matrix (a rank-8 signal,
0.3 of it, plus unit Gaussian noise; the same seeded draws for every row), its state written and
read back at every step as an optimizer's step does. A format whose rounding noise is drawn afresh at
every write (the low-rank formats: their refit moves the residual's grid) gathers noise that an
average with beta near 1 keeps longer than it takes to arrive: past a point the state grows without
bound (lowrank.py, "Slow averages"; README, "Low-rank states and slow averages"). Each row prints
|state| / |fp32 average| at each quarter of the writes; a format's ``max_signed_decay`` is set from
these runs, where larger matrices held less (the rank's share of the matrix is smaller).

    python benchmarks/slow_averages.py --formats 4bit-lowrank --sizes 256,768 --betas 0.99,0.995
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lowbit_optim.registry import get_format  # noqa: E402


def norm_ratios(fmt_name: str, beta: float, writes: int, size: int, seed: int = 0, points: int = 4) -> list[float]:
    """|state| / |fp32 average| after each of ``points`` equal parts of ``writes`` writes."""
    g = torch.Generator().manual_seed(seed)
    u, v = torch.randn(size, 8, generator=g), torch.randn(size, 8, generator=g)
    state, reference = get_format(fmt_name).zeros((size, size)), torch.zeros(size, size)
    ratios = []
    for t in range(writes):
        grad = 0.3 * u @ torch.randn(8, 8, generator=g) @ v.T + torch.randn(size, size, generator=g)
        state.copy_(beta * state.dequantize() + (1 - beta) * grad)
        reference = beta * reference + (1 - beta) * grad
        if (t + 1) % (writes // points) == 0:
            ratios.append(state.dequantize().norm().item() / reference.norm().item())
    return ratios


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--formats", default="4bit-lowrank,4bit-lowrank-mulaw", help="comma-separated format names")
    parser.add_argument("--sizes", default="256,768", help="comma-separated matrix sizes (square)")
    parser.add_argument("--betas", default="0.95,0.98,0.99,0.995", help="comma-separated decays")
    parser.add_argument("--writes", type=int, default=4000)
    parser.add_argument("--out-md", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if args.writes < 4:
        parser.error(f"--writes {args.writes}: at least 4 (the ratio is printed at each quarter)")
    rows = []
    lines = ["| format | size | beta | writes | max_signed_decay | \\|state\\| / \\|fp32\\| at each quarter | s |", "|---|---:|---:|---:|---:|---|---:|"]
    for name in args.formats.split(","):
        for size in map(int, args.sizes.split(",")):
            for beta in map(float, args.betas.split(",")):
                start = time.perf_counter()
                ratios = norm_ratios(name, beta, args.writes, size)
                seconds = time.perf_counter() - start
                rows.append(dict(format=name, size=size, beta=beta, writes=args.writes, ratios=ratios, seconds=seconds))
                shown = ", ".join(f"{r:.3g}" for r in ratios)
                lines.append(f"| {name} | {size} | {beta} | {args.writes} | {get_format(name).max_signed_decay} | {shown} | {seconds:.0f} |")
                print(lines[-1], flush=True)
    if args.out_md:
        Path(args.out_md).write_text("\n".join([f"`python benchmarks/slow_averages.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "", *lines]) + "\n")
    return rows


if __name__ == "__main__":
    main()
