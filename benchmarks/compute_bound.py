"""What bounds an Adam step on this CPU: memory traffic or arithmetic? (issue #3)

1. ``torch.optim.AdamW(fused=True)`` per element, with its four tensors in cache and in DRAM: if the
   times are close, the step is compute-bound and moving fewer bytes (quantized states) cannot by
   itself make a step faster than it.
2. The bandwidth of plain copies, for scale.
3. The divider: an AVX-512 loop (C, built with the fused kernel's compiler and flags) doing one square
   root and K divisions per element over the GPT-2-small element count on L1-resident data, for
   K = 0..5. The compiled step divides five times per element (three in the update, one per moment
   by the block scale); torch's fused AdamW twice. The fused kernel gives the compiled step's bits
   with one real division per element: it divides by a block scale or a bias correction as a
   multiplication by the reciprocal plus an FMA correction (exact_divisor in the C file).
4. The fused kernel itself, per element and format, in cache and from DRAM: what is left once the
   divisions are gone (decoding, block absmax, encoding, calibration).

    python benchmarks/compute_bound.py                     # ~1 min on 2 idle cores
"""

import argparse
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import lowbit_optim  # noqa: E402
from lowbit_optim import fused_cpu  # noqa: E402

DIVIDER_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    int divisions = atoi(argv[1]);
    long n = atol(argv[2]);
    double start = omp_get_wtime();
    float sink = 0;
    #pragma omp parallel reduction(+ : sink)
    {
        float buf[1024];
        for (int i = 0; i < 1024; i++) buf[i] = 1.0f + i * 1e-3f;
        __m512 acc = _mm512_setzero_ps(), s = _mm512_set1_ps(1.0001f);
        #pragma omp for
        for (long c = 0; c < n / 1024; c++)
            for (int i = 0; i < 1024; i += 16) {
                __m512 x = _mm512_loadu_ps(buf + i), r = _mm512_sqrt_ps(x);
                for (int k = 0; k < divisions; k++) {  /* independent divisions: throughput, not latency */
                    x = _mm512_add_ps(x, s);
                    r = _mm512_add_ps(r, _mm512_div_ps(x, s));
                }
                acc = _mm512_add_ps(acc, r);
            }
        sink += _mm512_reduce_add_ps(acc);
    }
    printf("%.6f %g\n", omp_get_wtime() - start, sink);
    return 0;
}
"""


def step_ns_per_element(make_optimizer, n: int, steps: int) -> float:
    """Median step time per element of one n-element parameter, less the time of a 1024-element
    step (the per-call cost of Python and the thread pool, which would swamp small sizes)."""

    def median_step(size: int) -> float:
        p = torch.nn.Parameter(torch.randn(size))
        p.grad = torch.randn(size)
        opt = make_optimizer([p])
        opt.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    return (median_step(n) - median_step(1024)) / (n - 1024) * 1e9


def fused_adamw_ns_per_element(n: int, steps: int) -> float:
    return step_ns_per_element(lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True), n, steps)


def kernel_ns_per_element(state_format: str, n: int, steps: int) -> float:
    """The fused CPU kernel's step (lowbit_optim.AdamW, fused=True)."""
    make = lambda params: lowbit_optim.AdamW(params, lr=1e-3, state_format=state_format, fused=True, min_quantize_numel=0)
    return step_ns_per_element(make, n, steps)


def copy_gb_per_s(n: int) -> float:
    a, b = torch.randn(n), torch.empty(n)
    b.copy_(a)
    start = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    return 2 * 4 * n * 5 / (time.perf_counter() - start) / 1e9


def divider_seconds(elements: int, max_divisions: int) -> dict[int, float] | None:
    if fused_cpu._compiler() is None or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = pathlib.Path(tmp) / "divider.c", pathlib.Path(tmp) / "divider"
        source.write_text(DIVIDER_SOURCE)
        subprocess.run([fused_cpu._compiler(), "-O3", "-march=native", "-fopenmp", str(source), "-o", str(binary)], check=True)
        out = {}
        for k in range(max_divisions + 1):
            result = subprocess.run([str(binary), str(k), str(elements)], capture_output=True, text=True, check=True)
            out[k] = float(result.stdout.split()[0])
        return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, default=124_439_808, help="elements of the divider loop (GPT-2 small)")
    p.add_argument("--dram-elements", type=int, default=2**27, help="a parameter far larger than the caches")
    p.add_argument("--max-divisions", type=int, default=5)
    p.add_argument("--formats", default="fp32,bf16,8bit,fp8,4bit-uncalibrated,4bit", help="kernel formats of part 4")
    args = p.parse_args(argv)
    print(f"{torch.get_num_threads()} threads")
    results = {"adamw_ns": {}, "divider_s": None}
    for n, steps in [(2**18, 300), (args.dram_elements, 7)]:
        ns = fused_adamw_ns_per_element(n, steps)
        results["adamw_ns"][n] = ns
        print(f"fused AdamW, {n:>11,} elements ({16 * n / 2**20:,.0f} MiB of p, g, m, v): {ns:.3f} ns/element")
    results["copy_gb_s"] = copy_gb_per_s(args.dram_elements)
    print(f"copy of {4 * args.dram_elements / 2**20:,.0f} MiB: {results['copy_gb_s']:.1f} GB/s (read + write)")
    results["divider_s"] = divider_seconds(args.elements, args.max_divisions)
    if results["divider_s"] is None:
        print("divider loop skipped: it needs AVX-512 and a C compiler")
    else:
        for k, seconds in results["divider_s"].items():
            print(f"1 sqrt + {k} divisions per element, {args.elements:,} elements: {seconds:.4f} s")
    results["kernel_ns"] = {}
    if fused_cpu.library() is None:
        print("fused kernel skipped: it cannot be built here")
        return results
    for state_format in args.formats.split(","):
        sizes = {n: kernel_ns_per_element(state_format, n, steps) for n, steps in [(2**18, 300), (args.dram_elements, 7)]}
        results["kernel_ns"][state_format] = sizes
        cache, dram = sizes.values()
        print(f"fused kernel, {state_format:>17}: {cache:.3f} ns/element in cache, {dram:.3f} from DRAM")
    return results


if __name__ == "__main__":
    main()
