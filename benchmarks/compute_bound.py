"""What bounds an Adam step on this CPU: memory traffic or arithmetic? (issues #3, #15)

1. ``torch.optim.AdamW(fused=True)`` per element, with its four tensors in cache and in DRAM: if the
   times are close, the step is compute-bound and moving fewer bytes (quantized states) cannot by
   itself make a step faster than it.
2. The bandwidth of plain copies, for scale.
3. The divider: a vector loop (C, built with the fused kernel's compiler) doing one square root and
   K divisions per element over the GPT-2-small element count on L1-resident data, for K = 0..5,
   with the widest vectors of the ISA measured (AVX-512: 16 lanes; AVX2: 8). The compiled step
   divides five times per element (three in the update, one per moment by the block scale);
   torch's fused AdamW twice. With AVX-512 the fused kernel gives the compiled step's bits with one
   real division per element (it divides by a block scale or a bias correction as a multiplication
   by the reciprocal plus an FMA correction: csrc/divide.h); with AVX2 three times: Adam's update
   divides by its bias corrections so too, but the encoding divides by each block scale with 8-lane
   divisions (measured faster there than the corrected products). Where the divider is fast
   (FAST_DIVIDER: AMD's family 26, kernel_build.tuning), the update's square root is divided by a
   real division too: one more per element on the divider, one corrected product fewer on the ports
   (with bf16 states, whose conversions keep the ports busy, the first moment's quotient as well);
   and the AVX-512 encoding divides by each block scale with real divisions, as the AVX2 one does.
4. The fused kernel itself, per element and format, in cache and from DRAM: what is left once the
   divisions are counted (decoding, block absmax, encoding, calibration). ``--optimizer ademamix``
   steps lowbit_optim.AdEMAMix instead of AdamW (three states); ``--param-update nearest`` or
   ``int8-correction`` steps bf16 weights so (precision.py) instead of fp32 ones.
5. The stages of an Adam step with ``--stages-format`` state (default ``4bit``), each timed alone
   on 1024 values (two of the kernel's chunks) held in L1 (the kernel's own functions, compiled
   with its flags into a timing library): storing the first moment (block absmax, codes, packing),
   storing the second, loading (decoding) both, and the update.

``--isa native,avx2`` measures it all twice: as this CPU runs it, and as an AVX2 + FMA CPU would
(in a child process: torch's kernels forced to AVX2 with ATEN_CPU_CAPABILITY=avx2, the fused kernel
built with -mno-avx512f, the AVX2 divider loop), so that an AVX-512 machine explains both.

    python benchmarks/compute_bound.py                     # ~2 min on 2 idle cores
    python benchmarks/compute_bound.py --isa native,avx2   # both ISAs, ~4 min
    OMP_NUM_THREADS=1 python benchmarks/compute_bound.py --isa native,avx2   # one thread (divider too)
"""

import argparse
import ctypes
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import as_avx2  # noqa: E402
import lowbit_optim  # noqa: E402
from lowbit_optim import fused_cpu, kernel_abi, kernel_build, kernel_op  # noqa: E402

# The divider loop for each ISA: vector type, lane count, intrinsics, the compiler flag that enables
# them, and the CPU flag (/proc/cpuinfo) that says they run here.
ISAS = {
    "avx512": dict(vec="__m512", lanes=16, p="_mm512", cflag="-mavx512f", cpu="avx512f"),
    "avx2": dict(vec="__m256", lanes=8, p="_mm256", cflag="-mavx2", cpu="avx2"),
}

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
        float buf[1024], lanes[LANES];
        for (int i = 0; i < 1024; i++) buf[i] = 1.0f + i * 1e-3f;
        VEC acc = P_setzero_ps(), s = P_set1_ps(1.0001f);
        #pragma omp for
        for (long c = 0; c < n / 1024; c++)
            for (int i = 0; i < 1024; i += LANES) {
                VEC x = P_loadu_ps(buf + i), r = P_sqrt_ps(x);
                for (int k = 0; k < divisions; k++) {  /* independent divisions: throughput, not latency */
                    x = P_add_ps(x, s);
                    r = P_add_ps(r, P_div_ps(x, s));
                }
                acc = P_add_ps(acc, r);
            }
        P_storeu_ps(lanes, acc);
        for (int i = 0; i < LANES; i++) sink += lanes[i];
    }
    printf("%.6f %g\n", omp_get_wtime() - start, sink);
    return 0;
}
"""


STAGES_SOURCE = r"""
#include "fused_step.c"
#include <time.h>

