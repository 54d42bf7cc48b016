"""Optimizer step time and state memory on the GPT-2-small parameter set, every optimizer in one process.

``--optimizer sgd|lion|ademamix`` times that optimizer instead of AdamW: lowbit_optim's version with
fp32, 8bit, 8bit-linear, 8bit-lowrank and 4bit state beside bitsandbytes' 8-bit and 32-bit versions, and for SGD
``torch.optim.SGD`` (foreach and ``fused=True``, the reference of the ratios); Lion and AdEMAMix,
which torch lacks, are timed against bitsandbytes' 32-bit version; ``lowbit-8bit-lowrank-compiled`` (and
AdEMAMix's ``lowbit-all-8bit-compiled``) step the low-rank rows with ``fused=False``. ``--optimizer muon`` steps the
blocks' 2-D matrices only (Muon's part of the usual recipe) with ``torch.optim.Muon`` (the reference)
and lowbit_optim's Muon with fp32, 8bit, 8bit-linear, 8bit-lowrank, 4bit and 4bit-lowrank-mulaw momentum (on the CPU the momentum in
the fused kernel; the ``-compiled`` rows in the compiled step), and times the Newton-Schulz iterations
alone (``newton-schulz``: the compiled iterations on every matrix, no momentum, no update), the part
of a Muon step that no state format changes. Hyper-parameters: SGD lr 1e-3,
momentum 0.9; Lion and AdEMAMix their defaults. A lowbit_optim optimizer whose states the fused CPU
kernel does not step says so in the note column ("compiled step", with the reason).

Compares torch.optim.AdamW (foreach, fused), torchao's AdamW8bit / AdamW4bit / AdamWFp8, bitsandbytes'
AdamW8bit and ``lowbit_optim.AdamW`` with every registered state format (on the CPU by default through
the fused CPU kernel, on a GPU in foreach chunks; ``lowbit-8bit-compiled`` and ``lowbit-4bit-compiled``
run the generic torch.compile'd step per parameter instead, ``fused=False, foreach=False``;
``lowbit-{fp32,8bit,4bit}-foreach`` that step with a group's parameters traced together,
``foreach=True``: a few graph calls per step instead of one or more per parameter, which is what a
GPU's step time is made of, and there the default). There is no forward pass: the
parameters get fixed random gradients once, and each optimizer in turn steps them. Optimizers run one
after another (the previous one freed) in one process: read the ratios between rows, not absolute
times. On a shared machine other load still shifts rows unevenly; the JSON keeps every step's time
(the minimum is the least disturbed) and a repeated run with ``--only`` settles a doubtful row.
``--interleave`` builds every optimizer first and steps them in turn, one step each per round, so that
a passing load falls on every row alike (the optimizers then coexist: no peak-memory figure).

Columns:
  first s      the first step: state allocation plus torch.compile (torchao, lowbit -compiled rows and
               non-CPU devices) or building the fused CPU kernel (lowbit on the CPU, once per machine)
  median s     median of ``--steps`` steps after ``--warmup`` untimed ones
  vs fused     median step / torch AdamW(fused=True)'s median step
  state B/p    optimizer-state bytes per parameter (unique storages, incl. scales, codebooks, steps)
  floor B/p    bytes one step must move per parameter: param read+write, grad read, state read+write
  GB/s         floor B/p * parameters / median step: achieved bandwidth against that floor
  peak MiB     peak resident (CPU) or allocated (CUDA) memory above the level before the optimizer

``--profile DIR`` also profiles PROFILE_STEPS steps of each row (torch.profiler) after its timed ones: the
note gets its compiled calls, kernel launches and device-busy time per step (on a GPU a step that
launches many kernels is bound by their host time, not by the GPU), and DIR a table of its ops by
host time.

Examples::

    python benchmarks/step_time.py                                    # GPT-2 small, fp32 params
    python benchmarks/step_time.py --layers 2 --vocab 5000 --steps 3  # quick check
    python benchmarks/step_time.py --only torch-fused,lowbit-8bit,torchao-8bit --json out.json
    python benchmarks/step_time.py --optimizer lion                   # Lion: lowbit fp32/8bit/4bit, bitsandbytes 8/32-bit
    python benchmarks/step_time.py --optimizer muon --layers 2        # Muon on the blocks' matrices
    python benchmarks/step_time.py --device cuda --profile prof --inductor combo_kernels=True  # fewer launches?

Cold and warm compile (the "first s" column). Within one process, later rows may reuse graphs an
earlier row compiled (lowbit's fp32 graph serves every format's small parameters), so run the rows you
care about alone with ``--only``. Then, two runs:

    rm -rf /tmp/inductor-cache
    python benchmarks/step_time.py --only lowbit-8bit --cache-dir /tmp/inductor-cache   # cold: empty cache
    python benchmarks/step_time.py --only lowbit-8bit --cache-dir /tmp/inductor-cache   # warm: same cache

``--cache-dir`` sets TORCHINDUCTOR_CACHE_DIR before torch is imported; without it the environment
(and inductor's default per-user cache, usually already warm) is left alone.
"""

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (GPT-2 small: 12)")
    parser.add_argument("--d", type=int, default=768, help="model width (GPT-2 small: 768)")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size (GPT-2: 50257)")
    parser.add_argument("--ctx", type=int, default=1024, help="context length / position embeddings (GPT-2: 1024)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="parameter and gradient dtype")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--steps", type=int, default=10, help="timed steady-state steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first one")
    parser.add_argument("--optimizer", choices=("adamw", "sgd", "lion", "ademamix", "muon"), default="adamw", help="which optimizer's rows")
    parser.add_argument("--only", default=None, help="comma-separated optimizer labels to run (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None, help="set TORCHINDUCTOR_CACHE_DIR (empty dir: cold compile)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE", help="set torch._inductor.config.KEY (repeatable; a Python literal), e.g. combo_kernels=True")
    parser.add_argument("--profile", default=None, metavar="DIR", help="profile each row's steps: calls, launches and device time in the note; op tables in DIR")
    parser.add_argument("--interleave", action="store_true", help="build every optimizer, then step them in turn (rounds): no peak-memory column")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native", help="avx2: as an AVX2 + FMA CPU would run, on this one (benchmarks/as_avx2.py)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


sys.path.insert(0, str(Path(__file__).resolve().parent))
import as_avx2  # noqa: E402

if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.isa == "avx2":
        as_avx2.reexec()  # before `import torch`, which reads the capability once
    if ARGS.cache_dir:
        # before `import torch`, so every inductor / AOT cache lookup in this process sees it
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(ARGS.cache_dir)

import torch  # noqa: E402  (after --cache-dir)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # noqa: E402

# this checkout's lowbit_optim, installed or not, as the other benchmarks take it: an installed one
# (another checkout's editable install) would be timed in its place
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lowbit_optim  # noqa: E402
from lowbit_optim import kernel_build  # noqa: E402
from lowbit_optim.formats import paired_label, paired_state_format  # noqa: E402

REFERENCE = "torch-fused"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------------------------
# The parameter set
# ------------------------------------------------------------------------------------------------


def gpt2_shapes(layers: int, d: int, vocab: int, ctx: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of GPT-2's parameters (HF layout: Conv1D weights are (in, out))."""
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(layers):
        block = {
            "ln_1.weight": (d,),
            "ln_1.bias": (d,),
            "attn.c_attn.weight": (d, 3 * d),
            "attn.c_attn.bias": (3 * d,),
            "attn.c_proj.weight": (d, d),
            "attn.c_proj.bias": (d,),
            "ln_2.weight": (d,),
            "ln_2.bias": (d,),
            "mlp.c_fc.weight": (d, 4 * d),
            "mlp.c_fc.bias": (4 * d,),
            "mlp.c_proj.weight": (4 * d, d),
            "mlp.c_proj.bias": (d,),
        }
        shapes += [(f"h.{i}.{name}", shape) for name, shape in block.items()]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def build_params(shapes, dtype: torch.dtype, device: torch.device, seed: int) -> list[torch.nn.Parameter]:
    """Parameters with fixed random gradients, set once: every optimizer steps the same gradients."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for _, shape in shapes:
        p = torch.nn.Parameter(0.02 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype))
        p.grad = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        params.append(p)
    return params


# ------------------------------------------------------------------------------------------------
# The optimizers: (label, factory) pairs; third-party imports happen inside the factory, so a library
# that is missing or fails on this device only skips its rows
# ------------------------------------------------------------------------------------------------


def _torchao(class_name: str):
    def make(params):
        import torchao.optim

        return getattr(torchao.optim, class_name)(params, lr=1e-3)

    return make


def _bnb_adamw8bit(params):
    import bitsandbytes.optim

    return bitsandbytes.optim.AdamW8bit(params, lr=1e-3)


def _lowbit(state_format: str, **kwargs):
    return lambda params: lowbit_optim.AdamW(params, lr=1e-3, state_format=state_format, **kwargs)


# --optimizer: lowbit_optim's class and keywords, bitsandbytes' 8-bit and 32-bit classes (name, keywords)
OTHER_OPTIMIZERS = {
    "sgd": ("SGD", dict(lr=1e-3, momentum=0.9), ("SGD8bit", {}), ("SGD32bit", {})),
    "lion": ("Lion", dict(lr=1e-4), ("Lion8bit", {}), ("Lion32bit", {})),
    "ademamix": ("AdEMAMix", dict(lr=1e-3), ("AdEMAMix8bit", {}), ("AdEMAMix", dict(optim_bits=32))),
}
# each --optimizer's reference row (the "vs ref" column): torch's fused step where torch has the optimizer
REFERENCES = {"adamw": REFERENCE, "sgd": "torch-sgd-fused", "lion": "bnb-32bit", "ademamix": "bnb-32bit", "muon": "torch-muon"}


def _bnb(name: str, kwargs: dict):
    def make(params):
        import bitsandbytes.optim

        return getattr(bitsandbytes.optim, name)(params, **kwargs)

    return make


def other_optimizer_factories(optimizer: str) -> list[tuple[str, Callable]]:
    """``--optimizer``'s rows: torch's (SGD), bitsandbytes' 32-bit and 8-bit versions, lowbit_optim's."""
    name, kwargs, (bnb8, extra8), (bnb32, extra32) = OTHER_OPTIMIZERS[optimizer]
    cls = getattr(lowbit_optim, name)
    rows = []
    if optimizer == "sgd":
        rows += [
            ("torch-sgd-foreach", lambda params: torch.optim.SGD(params, **kwargs, foreach=True)),
            ("torch-sgd-fused", lambda params: torch.optim.SGD(params, **kwargs, fused=True)),
        ]
    rows += [("bnb-32bit", _bnb(bnb32, {**kwargs, **extra32})), ("bnb-8bit", _bnb(bnb8, {**kwargs, **extra8}))]
    rows += [(f"lowbit-{f}", lambda params, f=f: cls(params, **kwargs, state_format=f)) for f in ("fp32", "8bit", "8bit-linear", "8bit-lowrank", "4bit")]
    # the low-rank momentum in the compiled step (fused=False), as on a GPU
    rows += [("lowbit-8bit-lowrank-compiled", lambda params: cls(params, **kwargs, state_format="8bit-lowrank", fused=False))]
    if optimizer == "ademamix":  # the MLP task's recipes (README, "AdEMAMix state by state")
        recipes = {
            "lowbit-recipe": {"exp_avg": "8bit-linear", "exp_avg_slow": "10bit-sr", "exp_avg_sq": "10bit-sr"},
            "lowbit-recipe-bf16-sr-second": {"exp_avg": "8bit-linear", "exp_avg_slow": "10bit-sr", "exp_avg_sq": "bf16-sr"},
            "lowbit-bf16-sr-slow": {"exp_avg": "8bit-linear", "exp_avg_slow": "bf16-sr", "exp_avg_sq": "bf16-sr"},
            "lowbit-lowrank-slow": {"exp_avg": "8bit-linear", "exp_avg_slow": "8bit-lowrank", "exp_avg_sq": "bf16-sr"},
            "lowbit-recipe-8bit-log-second": {"exp_avg": "8bit-linear", "exp_avg_slow": "10bit-sr", "exp_avg_sq": "8bit-log"},
            "lowbit-all-8bit": {"exp_avg": "8bit-linear", "exp_avg_slow": "8bit-lowrank", "exp_avg_sq": "8bit-log"},
        }
        rows += [(label, lambda params, f=f: cls(params, **kwargs, state_format=f)) for label, f in recipes.items()]
        rows += [("lowbit-all-8bit-compiled", lambda params: cls(params, **kwargs, state_format=recipes["lowbit-all-8bit"], fused=False))]
    return rows


class NewtonSchulzOnly(torch.optim.Optimizer):
    """The Newton-Schulz iterations of lowbit_optim's Muon step on every gradient, compiled as that
    step compiles them, and nothing else: their share of a Muon step."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.0))
        iterate = lowbit_optim.base.compiled_step(lowbit_optim.functional.newton_schulz)
        self.orthogonalize = lambda g: iterate(g, (3.4445, -4.775, 2.0315), 5, torch.tensor(1e-7))  # torch.optim.Muon's defaults

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                self.orthogonalize(p.grad)


def muon_factories() -> list[tuple[str, Callable]]:
    def muon(state_format: str, fused: bool | None = None):
        return lambda params: lowbit_optim.Muon(params, lr=1e-3, state_format=state_format, fused=fused)

    return [
        ("torch-muon", lambda params: torch.optim.Muon(params, lr=1e-3)),
        *[(f"lowbit-{f}", muon(f)) for f in ("fp32", "8bit", "8bit-linear", "8bit-lowrank", "4bit", "4bit-lowrank-mulaw")],
        # the momentum in the compiled step, as on a GPU, rather than in the fused CPU kernel
        *[(f"lowbit-{f}-compiled", muon(f, fused=False)) for f in ("8bit", "8bit-lowrank", "4bit")],
        ("newton-schulz", NewtonSchulzOnly),
    ]


def optimizer_factories(optimizer: str = "adamw") -> list[tuple[str, Callable]]:
    if optimizer == "muon":
        return muon_factories()
    if optimizer != "adamw":
        return other_optimizer_factories(optimizer)
    return [
        ("torch-foreach", lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True)),
        (REFERENCE, lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True)),
        ("torchao-8bit", _torchao("AdamW8bit")),
        ("torchao-4bit", _torchao("AdamW4bit")),
        ("torchao-fp8", _torchao("AdamWFp8")),
        ("bnb-8bit", _bnb_adamw8bit),
        *[(f"lowbit-{paired_label(name)}", _lowbit(paired_state_format(name))) for name in lowbit_optim.registered_formats()],
        # the MLP task's 8-bit recipe (README, Optimizers x formats: accuracy)
        ("lowbit-8bit+sr-second", _lowbit({"exp_avg": "8bit", "exp_avg_sq": "8bit-sr"})),
        ("lowbit-8bit-linear+log-second", _lowbit({"exp_avg": "8bit-linear", "exp_avg_sq": "8bit-log"})),
        # the generic compiled step per parameter, which the fused CPU kernel stands in for (and GPUs ran before foreach)
        *[(f"lowbit-{name}-compiled", _lowbit(name, fused=False, foreach=False)) for name in ("8bit", "4bit", "8bit-log")],
        # the compiled step with a group's parameters in a few graphs (foreach): fewer calls and launches
        *[(f"lowbit-{name}-foreach", _lowbit(name, fused=False, foreach=True)) for name in ("fp32", "8bit", "4bit")],
    ]


