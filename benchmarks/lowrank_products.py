"""The low-rank states' products and QRs (lowbit_optim.lowrank_products) beside torch's, on GPT-2-small's shapes.

A LowRankState takes four (rows x cols x rank) products per step: ``outer`` = left @ right.T twice
(its read, and its write's residual), ``times`` = matrix @ basis and ``transposed_times`` =
matrix.T @ left once each; and two QRs, of its (cols x rank) start and its (rows x rank) product.
This times each, as lowbit_optim computes them on the CPU (csrc/products.h, csrc/orthonormal.h: one
order on every build and thread count) and as torch does (its BLAS, LAPACK's QR), in the same
process, the products into preallocated outputs as the fused kernel's buffers are (fresh memory
would add a page fault per 4 KiB to both), the fastest of ``--repeats``. Matrices: the token embedding (50257 x 768) and a block's four (768 x 2304,
768 x 768, 768 x 3072, 3072 x 768).

    python benchmarks/lowrank_products.py                  # rank 32 (8bit-lowrank), this CPU
    python benchmarks/lowrank_products.py --rank 64        # 4bit-lowrank
    python benchmarks/lowrank_products.py --isa avx2       # as an AVX2 + FMA CPU would run it
"""

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import as_avx2  # noqa: E402

SHAPES = [(50257, 768), (768, 2304), (768, 768), (768, 3072), (3072, 768)]


def fastest(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--isa", choices=("native", "avx2"), default="native", help="avx2: torch forced to AVX2, the library built without AVX-512")
    args = p.parse_args(argv)
    if args.isa == "avx2":
        as_avx2.reexec()
    import torch

    from lowbit_optim import fused_cpu, kernel_build, lowrank_products

    if args.isa == "avx2":
        as_avx2.build_kernel_without_avx512()
    if fused_cpu.library() is None:
        raise SystemExit("the fused kernel's library cannot be built here: lowrank_products would be torch's own")
    print(f"rank {args.rank}, {torch.get_num_threads()} threads, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()} kernels), library flags {' '.join(kernel_build.flags()[:4])}")
    print("| matrix | product or QR | lowbit_optim ms | torch ms | lowbit / torch |\n|---|---|---:|---:|---:|")
    totals = [0.0, 0.0]
    for rows, cols in SHAPES:
        g = torch.Generator().manual_seed(0)
        matrix, basis = torch.randn(rows, cols, generator=g), torch.randn(cols, args.rank, generator=g)
        left = torch.randn(rows, args.rank, generator=g)
        full, narrow, wide = torch.empty(rows, cols), torch.empty(rows, args.rank), torch.empty(cols, args.rank)
        cases = {
            "outer": (lambda: lowrank_products.outer(left, basis, out=full), lambda: torch.mm(left, basis.T, out=full)),
            "times": (lambda: lowrank_products.times(matrix, basis, out=narrow), lambda: torch.mm(matrix, basis, out=narrow)),
            "transposed_times": (lambda: lowrank_products.transposed_times(matrix, left, out=wide), lambda: torch.mm(matrix.T, left, out=wide)),
            "QR of rows x rank": (lambda: lowrank_products.orthonormal(left), lambda: torch.linalg.qr(left)),
            "QR of cols x rank": (lambda: lowrank_products.orthonormal(basis), lambda: torch.linalg.qr(basis)),
        }
        for name, (ours, theirs) in cases.items():
            a, b = fastest(ours, args.repeats), fastest(theirs, args.repeats)
            weight = 2 if name == "outer" else 1  # a step takes outer twice
            totals[0] += weight * a
            totals[1] += weight * b
            print(f"| {rows} x {cols} | {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f} |")
    print(f"| a step's four products and two QRs, these matrices | | {totals[0] * 1e3:.1f} | {totals[1] * 1e3:.1f} | {totals[0] / totals[1]:.2f} |")


if __name__ == "__main__":
    main()
