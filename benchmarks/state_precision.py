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
independent draws wander by the square root of the steps). ``<M>bf<E>`` rounds stochastically to a
block floating point: each block of BLOCK consecutive values shares the exponent of its largest
magnitude, and a value keeps E exponent bits below it and M mantissa bits (smaller values take the
lowest binade's spacing, as subnormals): M + E bits per value, a sign bit more for a signed state,
what a format of that many bits with a per-block scale could hold. For a nonnegative state (a second
moment) ``<M>lg``, ``<M>rs`` and ``<M>bl<E>`` round stochastically so that log, 1/sqrt or (``bl``, on
the block float's grid, never down to 0) log of the state is unbiased instead of the state itself.
``--others`` gives the other states' formats of their own (default: fp32). Paired per-seed gaps of the final
training-set loss, as convergence.py reports them; written to
benchmarks/results/state_precision_<optimizer>_<state>_lr<lr>.md.

    OMP_NUM_THREADS=1 python benchmarks/state_precision.py --optimizer ademamix --state exp_avg_sq --lr 1e-3
"""

import argparse
import pathlib
import re
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


BLOCK = 256  # values per shared exponent (``<M>bf<E>``)


UNBIASED_IN = {"rs": torch.rsqrt, "lg": torch.log}  # <M>rs: 1/sqrt(x) unbiased; <M>lg: log(x)


def up_probability(y: torch.Tensor, low: torch.Tensor, spacing: torch.Tensor, f) -> torch.Tensor:
    """The probability that y, between the grid values low and low + spacing, rounds up so that f of
    the result is unbiased: (f(y) - f(low)) / (f(low + spacing) - f(low)); 1 where low is 0 and y is
    not (f(0) is infinite for log and 1/sqrt: the limit of that rule), 0 for y = 0."""
    return torch.where(low > 0, (f(y) - f(low)) / (f(low + spacing) - f(low)), (y > 0).double())


def round_mantissa_unbiased_in(x: torch.Tensor, mantissa_bits: int, kind: str, generator: torch.Generator) -> None:
    """Round a nonnegative fp32 ``x`` in place, stochastically, to ``mantissa_bits`` explicit mantissa
    bits so that f of the result is unbiased, f = UNBIASED_IN[kind]: between the grid values a <= x <
    b, up with probability (f(x) - f(a)) / (f(b) - f(a)) instead of (x - a) / (b - a). Adam's update
    divides by sqrt(v): with v unbiased (sr) that quotient is biased up (Jensen), with 1/sqrt(v)
    unbiased (rs) v drifts up instead. In float64; zero, negative and non-finite values stay."""
    f = UNBIASED_IN[kind]
    y = x.double()
    spacing = torch.ldexp(torch.ones_like(y), torch.frexp(y).exponent - 1 - mantissa_bits)
    low = torch.floor(y / spacing) * spacing
    draws = torch.rand(y.shape, generator=generator, dtype=torch.float64)
    rounded = (low + (draws < up_probability(y, low, spacing, f)) * spacing).float()
    x.copy_(torch.where(torch.isfinite(x) & (x > 0), rounded, x))


def round_block_float(x: torch.Tensor, mantissa_bits: int, exponent_bits: int, generator: torch.Generator, log: bool = False) -> None:
    """Round fp32 ``x`` in place, stochastically, to the block floating point of ``<M>bf<E>`` (module
    doc): the spacing at a value is 2**(e - mantissa_bits), e its binade's exponent, at least the
    exponent of its block's largest magnitude less 2**exponent_bits - 1. With ``log`` (``<M>bl<E>``,
    a nonnegative state) log of the result is unbiased instead of the result, as ``<M>lg`` does,
    and no value rounds down to 0 (log 0 is -inf: the limit of that rule). In float64, where the grid
    and the draws are exact; non-finite values stay as they are."""
    flat = x.view(-1)
    y = torch.nn.functional.pad(flat.double(), (0, -flat.numel() % BLOCK)).view(-1, BLOCK)
    top = torch.frexp(y.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=1, keepdim=True)).exponent - 1  # of the finite values
    exponent = torch.maximum(torch.frexp(y).exponent - 1, top - (2**exponent_bits - 1))
    spacing = torch.ldexp(torch.ones_like(y), exponent - mantissa_bits)
    draws = torch.rand(y.shape, generator=generator, dtype=torch.float64)
    if log:
        low = torch.floor(y / spacing) * spacing
        rounded = low + (draws < up_probability(y, low, spacing, torch.log)) * spacing
    else:
        rounded = torch.floor(y / spacing + draws) * spacing
    rounded = rounded.view(-1)[: flat.numel()].float()
    flat.copy_(torch.where(torch.isfinite(flat), rounded, flat))


ROUNDING = re.compile(r"(\d+)(rn|sr|ld|rs|lg|b[fl](\d+))")


def parse_rounding(rounding: str) -> tuple[int, str, int | None] | None:
    """``<M>rn|sr|ld|rs|lg`` or ``<M>bf<E>``, ``<M>bl<E>`` as (M, kind, E or None); None if it is neither."""
    match = ROUNDING.fullmatch(rounding)
    if not match or not 1 <= int(match[1]) <= 22 or match[3] is not None and not 0 <= int(match[3]) <= 7:
        return None
    return int(match[1]), match[2][:2], None if match[3] is None else int(match[3])


def label(state: str, rounding: str) -> str:
    mantissa_bits, kind, exponent_bits = parse_rounding(rounding)
    if kind in ("bf", "bl"):
        return f"{state} {mantissa_bits}-bit mantissa, {exponent_bits}-bit exponent below its block's, {'sr' if kind == 'bf' else 'lg'}"
    return f"{state} {mantissa_bits}-bit mantissa {kind}"


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


def spec(label: str, args, rounding: str | None, others: dict | None = None) -> convergence.OptimizerSpec:
    """The reference (rounding None: fp32 state), or the rounded state beside ``others`` (--others:
    the other states' formats; fp32 where it names none; the rounded state is held in fp32)."""
    info = convergence.OPTIMIZERS[args.optimizer]
    cls = getattr(lowbit_optim, info.lowbit)
    formats = {**{state.name: "fp32" for state in cls.states}, **others, args.state: "fp32"} if rounding is not None and others else "fp32"

    def make(params, lr, weight_decay, **_):
        opt = cls(params, lr=lr, weight_decay=weight_decay, state_format=formats, **info.kwargs(args))
        if rounding is not None:
            mantissa_bits, kind, exponent_bits = parse_rounding(rounding)
            steps = [0]
            if kind in ("bf", "bl") or kind in UNBIASED_IN:
                generator = torch.Generator().manual_seed(1234)
            else:
                draws = draw_source(rounding, mantissa_bits)

            def round_state(optimizer, *_):
                steps[0] += 1
                with torch.no_grad():
                    for key, state in optimizer.state.items():
                        x = state[args.state]
                        if kind in ("bf", "bl"):
                            round_block_float(x, mantissa_bits, exponent_bits, generator, log=kind == "bl")
                        elif kind in UNBIASED_IN:
                            round_mantissa_unbiased_in(x, mantissa_bits, kind, generator)
                        else:
                            round_mantissa(x, mantissa_bits, draws and draws(steps[0], key, x))

            opt.register_step_post_hook(round_state)
        return opt

    return convergence.OptimizerSpec(label, make, True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=("ademamix", "adamw"), default="ademamix")
    p.add_argument("--state", default="exp_avg_sq", help="the state to round (exp_avg, exp_avg_sq; AdEMAMix: exp_avg_slow)")
    p.add_argument("--rounding", default="5sr,7rn,7sr,10rn,10sr", help="comma-separated <mantissa bits>rn|sr|ld|rs|lg or <mantissa bits>bf|bl<exponent bits>")
    p.add_argument("--others", type=convergence.state_format_row, help="JSON: the other states' formats, e.g. '{\"exp_avg\": \"8bit-linear\"}' (default: all fp32)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--out-md", help="default: benchmarks/results/state_precision_<optimizer>_<state>_lr<lr>.md")
    args = p.parse_args(argv)
    for r in args.rounding.split(","):
        if parse_rounding(r) is None:
            p.error(f"--rounding takes <mantissa bits 1..22>rn, sr, ld, rs or lg, or <mantissa bits>bf|bl<exponent bits 0..7>, got {r!r}")
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
    others = args.others["state_format"] if args.others else None
    if isinstance(others, str):
        raise SystemExit("--others takes a JSON dict of the other states' formats")
    beside = f" beside {'/'.join(f'{k} {v}' for k, v in others.items())}" if others else ""
    specs += [spec(label(args.state, r) + beside, task, r, others) for r in args.rounding.split(",")]
    out = convergence.compare(task, specs, convergence.make_mlp_dataset(task))
    retitle(pathlib.Path(out_md), task, "the other states as each row says" if others else "all else fp32")
    return out


def retitle(path: pathlib.Path, task, rest: str) -> None:
    """Put this experiment's title over convergence.py's table (its rows are roundings, not formats)."""
    title = convergence.OPTIMIZERS[task.optimizer].title
    body = path.read_text().split("\n", 1)[1]
    path.write_text(f"# State precision: {title} with `{task.state}` rounded after every step, {rest} (benchmarks/state_precision.py)\n{body}")


if __name__ == "__main__":
    main()