def select(factories, only: str | None):
    if not only:
        return factories
    wanted = [label.strip() for label in only.split(",") if label.strip()]
    known = [label for label, _ in factories]
    unknown = [label for label in wanted if label not in known]
    if unknown:
        raise SystemExit(f"unknown optimizer label(s) {unknown}; choose from {known}")
    return [(label, make) for label, make in factories if label in wanted]


# ------------------------------------------------------------------------------------------------
# What is measured
# ------------------------------------------------------------------------------------------------


def _storages_of(value, storages: dict) -> None:
    """Collect the storages behind ``value``, looking inside tensor subclasses (torchao's codes, scale,
    qmap) recursively. Keyed by data pointer, so shared tensors (bnb's qmaps) count once."""
    if not isinstance(value, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        for name in names:
            _storages_of(getattr(value, name), storages)
        return
    storage = value.untyped_storage()
    storages[(value.device, storage.data_ptr())] = storage.nbytes()


def state_bytes_per_param(optimizer: torch.optim.Optimizer, numel: int) -> float:
    if isinstance(optimizer, lowbit_optim.LowBitOptimizer):
        return lowbit_optim.bytes_per_param(optimizer)
    storages: dict = {}
    for state in optimizer.state.values():
        for value in state.values():
            _storages_of(value, storages)
    return sum(storages.values()) / numel


def floor_bytes_per_param(param_bytes: int, state_bytes: float) -> float:
    """Minimum traffic of one step: param read + write, grad read, every state byte read + written."""
    return 3 * param_bytes + 2 * state_bytes


def _release_freed_memory() -> None:
    # glibc keeps freed heap pages resident; returning them makes the next baseline (and delta) honest
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory above a baseline: CUDA allocator stats, or on Linux the process's peak RSS, which
    /proc/self/clear_refs can reset. Elsewhere ru_maxrss, which never resets (then only growth beyond
    the earlier peak shows)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = 0

    @staticmethod
    def _proc_status_kib(field: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1])
        except OSError:
            pass
        return None

    def reset(self) -> None:
        _release_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.baseline = self._proc_status_kib("VmRSS") * 1024
        except (OSError, TypeError):
            self.baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def peak_delta(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        hwm = self._proc_status_kib("VmHWM")
        peak = hwm * 1024 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(peak - self.baseline, 0)


def timed_step(optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@dataclasses.dataclass
class Result:
    label: str
    first_step_s: float | None = None
    median_step_s: float | None = None
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    state_bytes_per_param: float | None = None
    floor_bytes_per_param: float | None = None
    floor_gb_per_s: float | None = None
    peak_mem_delta_bytes: int | None = None
    ratio_to_reference: float | None = None  # median step / the reference's (environment()'s "reference")
    compiled_calls_per_step: float | None = None  # --profile
    launches_per_step: float | None = None
    device_busy_s: float | None = None
    note: str = ""


def measure(label: str, make: Callable, params, args, device: torch.device) -> Result:
    """One optimizer: first step, warmup, timed steps, state size. The optimizer is freed on return."""
    result = Result(label)
    memory = PeakMemory(device)
    memory.reset()
    try:
        optimizer = make(params)
        result.first_step_s = timed_step(optimizer, device)
        for _ in range(args.warmup):
            timed_step(optimizer, device)
        result.step_times_s = [timed_step(optimizer, device) for _ in range(args.steps)]
    except Exception as exc:  # e.g. bnb / torchao unsupported on this device: one row says so, the rest run
        skipped(result, exc)
        return result
    summarize(result, optimizer, params, device)
    result.peak_mem_delta_bytes = memory.peak_delta()
    if args.profile:
        profile(result, optimizer, device, Path(args.profile))
    return result


PROFILE_STEPS = 2
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel")  # name prefixes: the runtime's and the driver's (Triton), Ex variants too
GRAPH_LAUNCHES = "cudaGraphLaunch"  # a CUDA graph's replay: one launch of many kernels


def profile(result: Result, optimizer: torch.optim.Optimizer, device: torch.device, out: Path) -> None:
    """PROFILE_STEPS steps under torch.profiler: per step, the compiled regions entered, the kernels
    launched and the time the device was busy (into ``result``), and a table of the ops by host time
    (into ``out``)."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            timed_step(optimizer, device)
    events = prof.key_averages()
    per_step = lambda count: count / PROFILE_STEPS  # noqa: E731
    result.compiled_calls_per_step = per_step(sum(e.count for e in events if e.key.startswith("Torch-Compiled Region")))
    result.launches_per_step = per_step(sum(e.count for e in events if e.key.startswith(LAUNCHES)))
    graph_launches = per_step(sum(e.count for e in events if e.key.startswith(GRAPH_LAUNCHES)))
    # the device's own work: not the ranges (Optimizer.step#...) that the profiler copies onto its timeline
    device_work = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    result.device_busy_s = per_step(sum(e.self_device_time_total for e in device_work)) / 1e6
    profiled = f"{result.compiled_calls_per_step:.0f} compiled calls, {result.launches_per_step:.0f} launches"
    profiled += f" ({graph_launches:.0f} CUDA graph replays)" if graph_launches else ""
    profiled += f", device busy {result.device_busy_s * 1e3:.2f} ms per step"
    if device.type == "cuda" and not (result.launches_per_step or graph_launches):
        profiled += " (no launch seen: the profiler's names may have changed)"
    result.note = "; ".join(n for n in (result.note, profiled) if n)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{result.label}.txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))


def measure_interleaved(factories: list[tuple[str, Callable]], params, args, device: torch.device) -> list[Result]:
    """``--interleave``: every optimizer built at once, then stepped in turn, one step each per round,
    so that a load coming and going on a shared machine falls on every row alike. The optimizers
    coexist, so there is no peak-memory column."""
    results, optimizers = [], []
    for label, make in factories:
        result, optimizer = Result(label), None
        try:
            optimizer = make(params)
            result.first_step_s = timed_step(optimizer, device)
            for _ in range(args.warmup):
                timed_step(optimizer, device)
        except Exception as exc:
            skipped(result, exc)
            optimizer = None
        results.append(result)
        optimizers.append(optimizer)
    for _ in range(args.steps):
        for result, optimizer in zip(results, optimizers):
            if optimizer is not None:
                result.step_times_s.append(timed_step(optimizer, device))
    for result, optimizer in zip(results, optimizers):
        if optimizer is not None:
            summarize(result, optimizer, params, device)
            if args.profile:
                profile(result, optimizer, device, Path(args.profile))
    return results


def skipped(result: Result, exc: Exception) -> None:
    traceback.print_exc(file=sys.stderr)
    message = (str(exc).splitlines() or [""])[0][:120]
    result.note = f"skipped: {type(exc).__name__}: {message}"


def summarize(result: Result, optimizer: torch.optim.Optimizer, params, device: torch.device) -> None:
    """The row's figures from its timed steps and its optimizer's state."""
    numel = sum(p.numel() for p in params)
    result.median_step_s = statistics.median(result.step_times_s)
    result.state_bytes_per_param = state_bytes_per_param(optimizer, numel)
    result.floor_bytes_per_param = floor_bytes_per_param(params[0].element_size(), result.state_bytes_per_param)
    result.floor_gb_per_s = result.floor_bytes_per_param * numel / result.median_step_s / 1e9
    if isinstance(optimizer, lowbit_optim.LowBitOptimizer) and device.type == "cpu":
        result.note = stepper_note(optimizer)


def stepper_note(optimizer: lowbit_optim.LowBitOptimizer) -> str:
    """Where a lowbit_optim optimizer on the CPU did not take the fused kernel, and why."""
    if optimizer._fused_step is None:
        return "compiled step (the fused CPU kernel does not step it)"
    refusals = {reason for _, _, reason in optimizer.__dict__.get("_kernel_verdicts", {}).values() if reason}
    return f"compiled step ({'; '.join(sorted(refusals))})" if refusals else ""


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------

COLUMNS = ["optimizer", "first s", "median s", "vs fused", "state B/p", "floor B/p", "GB/s", "peak MiB", "note"]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def row_cells(r: Result) -> list[str]:
    peak = None if r.peak_mem_delta_bytes is None else r.peak_mem_delta_bytes / 2**20
    return [
        r.label,
        _fmt(r.first_step_s, ".3f"),
        _fmt(r.median_step_s, ".4f"),
        _fmt(r.ratio_to_reference, ".2f"),
        _fmt(r.state_bytes_per_param, ".3f"),
        _fmt(r.floor_bytes_per_param, ".2f"),
        _fmt(r.floor_gb_per_s, ".2f"),
        _fmt(peak, ".0f"),
        r.note,
    ]


def progress_line(cells: list[str]) -> str:
    # the label column fits the longest row label (lowbit-4bit-lowrank-mulaw)
    return f"{cells[0]:<26}" + "".join(f"{c:>11}" for c in cells[1:-1]) + (f"  {cells[-1]}" if cells[-1] else "")


def columns(optimizer: str) -> list[str]:
    """COLUMNS, with "vs ref" for "vs fused" where the reference is not torch's fused AdamW."""
    return COLUMNS if optimizer == "adamw" else [("vs ref" if c == "vs fused" else c) for c in COLUMNS]


def markdown_table(results: list[Result], optimizer: str = "adamw") -> str:
    align = ["---"] + ["---:"] * (len(COLUMNS) - 2) + ["---"]  # numbers right-aligned
    lines = ["| " + " | ".join(columns(optimizer)) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in results]
    return "\n".join(lines)


def add_ratios(results: list[Result], reference_label: str = REFERENCE) -> None:
    reference = next((r.median_step_s for r in results if r.label == reference_label), None)
    for r in results:
        if reference and r.median_step_s is not None:
            r.ratio_to_reference = r.median_step_s / reference


def set_inductor_config(items: list[str]) -> dict:
    """``--inductor KEY=VALUE`` items set on torch._inductor.config (dotted keys reach its
    sub-configs: triton.cudagraphs=True); an unknown key or a value that is not a Python literal
    stops the run. Returns what was set."""
    import ast

    import torch._inductor.config as inductor_config

    settings, defaults = {}, inductor_config.get_config_copy()  # every option by its dotted name
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in defaults:
            raise SystemExit(f"--inductor {item}: torch._inductor.config has no option {key!r} (write KEY=VALUE)")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--inductor {item}: write KEY=VALUE with a Python literal for VALUE (True, 2, 'name')") from None
        default = defaults[key]
        if default is not None and not isinstance(value, type(default)):
            raise SystemExit(f"--inductor {item}: {key} takes a {type(default).__name__} (default {default!r}), not {value!r}")
        *parents, name = key.split(".")
        owner = inductor_config
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, name, value)
        settings[key] = value
    return settings


def environment(args, shapes, numel: int, device: torch.device) -> dict:
    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for module in ("torchao", "bitsandbytes"):
        try:
            versions[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - absent or broken: recorded, not fatal
            versions[module] = None
    return {
        "config": dict(vars(args)),
        "reference": REFERENCES[args.optimizer],  # what ratio_to_reference divides by (torch's fused AdamW for AdamW)
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_flags": kernel_build.flags(),
        "torch_threads": torch.get_num_threads(),
        "num_params": numel,
        "num_tensors": len(shapes),
        "versions": versions,
        "torchinductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }


def main(args: argparse.Namespace) -> list[Result]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    if args.isa == "avx2":
        if torch.backends.cpu.get_cpu_capability() != "AVX2":
            raise SystemExit(f"--isa avx2: torch runs {torch.backends.cpu.get_cpu_capability()} kernels here (run the script itself: it restarts with {as_avx2.environment()})")
        as_avx2.build_kernel_without_avx512()
    factories = select(optimizer_factories(args.optimizer), args.only)
    inductor_settings = set_inductor_config(args.inductor)

    shapes = gpt2_shapes(args.layers, args.d, args.vocab, args.ctx)
    if args.optimizer == "muon":  # Muon steps the blocks' matrices; embeddings and vectors take AdamW
        shapes = [(name, shape) for name, shape in shapes if name.startswith("h.") and len(shape) == 2]
    params = build_params(shapes, DTYPES[args.dtype], device, args.seed)
    numel = sum(p.numel() for p in params)
    env = environment(args, shapes, numel, device)
    print(
        f"{numel:,} parameters in {len(shapes)} tensors ({args.dtype}) on {env['device']} ({env['torch_cpu_capability']} torch kernels"
        f"{', fused kernel without AVX-512' if args.isa == 'avx2' else ''}); "
        f"torch {torch.__version__}, {env['torch_threads']} threads; "
        f"{args.warmup} warmup + {args.steps} timed steps{' (interleaved)' if args.interleave else ''}; {args.optimizer}, ratios to {REFERENCES[args.optimizer]}"
        f"{f'; inductor config {inductor_settings}' if inductor_settings else ''}"
    )
    print(progress_line(columns(args.optimizer)))

    if args.interleave:
        results = measure_interleaved(factories, params, args, device)
        add_ratios(results, REFERENCES[args.optimizer])
        for result in results:
            print(progress_line(row_cells(result)), flush=True)
    else:
        results = []
        for label, make in factories:
            result = measure(label, make, params, args, device)
            results.append(result)
            _release_freed_memory()  # the optimizer is gone with measure()'s frame; drop its state now
            add_ratios(results, REFERENCES[args.optimizer])
            print(progress_line(row_cells(result)), flush=True)

    print()
    print(markdown_table(results, args.optimizer))
    if args.json:
        Path(args.json).write_text(json.dumps({**env, "results": [dataclasses.asdict(r) for r in results]}, indent=2))
    return results


if __name__ == "__main__":
    main(ARGS)
