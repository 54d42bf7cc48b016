"""How many significant bits one optimizer state needs (issue #19): an experiment, not a format.

Trains the MLP task of convergence.py (``--task mlp``) with lowbit_optim's AdEMAMix or AdamW and fp32
state, once as it is (the reference) and once per ``--rounding`` with one state (``--state``) rounded
after every step to a float of M explicit mantissa bits, all else fp32: the state as a format of that
precision would hold it, while every other state stays exact. The exponent keeps fp32's range, so M = 7
rounded to nearest is exactly a bf16 state (checked in test_benchmarks) and M = 10 is fp16's precision
without its range.

``--rounding`` takes ``<M>rn`` (to nearest, ties to even), ``<M>sr`` (stochastically: up with
probability equal to the dropped fraction, unbiased; random bits from a generator seeded per run, so
runs repeat) and ``<M>ld`` (as sr, but each element's draws over the steps are a low-discrepancy
sequence: a random phase per element plus the step count times the golden ratio, mod 1; a constant
fraction then rounds up in a share of steps as close to it as any sequence can come, where
independent draws wander by the square root of the steps). Paired per-seed gaps of the final
training-set loss, as convergence.py reports them; written to
benchmarks/results/state_precision_<optimizer>_<state>_lr<lr>.md.

    OMP_NUM_THREADS=1 python benchmarks/state_precision.py --optimizer ademamix --state exp_avg_sq --lr 1e-3
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import convergence  # noqa: E402

import lowbit_optim  # noqa: E402  (convergence put the repository on the path)


def round_mantissa(x: torch.Tensor, mantissa_bits: int, draws: torch.Tensor | None) -> None:
    """Round fp32 ``x`` in place to ``mantissa_bits`` explicit mantissa bits: to nearest (ties to
    even) without ``draws``, else up where the dropped bits plus the draw (an int32 tensor like x, of
    ``23 - mantissa_bits`` uniform bits) carry. On the bits: a carry into the exponent is the next
    binade's first value, as the float it stands for; NaN and infinities stay as they are."""
    drop = 23 - mantissa_bits
    bits = x.view(torch.int32)
    if draws is None:
        lsb = (bits >> drop) & 1
        add = (1 << (drop - 1)) - 1 + lsb
    else:
        add = draws
    rounded = ((bits + add) >> drop) << drop
    bits.copy_(torch.where(torch.isfinite(x), rounded, bits))


GOLDEN_32 = 0x9E3779B9  # 2**32 / golden ratio: the Weyl sequence's step, mod 2**32


def draw_source(rounding: str, mantissa_bits: int):
    """draws(step, key, like) for ``rounding``'s kind (None: to nearest): ``23 - mantissa_bits``
    uniform bits per element of ``like`` for the ``step``-th rounding of the state of parameter
    ``key``; a generator seeded per run."""
    kind, drop = rounding[-2:], 23 - mantissa_bits
    if kind == "rn":
        return None
    generator, phases = torch.Generator().manual_seed(1234), {}
    if kind == "sr":
        return lambda step, key, like: torch.randint(0, 1 << drop, like.shape, generator=generator, dtype=torch.int32)

    def low_discrepancy(step, key, like):
        if key not in phases:
            phases[key] = torch.randint(0, 1 << 32, like.shape, generator=generator, dtype=torch.int64)
        return (((phases[key] + step * GOLDEN_32) & 0xFFFFFFFF) >> (32 - drop)).to(torch.int32)

    return low_discrepancy


def spec(label: str, args, rounding: str | None) -> convergence.OptimizerSpec:
    info = convergence.OPTIMIZERS[args.optimizer]
    cls = getattr(lowbit_optim, info.lowbit)

    def make(params, lr, weight_decay, **_):
        opt = cls(params, lr=lr, weight_decay=weight_decay, state_format="fp32", **info.kwargs(args))
        if rounding is not None:
            mantissa_bits = int(rounding[:-2])
            draws, steps = draw_source(rounding, mantissa_bits), [0]

            def round_state(optimizer, *_):
                steps[0] += 1
                with torch.no_grad():
                    for key, state in optimizer.state.items():
                        x = state[args.state]
                        round_mantissa(x, mantissa_bits, draws and draws(steps[0], key, x))

            opt.register_step_post_hook(round_state)
        return opt

    return convergence.OptimizerSpec(label, make, True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=("ademamix", "adamw"), default="ademamix")
    p.add_argument("--state", default="exp_avg_sq", help="the state to round (exp_avg, exp_avg_sq; AdEMAMix: exp_avg_slow)")
    p.add_argument("--rounding", default="5sr,7rn,7sr,10rn,10sr", help="comma-separated <mantissa bits>rn|sr|ld")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--out-md", help="default: benchmarks/results/state_precision_<optimizer>_<state>_lr<lr>.md")
    args = p.parse_args(argv)
    for r in args.rounding.split(","):
        if not (r[-2:] in ("rn", "sr", "ld") and r[:-2].isdigit() and 1 <= int(r[:-2]) <= 22):
            p.error(f"--rounding takes <mantissa bits 1..22>rn, sr or ld, got {r!r}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out_md = args.out_md or str(convergence.RESULTS / f"state_precision_{args.optimizer}_{args.state}_lr{args.lr:g}.md")
    task = convergence.parse_args(["--task", "mlp", "--optimizer", args.optimizer, "--lr", str(args.lr), "--seeds", args.seeds,
                                   "--steps", str(args.steps), "--out-md", out_md, "--out-png", str(pathlib.Path(out_md).with_suffix(".png"))])  # fmt: skip
    known = {s.name for s in getattr(lowbit_optim, convergence.OPTIMIZERS[args.optimizer].lowbit).states}
    if args.state not in known:
        raise SystemExit(f"--state {args.state!r}: {args.optimizer} keeps {sorted(known)}")
    task.state = args.state
    specs = [spec(convergence.REFERENCE, task, None)]
    specs += [spec(f"{args.state} {r[:-2]}-bit mantissa {r[-2:]}", task, r) for r in args.rounding.split(",")]
    out = convergence.compare(task, specs, convergence.make_mlp_dataset(task))
    retitle(pathlib.Path(out_md), task)
    return out


def retitle(path: pathlib.Path, task) -> None:
    """Put this experiment's title over convergence.py's table (its rows are roundings, not formats)."""
    title = convergence.OPTIMIZERS[task.optimizer].title
    body = path.read_text().split("\n", 1)[1]
    path.write_text(f"# State precision: {title} with `{task.state}` rounded after every step, all else fp32 (benchmarks/state_precision.py)\n{body}")


if __name__ == "__main__":
    main()
