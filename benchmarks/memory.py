"""Peak training memory per parameter, each configuration in a fresh process (issue #18).

Trains the char GPT of examples/train_char_gpt.py (``--layers`` blocks of width ``--d-model``; the
default, 4 x 2048, has 201M parameters) for a few steps with tiny batches, and reports the process's
peak resident memory above its level before the model was built: weights, gradients, optimizer
states and every transient (the step's scratch, gradients in flight). Activations are measured apart
(what autograd saves in one forward, parameters excluded) and kept small by the batch
(``--batch`` x ``--seq`` tokens); the peak includes them, so the figures are upper bounds.

Configurations (weights / gradients / states):

- ``fp32 AdamW``: torch.optim.AdamW(fused=True); fp32 / fp32 / two fp32 moments (16 bytes/param);
- ``8bit``: lowbit_optim 8bit states, fp32 weights and gradients;
- ``4bit, 24-bit weights``: bf16 weights with ``param_update="int8-correction"`` (3 bytes), bf16
  gradients, 4bit states;
- ``... step in backward``: the same with ``step_in_backward=True``: each gradient is consumed and
  freed as backward produces it;
- ``8bit, 24-bit weights, step in backward``: the recipe of FlashOptim (8-bit states, gradient release).

Columns:
  peak B/p     peak RSS above the baseline / parameters (activations and allocator slack included)
  model B/p    weights + gradients + states from their tensors' sizes (gradients: all of them, or
               none with the step in backward)
  act MiB      bytes autograd saved for backward in one forward, parameters excluded
  step s       median seconds of forward + backward + step over the steps after the first
  vs after     step s / the same configuration's stepping after backward (the cost of the step in
               backward; its target is <= 1.10)

    python benchmarks/memory.py                          # 201M parameters, ~3 minutes on 2 CPU cores
    python benchmarks/memory.py --layers 1 --d-model 512 # a quick check
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
from step_time import PeakMemory  # noqa: E402
from train_char_gpt import GPT  # noqa: E402

import lowbit_optim  # noqa: E402

VOCAB = 96  # near the char GPT's vocabulary (Python's help text: 103 characters on 3.11.7); only sizes matter here


@dataclass(frozen=True)
class Config:
    label: str
    dtype: torch.dtype = torch.float32
    state_format: str | None = None  # None: torch.optim.AdamW(fused=True)
    options: dict = field(default_factory=dict)

    @property
    def in_backward(self) -> bool:
        return self.options.get("step_in_backward", False)

    def after_backward(self) -> "Config | None":
        """The same configuration stepping after backward (the reference of ``vs after``)."""
        if not self.in_backward:
            return None
        return next(c for c in CONFIGS if c.dtype == self.dtype and c.state_format == self.state_format and not c.in_backward)


WEIGHTS_24BIT = dict(param_update="int8-correction")
CONFIGS = [
    Config("fp32 AdamW (torch, fused)"),
    Config("8bit", state_format="8bit"),
    Config("4bit, 24-bit weights", torch.bfloat16, "4bit", WEIGHTS_24BIT),
    Config("4bit, 24-bit weights, step in backward", torch.bfloat16, "4bit", {**WEIGHTS_24BIT, "step_in_backward": True}),
    Config("8bit, 24-bit weights", torch.bfloat16, "8bit", WEIGHTS_24BIT),
    Config("8bit, 24-bit weights, step in backward", torch.bfloat16, "8bit", {**WEIGHTS_24BIT, "step_in_backward": True}),
]


def measure(config: Config, args) -> dict:
    """One configuration, in this (fresh) process."""
    torch.set_num_threads(args.threads)
    lowbit_optim.fused_cpu.library()  # the kernel is loaded before the baseline
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    model = GPT.empty_then_init(VOCAB, args.seq, args.layers, args.d_model, args.heads, dtype=config.dtype)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    if config.state_format is None:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    else:
        opt = lowbit_optim.AdamW(params, lr=1e-4, state_format=config.state_format, **config.options)
    generator = torch.Generator().manual_seed(0)
    seconds, losses, activations = [], [], 0
    for step in range(args.steps):
        idx = torch.randint(VOCAB, (args.batch, args.seq + 1), generator=generator)
        start = time.perf_counter()
        with _saved_bytes(params) as saved:
            _, loss = model(idx[:, :-1], idx[:, 1:])
        activations = max(activations, saved["bytes"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = memory.peak_delta()
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = 0 if config.in_backward else weights
    states = lowbit_optim.bytes_per_param(opt) * n if config.state_format else sum(t.nbytes for s in opt.state.values() for t in s.values())
    return dict(
        params=n,
        peak_bytes_per_param=peak / n,
        model_bytes_per_param=(weights + grads + states) / n,
        activation_mib=activations / 2**20,
        step_seconds=statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0],
        losses=losses,
    )


class _saved_bytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the distinct storages autograd saves (parameters excluded)."""

    def __init__(self, params):
        own = {p.untyped_storage().data_ptr() for p in params}
        self.seen, self.result = set(), {"bytes": 0}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in own and storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                self.result["bytes"] += storage.nbytes()
            return t

        super().__init__(pack, lambda t: t)

    def __enter__(self):
        super().__enter__()
        return self.result


