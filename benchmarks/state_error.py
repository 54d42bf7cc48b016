"""Quantization error of real Adam moments, per state format (issue #6).

Trains the char GPT of examples/train_char_gpt.py with fp32 AdamW (``torch.optim.AdamW``, which
``lowbit_optim.AdamW(state_format="fp32")`` equals numerically; the example's schedule: betas (0.9,
0.99), weight decay 0.1, warmup + cosine decay, grad clipping) and snapshots ``exp_avg`` (m) and ``exp_avg_sq`` (v) after ``--snapshots`` steps (default 10,
100, 300). Each snapshot is quantized with every quantized registered format, exactly as the optimizer
stores it: ``fmt.from_float(x, signed, fmt.default_block_size).dequantize()``, signed for m, unsigned
for v (bf16 is shown as an unquantized reference). Only parameters the optimizer would quantize
(numel >= 4096, lowbit_optim's ``min_quantize_numel``; for torchao's formats also whole blocks, which
4bit-torchao's row may then pool fewer of) are included; their elements are pooled.

Columns (quantiles over the pooled elements):
  m rel err        |q(m) - m| / |m| over elements with m != 0
  v rel err        |q(v) - v| / v over elements with v > 0
  update rel err   |u_q - u| / |u| with u = (m / bc1) / (sqrt(v / bc2) + eps), Adam's update direction
                   (bias corrections bc1 = 1 - beta1^t, bc2 = 1 - beta2^t, eps = 1e-8), u_q the same from
                   q(m) and q(v). Restricted to elements whose fp32 update is not negligible:
                   |u| >= 0.01 * RMS(u) of the same parameter ("kept" = the fraction of elements that
                   passes). An element whose v quantizes to 0 gets u_q = m / eps: its error is counted.
  v -> 0           fraction of entries with v > 0 that quantize to exactly 0

    python benchmarks/state_error.py                 # ~2 minutes on 2 CPU cores
    python benchmarks/state_error.py --snapshots 10,50 --layers 1 --d-model 64
"""

import argparse
import math
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))  # lowbit_optim without pip install -e
from train_char_gpt import GPT, CharDataset, get_batch, load_text, lr_factor  # noqa: E402

import lowbit_optim  # noqa: E402
from lowbit_optim.formats import get_format, is_quantized, paired_label, paired_state_format  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MIN_QUANTIZE_NUMEL = 4096
EPS = 1e-8
BETAS = (0.9, 0.99)
NEGLIGIBLE = 0.01  # an update element counts if |u| >= NEGLIGIBLE * RMS(u) of its parameter


sys.path.insert(0, str(ROOT / "benchmarks"))
import custom_formats  # noqa: E402,F401  (registers "int8-linear")