static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* ns per element of each stage of an Adam step on the first n values (a whole number of blocks,
 * n <= MAX_CHUNK) of the states first (exp_avg) and second (exp_avg_sq), the fastest of 7 rounds of
 * reps, all in L1: [0] storing first (block absmax, codes, packing), [1] storing second, [2] loading
 * both, [3] the update. Each repetition first copies its inputs back (a few hundredths of a ns). */
void lowbit_time_stages(const state_t *first, const state_t *second, const adam_hyper_t *hyper, int64_t n, int64_t reps, double *ns) {
    static float m[MAX_CHUNK], v[MAX_CHUNK], p[MAX_CHUNK], g[MAX_CHUNK], p0[MAX_CHUNK], x[MAX_CHUNK], y[MAX_CHUNK];
    memcpy(m, load_state(first, 0, n, x), n * sizeof(float));
    memcpy(v, load_state(second, 0, n, y), n * sizeof(float));
    for (int64_t i = 0; i < n; i++) p0[i] = 1.0f, g[i] = m[(i * 7) % n];
    adam_scalars_t k;
    adam_prepare(hyper, 10.0f, &k);
    for (int s = 0; s < 4; s++) ns[s] = INFINITY;
    for (int round = 0; round < 7; round++) {
        double t[5];
        t[0] = thread_seconds();
        for (int64_t r = 0; r < reps; r++) {
            memcpy(x, m, n * sizeof(float));
            store_state(first, 0, n, x, NULL);
        }
        t[1] = thread_seconds();
        for (int64_t r = 0; r < reps; r++) {
            memcpy(x, v, n * sizeof(float));
            store_state(second, 0, n, x, NULL);
        }
        t[2] = thread_seconds();
        for (int64_t r = 0; r < reps; r++) {
            load_state(first, 0, n, x);
            load_state(second, 0, n, y);
        }
        t[3] = thread_seconds();
        for (int64_t r = 0; r < reps; r++) {
            memcpy(x, m, n * sizeof(float));
            memcpy(y, v, n * sizeof(float));
            memcpy(p, p0, n * sizeof(float));
            chunk_t c = {.n = n, .param = p, .grad = g, .state = {x, y, NULL}};
            adam_update(hyper, &k, &c);
        }
        t[4] = thread_seconds();
        for (int s = 0; s < 4; s++) ns[s] = fmin(ns[s], (t[s + 1] - t[s]) / reps / n * 1e9);
    }
}
"""

STAGES = ("store exp_avg", "store exp_avg_sq", "load both", "update")


def stage_ns_per_element(state_format: str, n: int = 1024, reps: int = 20000) -> dict[str, float] | None:
    """Part 5: each stage of one chunk, ns per element (None without a C compiler)."""
    cc = kernel_build.compiler()
    if cc is None:
        return None
    fmt = lowbit_optim.get_format(state_format)
    with tempfile.TemporaryDirectory() as tmp:
        source, library = pathlib.Path(tmp) / "stages.c", pathlib.Path(tmp) / "stages.so"
        source.write_text(STAGES_SOURCE)
        subprocess.run(kernel_build.command(cc, source, library), check=True)
        kernel = kernel_abi.Kernel(ctypes.CDLL(str(library)))
        first = fmt.from_float(torch.randn(n) * 1e-2, signed=True)
        second = fmt.from_float(torch.rand(n) * 1e-4, signed=False)
        hyper = kernel.hyper("adam", dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8, one_minus_beta1=0.1,
                                          one_minus_beta2=1e-3, decoupled_weight_decay=1, maximize=0))  # fmt: skip
        ns = (ctypes.c_double * len(STAGES))()
        states = [ctypes.byref(kernel_op.describe(kernel, state)) for state in (first, second)]
        kernel.lib.lowbit_time_stages(*states, ctypes.byref(hyper), ctypes.c_int64(n), ctypes.c_int64(reps), ns)
    return dict(zip(STAGES, ns))


def divider_source(isa: str) -> str:
    spec = ISAS[isa]
    return DIVIDER_SOURCE.replace("VEC", spec["vec"]).replace("LANES", str(spec["lanes"])).replace("P_", spec["p"] + "_")


def step_ns_per_element(make_optimizer, n: int, steps: int, dtype: torch.dtype = torch.float32) -> float:
    """Fastest step time per element of one n-element parameter of ``dtype``, less the time of a
    1024-element step (the per-call cost of Python and the thread pool, which would swamp small
    sizes). The fastest, not the median: on a shared machine it is the least disturbed."""

    def fastest_step(size: int) -> float:
        p = torch.nn.Parameter(torch.randn(size).to(dtype))
        p.grad = torch.randn(size).to(dtype)
        opt = make_optimizer([p])
        opt.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        return min(times)

    return (fastest_step(n) - fastest_step(1024)) / (n - 1024) * 1e9


IN_CACHE = 2**18  # the elements of the in-cache measurements (--dram-elements is the other size)


def fused_adamw_ns_per_element(n: int, steps: int) -> float:
    return step_ns_per_element(lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True), n, steps)


KERNEL_OPTIMIZERS = {"adamw": "AdamW", "ademamix": "AdEMAMix"}  # --optimizer: lowbit_optim's class


def kernel_ns_per_element(state_format: str, n: int, steps: int, optimizer: str = "adamw", param_update: str | None = None) -> float:
    """The fused CPU kernel's step (lowbit_optim.AdamW or AdEMAMix, fused=True) of an fp32 weight,
    or with ``param_update`` of a bf16 weight."""
    cls = getattr(lowbit_optim, KERNEL_OPTIMIZERS[optimizer])
    weights = {} if param_update is None else dict(param_update=param_update)
    make = lambda params: cls(params, lr=1e-3, state_format=state_format, fused=True, min_quantize_numel=0, **weights)
    return step_ns_per_element(make, n, steps, torch.float32 if param_update is None else torch.bfloat16)


def copy_gb_per_s(n: int) -> float:
    a, b = torch.randn(n), torch.empty(n)
    b.copy_(a)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - start)
    return 2 * 4 * n / min(times) / 1e9


def cpu_flags() -> set[str]:
    return set((kernel_build.cpuinfo_field("flags") or "").split())


def divider_seconds(isa: str, elements: int, max_divisions: int) -> dict[int, float] | None:
    """Seconds of the divider loop per number of divisions; None where the CPU lacks ``isa``."""
    cc = kernel_build.compiler()
    if cc is None or ISAS[isa]["cpu"] not in cpu_flags():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = pathlib.Path(tmp) / "divider.c", pathlib.Path(tmp) / "divider"
        source.write_text(divider_source(isa))
        subprocess.run([*cc, "-O3", ISAS[isa]["cflag"], "-mfma", "-fopenmp", str(source), "-o", str(binary)], check=True)
        out = {}
        for k in range(max_divisions + 1):  # the fastest of three runs, the least disturbed
            runs = [subprocess.run([str(binary), str(k), str(elements)], capture_output=True, text=True, check=True) for _ in range(3)]
            out[k] = min(float(r.stdout.split()[0]) for r in runs)
        return out


def measure(args, isa: str) -> dict:
    """Every part, in this process, as it runs here (``isa`` names the divider loop to run)."""
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"-- {isa}: torch's kernels {capability}, fused kernel flags {' '.join(kernel_build.flags())}, {torch.get_num_threads()} threads")
    results = {"isa": isa, "torch_capability": capability, "adamw_ns": {}, "divider_s": None}
    for n, steps in [(IN_CACHE, 300), (args.dram_elements, 7)]:
        ns = fused_adamw_ns_per_element(n, steps)
        results["adamw_ns"][n] = ns
        print(f"fused AdamW, {n:>11,} elements ({16 * n / 2**20:,.0f} MiB of p, g, m, v): {ns:.3f} ns/element")
    results["copy_gb_s"] = copy_gb_per_s(args.dram_elements)
    print(f"copy of {4 * args.dram_elements / 2**20:,.0f} MiB: {results['copy_gb_s']:.1f} GB/s (read + write)")
    results["divider_s"] = divider_seconds(isa, args.elements, args.max_divisions)
    if results["divider_s"] is None:
        print(f"{isa} divider loop skipped: it needs {isa} and a C compiler")
    else:
        for k, seconds in results["divider_s"].items():
            print(f"{isa}: 1 sqrt + {k} divisions per element, {args.elements:,} elements: {seconds:.4f} s")
    results["kernel_ns"], results["kernel_optimizer"], results["kernel_param_update"] = {}, args.optimizer, args.param_update
    if fused_cpu.library() is None:
        print("fused kernel skipped: it cannot be built here")
        return results
    for state_format in args.formats.split(","):
        sizes = {n: kernel_ns_per_element(state_format, n, steps, args.optimizer, args.param_update) for n, steps in [(IN_CACHE, 300), (args.dram_elements, 7)]}
        results["kernel_ns"][state_format] = sizes
        cache, dram = sizes.values()
        weights = "fp32 weights" if args.param_update is None else f"bf16 weights, {args.param_update}"
        print(f"fused kernel, {args.optimizer}, {weights}, {state_format:>17}: {cache:.3f} ns/element in cache, {dram:.3f} from DRAM")
    results["stage_ns"] = stage_ns_per_element(args.stages_format, reps=args.stages_reps)
    if results["stage_ns"]:
        stages = ", ".join(f"{name} {ns:.3f}" for name, ns in results["stage_ns"].items())
        print(f"stages of {args.stages_format} states (1024 values in L1), ns/element: {stages}")
    return results


def measure_avx2_in_child(argv: list[str]) -> dict | None:
    """measure(..., "avx2") in a child process with torch forced to AVX2 (ATEN_CPU_CAPABILITY is
    read when torch loads) and the fused kernel built without AVX-512."""
    if "avx2" not in cpu_flags():
        print("-- avx2 skipped: this CPU has no AVX2")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "avx2.json"
        env = {**os.environ, **as_avx2.environment()}
        subprocess.run([sys.executable, __file__, *argv, "--isa", "avx2", "--child-json", str(out)], env=env, check=True)
        results = json.loads(out.read_text())
    # JSON keys are strings: back to the element counts and division counts they were
    results["adamw_ns"] = {int(k): v for k, v in results["adamw_ns"].items()}
    results["kernel_ns"] = {f: {int(k): v for k, v in sizes.items()} for f, sizes in results["kernel_ns"].items()}
    results["divider_s"] = {int(k): v for k, v in results["divider_s"].items()} if results["divider_s"] else None
    return results


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, default=124_439_808, help="elements of the divider loop (GPT-2 small)")
    p.add_argument("--dram-elements", type=int, default=2**27, help="a parameter far larger than the caches")
    p.add_argument("--max-divisions", type=int, default=5)
    p.add_argument("--formats", default="fp32,bf16,8bit,fp8,4bit-uncalibrated,4bit-calibrated,4bit", help="kernel formats of part 4")
    p.add_argument("--optimizer", default="adamw", choices=sorted(KERNEL_OPTIMIZERS), help="lowbit_optim optimizer of part 4")
    p.add_argument("--param-update", default=None, choices=("nearest", "int8-correction"), help="part 4 with bf16 weights, updated so (default: fp32 weights)")
    p.add_argument("--stages-format", default="4bit", help="state format of part 5")
    p.add_argument("--stages-reps", type=int, default=20000, help="repetitions of each stage per round in part 5")
    p.add_argument("--isa", default="native", help="native, avx2 or both (comma-separated): see the module's doc")
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)  # the avx2 child writes its results here
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    isas = args.isa.split(",")
    if args.dram_elements <= 1024 or args.dram_elements == IN_CACHE:  # a size less 1024 elements' step: times per element
        p.error(f"--dram-elements must be more than 1024 and another size than the in-cache one ({IN_CACHE:,}), got {args.dram_elements:,}")
    if set(isas) - {"native", "avx2"}:
        p.error(f"--isa takes native and avx2, got {args.isa!r}")
    if args.child_json:  # the child: measure as an AVX2 CPU would, and hand the results back
        as_avx2.build_kernel_without_avx512()
        pathlib.Path(args.child_json).write_text(json.dumps(measure(args, "avx2")))
        return {}
    results: dict = {}
    if "native" in isas:
        results = measure(args, "avx512" if "avx512f" in cpu_flags() else "avx2")
    if "avx2" in isas:
        results["avx2"] = measure_avx2_in_child(_without_isa(argv))
    return results


def _without_isa(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--isa":
            skip = True
        elif not a.startswith("--isa="):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
