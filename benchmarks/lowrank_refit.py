"""Low-rank states whose factors are refit only every k-th write: what it costs in training.

A low-rank state (``8bit-lowrank``) runs one step of subspace iteration at every write (two QRs and three
(rows x cols x rank) products) and its read adds a fourth product: in the fused kernel those products
are most of its step's time (README, Optimizers x formats). Refitting the factors only at every k-th
write would leave one product a step: in between, the codes hold values - left @ right.T with the
factors of the last refit. This script measures what that does to training on the MLP task of
convergence.py: one state (by default the optimizer's slowest momentum) in such a format, every
other state in fp32, beside the same state in ``8bit-lowrank`` (a refit at every write) and fp32
state. The format lives here, not in the library: its count of writes is an attribute of the state
object, so the optimizer takes its eager reference step (``compile=False``).

    python benchmarks/lowrank_refit.py --optimizer ademamix --lr 1e-3 --seeds 0,1,2,3,4 --every 2,4,16

The table goes to benchmarks/results/lowrank_refit_<optimizer>_<base>_lr<lr>.md (convergence.py's
format); ``--base 4bit-lowrank`` takes that format instead of ``8bit-lowrank``.
"""

import argparse
import pathlib
import sys

import lowbit_optim
from lowbit_optim.lowrank import LowRankState
from lowbit_optim.state import CodebookState

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import convergence  # noqa: E402

SLOWEST = {"ademamix": "exp_avg_slow", "sgd": "momentum_buffer", "lion": "exp_avg", "adamw": "exp_avg"}


def refit_every(base: str, k: int) -> str:
    """The name of low-rank format ``base`` refit at every k-th write only (registered on first use)."""
    format_name = f"{base}-refit{k}"
    if format_name in lowbit_optim.registered_formats():
        return format_name
    base_class = lowbit_optim.registered_formats()[base]
    if not issubclass(base_class, LowRankState):
        raise SystemExit(f"--base {base} is not a low-rank format")

    class RefitEvery(base_class):  # registered by its name, as any format
        name = format_name

        def quantize_(self, x):
            writes = self.__dict__.get("writes_since_start", 0)
            self.__dict__["writes_since_start"] = writes + 1
            if self.rank and writes % k:  # the factors as they are: the codes take what they miss
                CodebookState.quantize_(self, x.float().reshape(-1) - self._low_rank())
            else:
                super().quantize_(x)

    return format_name


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=tuple(SLOWEST), default="ademamix")
    p.add_argument("--state", help="the state in the low-rank format (default: the optimizer's slowest momentum)")
    p.add_argument("--base", default="8bit-lowrank", help="the low-rank format (8bit-lowrank, 4bit-lowrank, ...)")
    p.add_argument("--every", default="2,4,16", help="comma-separated k: refit the factors at every k-th write")
    p.add_argument("--lr", help="peak lr (default: convergence.py's for the optimizer)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", default="3000")
    p.add_argument("--out-md", help="default: benchmarks/results/lowrank_refit_<optimizer>_lr<lr>.md")
    p.add_argument("--mlp", nargs=argparse.REMAINDER, default=[], help="further convergence.py arguments of the MLP task (last)")
    args = p.parse_args(argv)
    given = ["--lr", args.lr] if args.lr else []
    task = convergence.parse_args(["--task", "mlp", "--optimizer", args.optimizer, "--seeds", args.seeds, "--steps", args.steps, *given, *args.mlp])
    out_md = pathlib.Path(args.out_md or convergence.RESULTS / f"lowrank_refit_{args.optimizer}_{args.base}_lr{task.lr:g}.md")
    task.out_md, task.out_png = str(out_md), str(out_md.with_suffix(".png"))
    info = convergence.OPTIMIZERS[args.optimizer]
    cls, kwargs = getattr(lowbit_optim, info.lowbit), info.kwargs(task)
    state = args.state or SLOWEST[args.optimizer]

    def row(label: str, fmt: str):
        formats = {s.name: (fmt if s.name == state else "fp32") for s in cls.states}
        make = lambda params, lr, weight_decay, **_: cls(params, lr=lr, weight_decay=weight_decay, state_format=formats, compile=False, **kwargs)  # noqa: E731
        return convergence.OptimizerSpec(label, make, True)

    specs = [row(convergence.REFERENCE, "fp32"), row(f"lowbit {state} {args.base}", args.base)]
    specs += [row(f"lowbit {state} refit every {k}", refit_every(args.base, int(k))) for k in args.every.split(",")]
    return convergence.compare(task, specs, convergence.make_mlp_dataset(task))


if __name__ == "__main__":
    main()