def formats(only: str | None = None) -> dict:
    chosen = {name: fmt for name, fmt in lowbit_optim.registered_formats().items() if is_quantized(fmt) or name == "bf16"}
    if only:
        wanted = [s.strip() for s in only.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in chosen]
        if unknown:
            raise SystemExit(f"unknown format(s) {unknown}; choose from {list(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in wanted}
    return chosen


def capture(args) -> list[dict]:
    """Train with fp32 AdamW; at each snapshot step return {step, moments: [(name, m, v)]}."""
    snapshots = sorted({int(s) for s in args.snapshots.split(",")})
    steps = max(snapshots)
    torch.manual_seed(args.seed)
    dataset = CharDataset(load_text())
    model = GPT(dataset.vocab_size, args.block_size, args.layers, args.d_model, args.heads)
    # torch.optim.AdamW: the fp32 reference (lowbit_optim's "fp32" format equals it), with nothing to compile
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=EPS, weight_decay=0.1)
    warmup = min(100, steps // 10 + 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, steps, warmup))
    generator = torch.Generator().manual_seed(args.seed)
    names = {p: n for n, p in model.named_parameters()}
    out = []
    for step in range(1, steps + 1):
        _, loss = model(*get_batch(dataset.train, args.batch_size, args.block_size, generator))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        scheduler.step()
        if step in snapshots:
            moments = [
                (names[p], state["exp_avg"].detach().clone(), state["exp_avg_sq"].detach().clone())
                for p, state in opt.state.items()
                if p.numel() >= MIN_QUANTIZE_NUMEL
            ]
            out.append({"step": step, "loss": loss.item(), "moments": moments})
            print(f"snapshot at step {step}: train loss {loss.item():.3f}, {len(moments)} quantized parameters", flush=True)
    return out


def _quantiles(x: torch.Tensor) -> tuple[float, float, float]:
    if x.numel() == 0:
        return (math.nan,) * 3
    q = torch.quantile(x.double(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return tuple(float(v) for v in q)


def _update(m: torch.Tensor, v: torch.Tensor, step: int) -> torch.Tensor:
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    return (m / bc1) / ((v / bc2).sqrt() + EPS)


def stored_formats(name: str, shape) -> tuple:
    """The formats lowbit_optim.AdamW(state_format=name) keeps a parameter of ``shape``'s m and v in."""
    param = torch.nn.Parameter(torch.empty(shape, device="meta"))
    opt = lowbit_optim.AdamW([param], state_format=paired_state_format(name), min_quantize_numel=MIN_QUANTIZE_NUMEL)
    return tuple(opt.state_format_of(param, opt.param_groups[0], key) for key in ("exp_avg", "exp_avg_sq"))


def measure(snapshot: dict, name: str, fmt) -> dict:
    step = snapshot["step"]
    m_err, v_err, u_err = [], [], []
    v_positive = v_zeroed = kept = total = 0
    spec = paired_state_format(name)  # a second-moment-only format (factored) beside a 4bit m
    m_fmt = fmt if isinstance(spec, str) else get_format(spec["exp_avg"])
    for _, m, v in snapshot["moments"]:
        if stored_formats(name, m.shape) != (m_fmt, fmt):  # kept in fp32 (torchao's rule: not whole blocks)
            continue
        m, v = m.float(), v.float()
        qm = m_fmt.from_float(m, True, m_fmt.default_block_size)
        qv = fmt.from_float(v, False, fmt.default_block_size)
        qm = qm.dequantize(torch.float32) if isinstance(qm, lowbit_optim.StateTensor) else qm.float()
        qv = qv.dequantize(torch.float32) if isinstance(qv, lowbit_optim.StateTensor) else qv.float()
        nz = m != 0
        m_err.append(((qm - m).abs()[nz] / m.abs()[nz]).flatten())
        pos = v > 0
        v_err.append(((qv - v).abs()[pos] / v[pos]).flatten())
        v_positive += int(pos.sum())
        v_zeroed += int((pos & (qv == 0)).sum())
        u, uq = _update(m, v, step), _update(qm, qv, step)
        rms = u.pow(2).mean().sqrt()
        keep = u.abs() >= NEGLIGIBLE * rms
        kept += int(keep.sum())
        total += u.numel()
        u_err.append(((uq - u).abs()[keep] / u.abs()[keep]).flatten())
    return {
        "step": step,
        "format": paired_label(name),
        "m": _quantiles(torch.cat(m_err)),
        "v": _quantiles(torch.cat(v_err)),
        "update": _quantiles(torch.cat(u_err)),
        "kept": kept / max(total, 1),
        "v_zero": v_zeroed / max(v_positive, 1),
        "elements": total,
    }


def _fmt(q: tuple) -> str:
    return " / ".join(f"{v:.2e}" if v < 0.01 or v >= 100 else f"{v:.3f}" for v in q)


def markdown_table(rows: list[dict], args, params: int) -> str:
    lines = [
        f"Char GPT: {args.layers} layers, d_model {args.d_model}; moments of fp32 AdamW (betas {BETAS}, eps {EPS:g}, "
        f"peak lr {args.lr}) at steps {args.snapshots}, over the {params:,} elements of parameters with numel >= "
        f"{MIN_QUANTIZE_NUMEL}. Relative errors as median / p90 / p99. Update elements kept: |u| >= {NEGLIGIBLE} x "
        "RMS(u) of their parameter.",
        "",
        "| step | format | m rel err | v rel err | update rel err | update kept | v -> 0 |",
        "|---:|---|---|---|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['format']} | {_fmt(r['m'])} | {_fmt(r['v'])} | {_fmt(r['update'])} | "
            f"{100 * r['kept']:.1f}% | {100 * r['v_zero']:.3f}% |"
        )
    fewer = {r["format"]: r["elements"] for r in rows if r["elements"] != params}
    if fewer:
        lines += ["", "Pooled over fewer elements (the optimizer keeps the others' states in fp32): " + ", ".join(f"{k} {v:,}" for k, v in fewer.items()) + "."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--snapshots", default="10,100,300", help="comma-separated steps; training runs to the largest")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--formats", help="comma-separated format names (default: every quantized format, plus bf16)")
    p.add_argument("--out-md", default=str(RESULTS / "state_error.md"))
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    chosen = formats(args.formats)
    snapshots = capture(args)
    rows = [measure(snapshot, name, fmt) for snapshot in snapshots for name, fmt in chosen.items()]
    table = markdown_table(rows, args, rows[0]["elements"] if rows else 0)
    print("\n" + table)
    out = pathlib.Path(args.out_md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# Quantization error of Adam's moments and update, by state format\n\n" + table)
    print(f"total {time.perf_counter() - start:.0f} s")
    return {"rows": rows, "markdown": table}


if __name__ == "__main__":
    main()
