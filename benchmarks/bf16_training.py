"""Pure-bf16 training against fp32: memory per parameter and final loss of each param-update mode.

Trains the char GPT of examples/train_char_gpt.py with:

- fp32 AdamW (fp32 weights and states), the reference;
- bf16 autocast + fp32 master weights (the usual mixed precision), with quantized states;
- pure bf16 weights and gradients, with each ``param_update`` mode: nearest, stochastic, Kahan with a
  bf16 and an fp32 compensation buffer, int8 correction (24-bit master weights);

each low-precision variant with 8-bit and 4-bit optimizer states. Memory counts what training holds
per parameter: weight + gradient + optimizer state (moments, Kahan buffer or int8 correction).

    python benchmarks/bf16_training.py                       # defaults: ~10 minutes on 2 CPU cores
    python benchmarks/bf16_training.py --steps 100 --lr 1e-4 # smaller learning rate: bf16 stalls more
"""

import argparse
import contextlib
import pathlib
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from train_char_gpt import GPT, CharDataset, get_batch, load_text  # noqa: E402

import lowbit_optim  # noqa: E402


@dataclass
class Config:
    label: str
    param_dtype: torch.dtype = torch.bfloat16
    autocast: bool = False  # bf16 compute with fp32 weights (the weights are the master copy)
    optimizer_options: dict = field(default_factory=dict)


def configs() -> list[Config]:
    out = [Config("fp32 AdamW", torch.float32, optimizer_options={"state_format": "fp32"})]
    for states in ("8bit", "4bit"):
        out.append(Config(f"bf16 autocast + fp32 master, {states}", torch.float32, True, {"state_format": states}))
        for label, options in [
            ("nearest", {"param_update": "nearest"}),
            ("stochastic", {"param_update": "stochastic"}),
            ("Kahan, bf16 buffer", {"param_update": "kahan", "compensation_format": "bf16"}),
            ("Kahan, fp32 buffer", {"param_update": "kahan", "compensation_format": "fp32"}),
            ("24-bit (bf16 + int8)", {"param_update": "int8-correction"}),
        ]:
            out.append(Config(f"pure bf16 {label}, {states}", optimizer_options={"state_format": states, **options}))
    return out


def run(config: Config, dataset: CharDataset, args) -> dict:
    torch.manual_seed(args.seed)
    model = GPT(dataset.vocab_size, args.block_size, args.layers, args.d_model, args.heads).to(config.param_dtype)
    opt = lowbit_optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1, **config.optimizer_options)
    generator = torch.Generator().manual_seed(args.seed)
    autocast = torch.autocast("cpu", torch.bfloat16) if config.autocast else contextlib.nullcontext()
    start = time.perf_counter()
    for _ in range(args.steps):
        with autocast:
            _, loss = model(*get_batch(dataset.train, args.batch_size, args.block_size, generator))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - start
    val_loss = evaluate(model, dataset, args, autocast)
    n = sum(p.numel() for p in model.parameters())
    weight_and_grad = 2 * torch.finfo(config.param_dtype).bits / 8
    return {
        "label": config.label,
        "bytes_per_param": weight_and_grad + lowbit_optim.bytes_per_param(opt),
        "state_bytes_per_param": lowbit_optim.bytes_per_param(opt),
        "val_loss": val_loss,
        "seconds": seconds,
        "params": n,
    }


@torch.no_grad()
def evaluate(model, dataset, args, autocast) -> float:
    generator = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(args.eval_batches):
        with autocast:
            losses.append(model(*get_batch(dataset.val, args.batch_size, args.block_size, generator))[1].float().item())
    return sum(losses) / len(losses)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="comma-separated substrings: run the configurations whose label contains one")
    args = p.parse_args(argv)
    dataset = CharDataset(load_text())
    chosen = [c for c in configs() if not args.only or any(s in c.label for s in args.only.split(","))]
    rows = []
    for config in chosen:
        rows.append(run(config, dataset, args))
        r = rows[-1]
        print(f"{r['label']:<44} {r['bytes_per_param']:6.2f} B/param  val loss {r['val_loss']:.4f}  {r['seconds']:.0f} s", flush=True)
    reference = rows[0]["val_loss"] if chosen[0].label == "fp32 AdamW" else None
    print(f"\n{rows[0]['params']:,} params, {args.steps} steps, lr {args.lr}\n")
    print("| training | bytes/param (weight+grad+state) | state bytes/param | val loss | vs fp32 AdamW |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        gap = f"{(r['val_loss'] / reference - 1) * 100:+.2f}%" if reference else "-"
        print(f"| {r['label']} | {r['bytes_per_param']:.2f} | {r['state_bytes_per_param']:.2f} | {r['val_loss']:.4f} | {gap} |")
    return rows


if __name__ == "__main__":
    main()