def run_fresh(config: Config, args) -> dict:
    """``measure`` in a new process: peaks and allocator state never carry over between rows."""
    argv = [sys.executable, __file__, "--child", config.label, *_shared_argv(args)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # large buffers mmap'd and returned when freed: RSS follows use
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _shared_argv(args) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in ("layers", "d_model", "heads", "seq", "batch", "steps", "threads")]


def table(results: dict) -> str:
    rows = ["| configuration | peak B/p | model B/p | act MiB | step s | vs after |", "|---|---:|---:|---:|---:|---:|"]
    for config in CONFIGS:
        r = results.get(config.label)
        if r is None:
            continue
        if "error" in r:
            rows.append(f"| {config.label} | failed | | | | |")
            continue
        reference = config.after_backward()
        ratio = f"{r['step_seconds'] / results[reference.label]['step_seconds']:.2f}" if reference and reference.label in results else ""
        rows.append(
            f"| {config.label} | {r['peak_bytes_per_param']:.2f} | {r['model_bytes_per_param']:.2f} | {r['activation_mib']:.1f} | "
            f"{r['step_seconds']:.3f} | {ratio} |"
        )
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=2048, help="embedding width (12 d^2 parameters per block)")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--steps", type=int, default=8, help="training steps per configuration (the first allocates the states)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads in each process")
    p.add_argument("--only", default="", help="semicolon-separated labels to run (default: all)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(next(c for c in CONFIGS if c.label == args.child), args)))
        return {}
    labels = [c.label for c in CONFIGS]
    unknown = [label for label in args.only.split(";") if label not in labels] if args.only else []
    if unknown:  # (a comma-separated list reads as one unknown label: labels hold commas)
        raise SystemExit(f"--only: unknown label(s) {unknown}; the labels, separated by ';': {labels}")
    wanted = [c for c in CONFIGS if not args.only or c.label in args.only.split(";")]
    results = {}
    for config in wanted:
        results[config.label] = run_fresh(config, args)
        r = results[config.label]
        print(f"{config.label}: " + (r["error"] if "error" in r else f"{r['peak_bytes_per_param']:.2f} B/param peak, {r['step_seconds']:.3f} s/step"), flush=True)
    n = next((r["params"] for r in results.values() if "params" in r), 0)
    print(f"\n{n / 1e6:.0f}M parameters ({args.layers} x {args.d_model}), batch {args.batch} x {args.seq} tokens, {args.threads} threads\n")
    print(table(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "configs": [asdict(c) | {"dtype": str(c.dtype)} for c in wanted]}, indent=1))
    return results


if __name__ == "__main__":
    main()
