"""The default CPU step (the fused kernel) against the compiled step it stands in for, for every
registered format under every optimizer whose update the kernel has: issue 15 asks that the default
path never be slower than the compiled step on the machine it runs on.

Each row builds the same parameters twice and steps one optimizer with fused=None (the default: the
kernel, wherever it takes the format) and one with fused=False (torch.compile); after the warm-up
steps it steps them in turn and keeps the fastest step of each. A format stored as another pairs as
the tests pair it (``paired_state_format``: ``factored`` holds AdamW's and AdEMAMix's second moment
beside 4bit first moments); a format the optimizer refuses (a signed state in a nonnegative-only format, an
average too slow for a low-rank format) is listed as refused, with the reason's start.

    python benchmarks/default_vs_compiled.py --out-md benchmarks/results/default_vs_compiled_epyc.md
    python benchmarks/default_vs_compiled.py --isa avx2    # as an AVX2 + FMA CPU would run (as_avx2.py)
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import as_avx2  # noqa: E402

# square and rectangular matrices, and vectors below min_quantize_numel (4096: they keep fp32 states)
SHAPES = "512x512,512x512,512x512,512x512,2048x512,512x2048,512,2048,50x512"
OPTIMIZERS = ("AdamW", "SGD", "Lion", "AdEMAMix", "Muon")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated, of " + ", ".join(OPTIMIZERS))
    parser.add_argument("--formats", default=None, help="comma-separated format names (default: every registered one)")
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated parameter shapes, RxC or N (Muon takes the matrices)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each optimizer, in turn")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native", help="avx2: as an AVX2 + FMA CPU would run, on this one (as_avx2.py)")
    parser.add_argument("--out-md", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    unknown = set(args.optimizers.split(",")) - set(OPTIMIZERS)
    if unknown:
        parser.error(f"--optimizers: unknown {sorted(unknown)}; use some of {', '.join(OPTIMIZERS)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.isa == "avx2":
        as_avx2.reexec()  # before `import torch`, which reads the capability once
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lowbit_optim
    from lowbit_optim.formats import paired_state_format, registered_formats

    if args.isa == "avx2":
        as_avx2.build_kernel_without_avx512()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    makers = {
        "AdamW": lambda params, **kw: lowbit_optim.AdamW(params, lr=1e-3, **kw),
        "SGD": lambda params, **kw: lowbit_optim.SGD(params, lr=1e-3, momentum=0.9, **kw),
        "Lion": lambda params, **kw: lowbit_optim.Lion(params, lr=1e-4, **kw),
        "AdEMAMix": lambda params, **kw: lowbit_optim.AdEMAMix(params, lr=1e-3, **kw),
        "Muon": lambda params, **kw: lowbit_optim.Muon(params, lr=2e-2, **kw),
    }
    names = args.formats.split(",") if args.formats else list(registered_formats())
    unknown = [name for name in names if name not in registered_formats()]
    if unknown:  # (checked once lowbit_optim is imported: parse_args runs before torch is)
        raise SystemExit(f"--formats: unknown {unknown}; use some of {', '.join(registered_formats())}")
    lines = [
        f"`python benchmarks/default_vs_compiled.py {' '.join(sys.argv[1:] if argv is None else argv)}`: torch {torch.__version__}, "
        f"{torch.backends.cpu.get_cpu_capability()} torch kernels{', fused kernel without AVX-512' if args.isa == 'avx2' else ''}, "
        f"{torch.get_num_threads()} threads; fastest of {args.steps} steps after {args.warmup}, ms",
        "",
        "| optimizer | format | default (kernel) | compiled | compiled / default |",
        "|---|---|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    rows = []
    for optimizer in args.optimizers.split(","):
        its_shapes = [s for s in shapes if len(s) == 2] if optimizer == "Muon" else shapes
        for name in names:
            row = dict(optimizer=optimizer, format=name)
            try:
                steppers = []
                for fused in (None, False):
                    g = torch.Generator().manual_seed(0)
                    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in its_shapes]
                    for p in params:
                        p.grad = torch.randn(p.shape, generator=g) * 1e-2
                    steppers.append(makers[optimizer](params, state_format=paired_state_format(name, optimizer=getattr(lowbit_optim, optimizer)), fused=fused))
            except (ValueError, TypeError) as error:
                row["refused"] = str(error).split(";")[0][:100]
                lines.append(f"| {optimizer} | {name} | refused: {row['refused']} | | |")
            else:
                for opt in steppers:
                    for _ in range(args.warmup):
                        opt.step()
                best = [float("inf")] * 2
                for _ in range(args.steps):
                    for i, opt in enumerate(steppers):
                        start = time.perf_counter()
                        opt.step()
                        best[i] = min(best[i], time.perf_counter() - start)
                row.update(default_ms=1e3 * best[0], compiled_ms=1e3 * best[1], ratio=best[1] / best[0])
                lines.append(f"| {optimizer} | {name} | {row['default_ms']:.2f} | {row['compiled_ms']:.2f} | {row['ratio']:.2f} |")
            rows.append(row)
            print(lines[-1], flush=True)
    timed = [r for r in rows if "ratio" in r]
    if timed:
        slowest = min(timed, key=lambda r: r["ratio"])
        lines += ["", f"Smallest compiled / default: {slowest['ratio']:.2f} ({slowest['optimizer']}, {slowest['format']})."]
        print(lines[-1])
    if args.out_md:
        Path(args.out_md).write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
