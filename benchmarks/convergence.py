"""Convergence of the char GPT (or, with --task mlp, an MLP classifier) under every optimizer-state format (issue #6).

Trains the char GPT of examples/train_char_gpt.py (same model, data, schedule: AdamW, betas (0.9, 0.99),
weight decay 0.1, linear warmup then cosine decay, grad-norm clipping at 1) with

- ``lowbit fp32``: ``lowbit_optim.AdamW(state_format="fp32")``, numerically torch.optim.AdamW: the
  reference every gap is measured against;
- ``torch AdamW``: ``torch.optim.AdamW`` itself, a sanity row (its gap should be ~0);
- ``lowbit <name>`` for every other format of ``lowbit_optim.registered_formats()`` (bf16, 8bit, the
  4-bit formats 4bit / 4bit-uncalibrated / nf4 / 4bit-precond / 4bit-torchao, fp8, and int8-linear
  from examples/custom_format.py, imported here); a format for second moments only (factored) runs
  beside a 4bit first moment, as ``lowbit 4bit+factored``;
- ``torchao 8bit`` / ``torchao 4bit`` / ``torchao fp8``: ``torchao.optim.AdamW8bit`` / ``AdamW4bit`` /
  ``AdamWFp8`` as torchao ships them (they quantize a parameter only if its numel is >= 4096 and a
  multiple of the block size; at d_model 128 every weight matrix qualifies, but for 8bit and fp8, whose
  256-element blocks do not divide the embedding's vocabulary × 128 elements where the vocabulary is
  odd: 103 characters of Python 3.11.7's help text).

Each optimizer trains once per seed (``--seeds 0,1,2``). A seed fixes the model initialisation and the
order of the training batches, identically for every optimizer, so gaps are paired: for each seed the
relative gap ``val_loss / val_loss(lowbit fp32) - 1`` is computed, then its mean ± sd over seeds.

Columns of the table (``--out-md``, default benchmarks/results/convergence.md):
  final val loss    mean ± sd over seeds of the validation loss after the last step (fixed val batches)
  gap vs fp32       mean ± sd over seeds of the paired relative gap to lowbit fp32, in %
  state B/param     optimizer-state bytes per parameter: ``lowbit_optim.bytes_per_param`` for lowbit;
                    for the others the unique storages of every state tensor (torchao subclasses
                    unflattened to their inner codes/scales/codebooks; step counters included) / params
  s/run             mean wall time of one training run (the first seed includes torch.compile)
  ms/step           median step time over all steps of all seeds

Every run's losses are saved next to the table (``--out-md`` with a .json suffix). The PNG
(``--out-png``) shows, per optimizer, the mean over seeds of the training loss smoothed with a moving
average (``--smooth`` steps) and the mean validation points. Runs go seed by seed (every optimizer
with seed 0, then seed 1, ...) and the files are rewritten after each run, so an interrupted benchmark
leaves complete tables for the runs it finished.

Stability sweep (``--sweep``, written to ``--sweep-md``), after the 8-bit optimizers paper (Dettmers et
al. 2022): short runs over eps ∈ {1e-8, 1e-6} x beta1 ∈ {0.9, 0.95} x beta2 ∈ {0.95, 0.999} x
lr ∈ {--lr, --high-lr}; a run diverged if any training loss is NaN/inf or its final validation loss
exceeds its initial one. Reports the fraction of diverged runs per optimizer. torchao's optimizers
compile one graph per (shape, hyperparameter) combination, so they are left out of the sweep unless
named with ``--only``.

Second task (``--task mlp``), a training of another kind: an MLP classifier driven to a low training
loss, where quantized states lose what the short char-GPT run does not show. Inputs are 32-dim
Gaussians labelled by a random teacher network (argmax of tanh(x W1) W2, 32 classes; 4,096 training
and 1,024 validation samples, generated from a fixed seed); the student is 32 -> 256 -> 256 -> 32 with
GELU (82,464 params; its three weight matrices, 8,192 / 65,536 / 8,192 elements, hold quantized
states), trained for 3,000 steps of batch 32 (~23 epochs) with AdamW, betas (0.9, 0.999), no weight
decay, peak lr 2e-3 with a 5 % warmup and cosine decay to 0, seeds 0-3. It reports the loss on the
whole training set (the measure of the optimizer: fp32 AdamW ends at ~0.017) and on the validation
set (which mostly measures overfitting: less training gives a lower validation loss), each with its
paired per-seed gap to fp32 AdamW; two extra rows put 4 bits on one moment and 8 on the other
(``lowbit 4bit+8bit``: 4-bit first moment, 8-bit second). Written to benchmarks/results/convergence_mlp.md
(.json, .png). One run takes 3.5-5 s on one thread with the fused kernel, 16-37 s for torchao's; the
whole comparison (18 optimizers x 4 seeds) about 10 minutes.

Other optimizers (``--task mlp --optimizer sgd|lion|ademamix|adamw``): the same MLP task with that
optimizer's lowbit_optim version with fp32 state (the reference of the gaps), 8bit, 4bit (the
stochastic-rounding recipe) and 4bit-calibrated (the previous 4-bit recipe: nearest rounding), beside
bitsandbytes' 8-bit and 32-bit versions (``bitsandbytes 8bit`` / ``32bit``, when it is installed),
3 seeds. Hyper-parameters per optimizer (``OPTIMIZERS``): SGD momentum 0.9, peak lr 0.05; Lion betas
(0.9, 0.99), peak lr 2e-4; AdEMAMix betas (0.9, 0.999, 0.9999), alpha 5, t_alpha = t_beta3 = the
number of steps (warm-ups as long as the run, as in the paper), peak lr 2e-3; AdamW as above. No weight
decay, the same warmup and cosine schedule. Written to benchmarks/results/convergence_mlp_<optimizer>.md
(.json, .png). ``--with-8bit-sr`` adds ``lowbit 8bit-sr``: the 8bit codebook rounded stochastically, as ``4bit`` is
(measured as an experiment of this script, since registered as the format ``8bit-sr``); ``--with-8bit-linear``
adds ``lowbit 8bit-linear``: signed states on an even 8-bit grid (``EXTRA_FORMATS``). ``--with-state-format SPEC``
(repeatable) adds a row of any state_format: a format's name, or JSON, a dict per state or
``{"state_format": ..., "block_size": N}``, labelled by the formats' names joined by '/' (e.g.
``lowbit 8bit/bf16/8bit-sr``). ``--with-8bit-sr-second``
adds ``lowbit 8bit + sr second moments``: the momenta in ``8bit``, the second moments in ``8bit-sr``.
``--with-8bit-lowrank`` adds ``lowbit 8bit-lowrank``: the optimizer's momenta in ``8bit-lowrank``, its second
moments in ``8bit-sr`` (``SPLIT_ROWS``; Muon's rows always include ``8bit-lowrank`` and ``bf16``);
``--with-4bit-lowrank`` adds ``lowbit 4bit-lowrank``: momenta in ``4bit-lowrank``, second moments in ``4bit``. SGD, Lion and AdEMAMix took
the compiled step when these were measured (the fused CPU kernel now steps them too): 2-12 ms per step on one thread (the
stochastic 4bit the slowest); one --optimizer comparison took 2-8 minutes on a shared 2-core
machine, the four 21 minutes.

``--task gpt --optimizer sgd|lion|ademamix|adamw``: the same rows on the char GPT (the gap of the final
validation loss), the optimizer's hyper-parameters as above, its MLP peak lr unless ``--lr`` says
otherwise, weight decay 0.1, 300 steps (AdEMAMix's warm-ups last them); written to
benchmarks/results/convergence_gpt_<optimizer>.md. Muon's comparison runs on the MLP only.

Time on 2 idle CPU cores with the fused CPU kernel (measured): the default comparison (2 layers,
d_model 128, 300 steps, 15 optimizers x 3 seeds, ~12-20 s per run) in about 12 minutes; ``--sweep``
(10 optimizers x 16 configurations x 100 steps, 1 seed) in 18 minutes. Other load on the cores
slows runs severalfold.

    python benchmarks/convergence.py                                   # full comparison
    python benchmarks/convergence.py --steps 50 --seeds 0 --only "lowbit fp32,lowbit 8bit,torchao 8bit"
    python benchmarks/convergence.py --sweep
    python benchmarks/convergence.py --task mlp                        # the MLP classifier, 4 seeds
    python benchmarks/convergence.py --task mlp --seeds 0 --only "lowbit fp32,lowbit 8bit,lowbit 4bit"   # ~15 s
    OMP_NUM_THREADS=1 python benchmarks/convergence.py --task mlp --optimizer lion   # Lion: 6 rows x 3 seeds
    python benchmarks/convergence.py --optimizer ademamix --with-8bit-sr          # AdEMAMix on the char GPT
"""

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))  # lowbit_optim without pip install -e
from train_char_gpt import GPT, CharDataset, evaluate, get_batch, load_text, lr_factor  # noqa: E402

import lowbit_optim  # noqa: E402
from lowbit_optim.formats import paired_label, paired_state_format  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
REFERENCE = "lowbit fp32"


sys.path.insert(0, str(ROOT / "benchmarks"))
import custom_formats  # noqa: E402,F401  (registers "int8-linear")


# ---- optimizers ------------------------------------------------------------------------------------


@dataclass
class OptimizerSpec:
    label: str
    make: Callable  # (params, lr, betas, eps, weight_decay) -> optimizer
    lowbit: bool
    torchao: bool = False
    takes_model: bool = False  # make gets the model, not its parameters (Muon splits it)


def optimizer_specs(task: str = "gpt") -> list[OptimizerSpec]:
    def lowbit(name):
        spec = paired_state_format(name)
        return lambda params, **kw: lowbit_optim.AdamW(params, state_format=spec, **kw)

    def per_moment(exp_avg, exp_avg_sq):
        spec = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        return lambda params, **kw: lowbit_optim.AdamW(params, state_format=spec, **kw)

    specs = [
        OptimizerSpec(REFERENCE, lowbit("fp32"), True),
        OptimizerSpec("torch AdamW", lambda params, **kw: torch.optim.AdamW(params, **kw), False),
    ]
    specs += [OptimizerSpec(f"lowbit {paired_label(name)}", lowbit(name), True) for name in lowbit_optim.registered_formats() if name != "fp32"]
    if task == "mlp":  # which moment's 4-bit codes cost the accuracy: 4 bits for one, 8 for the other
        specs += [OptimizerSpec("lowbit 4bit+8bit", per_moment("4bit", "8bit"), True), OptimizerSpec("lowbit 8bit+4bit", per_moment("8bit", "4bit"), True)]
    try:
        import torchao.optim as ao
    except ImportError:  # torchao is optional (the "bench" extra)
        return specs
    for name, cls in [("8bit", ao.AdamW8bit), ("4bit", ao.AdamW4bit), ("fp8", ao.AdamWFp8)]:
        specs.append(OptimizerSpec(f"torchao {name}", lambda params, cls=cls, **kw: cls(params, **kw), False, torchao=True))
    # each torchao row right after its lowbit twin, so a partial run already holds whole pairs
    order = [REFERENCE, "lowbit 8bit", "torchao 8bit", "lowbit 4bit", "lowbit 4bit-calibrated", "lowbit 4bit-torchao", "torchao 4bit", "lowbit nf4"]
    order += ["lowbit 4bit-precond", "lowbit 4bit-uncalibrated", "lowbit 4bit+8bit", "lowbit 8bit+4bit", "lowbit 4bit+factored"]
    order += ["lowbit fp8", "torchao fp8", "torch AdamW"]
    return sorted(specs, key=lambda s: order.index(s.label) if s.label in order else len(order))


@dataclass(frozen=True)
class Optimizer:
    """``--optimizer``: one optimizer's MLP-task rows: lowbit_optim's class, its hyper-parameters
    besides lr and weight decay (a function of the arguments: AdEMAMix's warm-ups last the run), and
    bitsandbytes' 8-bit and 32-bit versions (class name, extra keywords)."""

    title: str
    lowbit: str
    lr: float
    kwargs: Callable  # args -> keywords
    bitsandbytes: tuple[tuple[str, dict], tuple[str, dict]] | None  # None: bitsandbytes has none


OPTIMIZERS = {
    "adamw": Optimizer("AdamW", "AdamW", 2e-3, lambda args: dict(betas=(0.9, 0.999), eps=1e-8), (("AdamW8bit", {}), ("AdamW32bit", {}))),
    "sgd": Optimizer("SGD", "SGD", 0.05, lambda args: dict(momentum=0.9), (("SGD8bit", {}), ("SGD32bit", {}))),
    "lion": Optimizer("Lion", "Lion", 2e-4, lambda args: dict(betas=(0.9, 0.99)), (("Lion8bit", {}), ("Lion32bit", {}))),
    "ademamix": Optimizer(
        "AdEMAMix",
        "AdEMAMix",
        2e-3,
        lambda args: dict(betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=args.steps, t_beta3=args.steps),
        (("AdEMAMix8bit", {}), ("AdEMAMix", dict(optim_bits=32))),
    ),
    # MuonWithAdamW: Muon on the hidden matrices, AdamW (fp32 state, the adamw row's lr) on the rest
    # peak lr 2e-3: fp32 Muon ends near AdamW's final training loss (0.014 vs 0.018, seed 0); at 2e-2 it
    # drives it to ~1e-7, where relative gaps measure nothing
    "muon": Optimizer("Muon", "Muon", 2e-3, lambda args: dict(momentum=0.95, nesterov=True), None),
}
# the lowbit_optim formats of each --optimizer comparison: 4bit rounds stochastically, 4bit-calibrated
# is the same codebooks with nearest rounding (the 4-bit recipe before it)
OPTIMIZER_FORMATS = ("fp32", "8bit", "4bit", "4bit-calibrated")
# Muon's too: bf16, 8bit-lowrank and 4bit-lowrank-mulaw (the 8- and 4-bit recipes for Muon's momentum,
# lowbit_optim/lowrank.py), 4bit-lowrank (its even grid)
MUON_FORMATS = ("bf16", "8bit-lowrank", "4bit-lowrank-mulaw", "4bit-lowrank")
# rows of one more format, each behind a flag: flag -> format
EXTRA_FORMATS = {"with_8bit_sr": "8bit-sr", "with_8bit_linear": "8bit-linear"}


# rows with a format per kind of state: flag -> (label, the momenta's format, the second moments')
SPLIT_ROWS = {
    # nearest rounding for the momenta, stochastic for the slow second moments, whose small steps
    # stall under nearest rounding (README, Optimizers x formats)
    "with_8bit_sr_second": ("8bit + sr second moments", "8bit", "8bit-sr"),
    # a low-rank format keeps no low-rank part of a second moment
    "with_8bit_lowrank": ("8bit-lowrank", "8bit-lowrank", "8bit-sr"),
    "with_4bit_lowrank": ("4bit-lowrank", "4bit-lowrank", "4bit"),
}


def split_state_format(cls, momenta: str, second: str) -> dict:
    """A per-state state_format of optimizer class ``cls``: ``momenta`` for its momenta (signed
    states), ``second`` for its second moments."""
    return {state.name: momenta if state.signed else second for state in cls.states if state.follows is None}


def state_format_row(spec: str) -> dict:
    """``--with-state-format``'s row as the optimizer's options: a registered format's name, or JSON:
    a per-state dict, or {"state_format": ..., "block_size": N}."""
    if not spec.lstrip().startswith("{"):
        return {"state_format": spec}
    try:
        value = json.loads(spec)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{spec!r} is not valid JSON ({error}); e.g. '{{\"exp_avg\": \"8bit\", \"exp_avg_sq\": \"8bit-sr\"}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{spec!r} is not a JSON object (a dict per state, or with state_format and block_size)")
    options = value if "state_format" in value else {"state_format": value}
    if set(options) - {"state_format", "block_size"}:
        raise argparse.ArgumentTypeError(f"{spec!r}: a row takes state_format and block_size only, got {sorted(options)}")
    return options


def row_label(options: dict) -> str:
    """A comma-free label (``--only`` splits at commas): a per-state format's names joined by '/'."""
    fmt = options["state_format"]
    label = "lowbit " + ("/".join(fmt.values()) if isinstance(fmt, dict) else fmt)
    return label + (f" block_size {options['block_size']}" if "block_size" in options else "")


def optimizer_comparison_specs(args) -> list[OptimizerSpec]:
    """``--optimizer``'s rows: lowbit_optim's version in OPTIMIZER_FORMATS, then bitsandbytes'."""
    info = OPTIMIZERS[args.optimizer]
    kwargs = info.kwargs(args)
    cls = getattr(lowbit_optim, info.lowbit)

    def lowbit(state_format, **options):
        return lambda params, lr, weight_decay, **_: cls(params, lr=lr, weight_decay=weight_decay, state_format=state_format, **options, **kwargs)

    formats = OPTIMIZER_FORMATS + tuple(fmt for flag, fmt in EXTRA_FORMATS.items() if getattr(args, flag))
    if args.optimizer == "muon":
        return muon_specs(kwargs, formats + MUON_FORMATS, args.with_state_format)
    specs = [OptimizerSpec(REFERENCE if f == "fp32" else f"lowbit {f}", lowbit(f), True) for f in formats]
    specs += [OptimizerSpec(f"lowbit {label}", lowbit(split_state_format(cls, momenta, second)), True) for flag, (label, momenta, second) in SPLIT_ROWS.items() if getattr(args, flag)]
    specs += [OptimizerSpec(row_label(options), lowbit(**options), True) for options in args.with_state_format]
    try:
        import bitsandbytes
    except ImportError:  # optional (the "bench" extra)
        return specs
    def bnb(name, extra):
        bnb_cls = getattr(bitsandbytes.optim, name)
        return lambda params, lr, weight_decay, **_: bnb_cls(params, lr=lr, weight_decay=weight_decay, **kwargs, **extra)

    specs += [OptimizerSpec(f"bitsandbytes {bits}bit", bnb(name, extra), False) for bits, (name, extra) in zip((8, 32), info.bitsandbytes)]
    return specs


def muon_specs(kwargs: dict, formats: tuple[str, ...], rows: list[dict] = ()) -> list[OptimizerSpec]:
    """``--optimizer muon``: MuonWithAdamW with Muon's momentum in each format. muon_split gives Muon
    the MLP's first two weights and AdamW the head and the biases, always in fp32 at the AdamW
    comparison's peak lr (2e-3, whatever Muon's --lr), so that a gap is the momentum's. Then AdamW
    alone on every parameter at that lr, for Muon against AdamW. Groups carry ``lr_scale``: the
    schedule sets lr to ``lr * lr_scale``, so each keeps its own peak lr. ``rows``: Muon's options
    of more rows (``--with-state-format``)."""
    adamw_lr = OPTIMIZERS["adamw"].lr  # whatever Muon's --lr

    def scaled(opt, groups, lr):
        for group in groups:
            group["lr_scale"] = adamw_lr / lr
        return opt

    def recipe(state_format, **options):
        def make(model, lr, weight_decay, **_):
            muon = dict(lr=lr, state_format=state_format, **options, **kwargs)
            opt = lowbit_optim.MuonWithAdamW(model, muon=muon, adamw=dict(lr=adamw_lr), weight_decay=weight_decay)
            return scaled(opt, opt.adamw.param_groups, lr)

        return make

    def adamw(model, lr, weight_decay, **_):
        opt = lowbit_optim.AdamW(model.parameters(), lr=adamw_lr, weight_decay=weight_decay)
        return scaled(opt, opt.param_groups, lr)

    specs = [OptimizerSpec(REFERENCE if f == "fp32" else f"lowbit {f}", recipe(f), True, takes_model=True) for f in formats]
    specs += [OptimizerSpec(row_label(options), recipe(**options), True, takes_model=True) for options in rows]
    return specs + [OptimizerSpec("AdamW fp32 (not Muon)", adamw, True, takes_model=True)]


def select(specs: list[OptimizerSpec], only: str | None) -> list[OptimizerSpec]:
    labels = [s.label for s in specs]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:  # results are kept by label
        raise SystemExit(f"two rows share the label(s) {twice}: drop one of the flags or specs that add them")
    if not only:
        return specs
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    unknown = [w for w in wanted if w not in labels]
    if unknown:
        raise SystemExit(f"unknown optimizer label(s) {unknown}; choose from {labels}")
    return [s for s in specs if s.label in wanted]


def _storages(t, out: dict) -> None:
    """Unique storages (data_ptr -> nbytes) of a tensor, unflattening tensor subclasses."""
    if not isinstance(t, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            _storages(getattr(t, name), out)
        return
    storage = t.untyped_storage()
    out[storage.data_ptr()] = storage.nbytes()


def state_bytes_per_param(opt: torch.optim.Optimizer, lowbit: bool) -> float:
    if lowbit:
        return lowbit_optim.bytes_per_param(opt)
    storages: dict = {}
    for state in opt.state.values():
        for value in state.values():
            _storages(value, storages)
    params = sum(p.numel() for g in opt.param_groups for p in g["params"] if p in opt.state)
    return sum(storages.values()) / max(params, 1)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr as a tensor and refuses a float
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr


# ---- one run ---------------------------------------------------------------------------------------


def train_run(spec: OptimizerSpec, dataset: CharDataset, args, seed: int, lr: float, betas, eps: float, steps: int, eval_every: int) -> dict:
    """Train a fresh model from ``seed`` (init and batch order) with ``spec``'s optimizer."""
    torch.manual_seed(seed)
    model = GPT(dataset.vocab_size, args.block_size, args.layers, args.d_model, args.heads)
    opt = spec.make(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=args.weight_decay)
    warmup = min(100, steps // 10 + 1)
    generator = torch.Generator().manual_seed(seed)
    initial_val = evaluate(model, dataset.val, args, args.eval_batches)
    train_losses, val_history, step_seconds = [], [], []
    start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        set_lr(opt, lr * lr_factor(step, steps, warmup))
        _, loss = model(*get_batch(dataset.train, args.batch_size, args.block_size, generator))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        train_losses.append(value)
        step_seconds.append(time.perf_counter() - t0)
        if not math.isfinite(value):
            break  # diverged: the rest would be NaN too
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            val_history.append((step + 1, evaluate(model, dataset.val, args, args.eval_batches)))
    seconds = time.perf_counter() - start
    val = evaluate(model, dataset.val, args, args.eval_batches) if math.isfinite(train_losses[-1]) else math.nan
    val_history.append((len(train_losses), val))
    return {
        "label": spec.label,
        "seed": seed,
        "initial_val_loss": initial_val,
        "val_loss": val,
        "train_losses": train_losses,
        "val_history": val_history,
        "bytes_per_param": state_bytes_per_param(opt, spec.lowbit),
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": seconds,
        "step_seconds": step_seconds,
    }


# ---- the MLP task ----------------------------------------------------------------------------------


@dataclass
class MLPDataset:
    """``--task mlp``: inputs and labels of a synthetic classification problem (see make_mlp_dataset)."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    classes: int


MLP_DATA_SEED = 1234  # the data is the same for every run seed: seeds vary only init and batch order


def make_mlp_dataset(args) -> MLPDataset:
    """Gaussian inputs (``--mlp-inputs`` dims) labelled by a random teacher network: the argmax of
    tanh(x W1) W2 over ``--mlp-classes`` classes (W1 with 64 hidden units). A fixed seed, so every run
    sees the same ``--mlp-train`` training and ``--mlp-val`` validation samples; nothing is downloaded."""
    generator = torch.Generator().manual_seed(MLP_DATA_SEED)
    d_in, hidden, classes, n = args.mlp_inputs, 64, args.mlp_classes, args.mlp_train + args.mlp_val
    x = torch.randn(n, d_in, generator=generator)
    w1 = torch.randn(d_in, hidden, generator=generator) * (2 / math.sqrt(d_in))
    w2 = torch.randn(hidden, classes, generator=generator) * (4 / math.sqrt(hidden))
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    t = args.mlp_train
    return MLPDataset(x[:t], y[:t], x[t:], y[t:], classes)


def make_mlp(args, classes: int) -> torch.nn.Module:
    """inputs -> width -> width -> classes, GELU between: every weight matrix has >= 4096 elements at the
    default width 256 (8,192, 65,536 and 8,192), so each is quantized; the biases keep fp32 states."""
    width = args.mlp_width
    nn = torch.nn
    return nn.Sequential(nn.Linear(args.mlp_inputs, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, classes))


@torch.no_grad()
def full_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Cross-entropy over every sample of (x, y): the whole training or validation set."""
    return torch.nn.functional.cross_entropy(model(x), y).item()


def cosine_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to zero (the MLP task drives the training loss as low as it goes)."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))


def train_run_mlp(spec: OptimizerSpec, data: MLPDataset, args, seed: int, lr: float, betas, eps: float, steps: int, eval_every: int) -> dict:
    """Train a fresh MLP from ``seed`` (init and the order of the shuffled epochs) with ``spec``'s
    optimizer; losses on the whole training and validation sets."""
    torch.manual_seed(seed)
    model = make_mlp(args, data.classes)
    opt = spec.make(model if spec.takes_model else model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=args.weight_decay)
    warmup = max(steps // 20, 1)
    generator = torch.Generator().manual_seed(seed)
    n, batch = data.train_x.shape[0], args.batch_size
    order, position = torch.randperm(n, generator=generator), 0
    initial_val = full_loss(model, data.val_x, data.val_y)
    train_losses, val_history, train_set_history, step_seconds = [], [], [], []
    start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        if position + batch > n:  # a new epoch: reshuffle (the remainder of the last one is dropped)
            order, position = torch.randperm(n, generator=generator), 0
        index = order[position : position + batch]
        position += batch
        set_lr(opt, lr * cosine_factor(step, steps, warmup))
        loss = torch.nn.functional.cross_entropy(model(data.train_x[index]), data.train_y[index])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        train_losses.append(value)
        step_seconds.append(time.perf_counter() - t0)
        if not math.isfinite(value):
            break  # diverged: the rest would be NaN too
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            val_history.append((step + 1, full_loss(model, data.val_x, data.val_y)))
            train_set_history.append((step + 1, full_loss(model, data.train_x, data.train_y)))
    seconds = time.perf_counter() - start
    finite = math.isfinite(train_losses[-1])
    val = full_loss(model, data.val_x, data.val_y) if finite else math.nan
    train_set = full_loss(model, data.train_x, data.train_y) if finite else math.nan
    val_history.append((len(train_losses), val))
    train_set_history.append((len(train_losses), train_set))
    return {
        "label": spec.label,
        "seed": seed,
        "initial_val_loss": initial_val,
        "val_loss": val,
        "train_set_loss": train_set,
        "train_losses": train_losses,
        "val_history": val_history,
        "train_set_history": train_set_history,
        "bytes_per_param": state_bytes_per_param(opt, spec.lowbit),
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": seconds,
        "step_seconds": step_seconds,
    }


# ---- comparison ------------------------------------------------------------------------------------


def _mean_sd(values: list[float]) -> tuple[float, float]:
    values = list(values)
    mean = statistics.fmean(values)
    if not all(math.isfinite(v) for v in values):  # a diverged run: statistics.stdev raises on NaN
        return mean, math.nan
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(runs: list[dict], labels: list[str]) -> list[dict]:
    """One row per optimizer: val loss mean/sd, paired gap to REFERENCE (per seed) mean/sd, bytes, time."""
    by_label = {label: {r["seed"]: r for r in runs if r["label"] == label} for label in labels}
    reference = by_label.get(REFERENCE)
    rows = []
    for label in labels:
        seeds = by_label[label]
        val_mean, val_sd = _mean_sd([r["val_loss"] for r in seeds.values()])
        gaps = [(r["val_loss"] / reference[s]["val_loss"] - 1) * 100 for s, r in seeds.items() if reference and s in reference]
        gap = _mean_sd(gaps) if gaps else None
        steps = sorted(t for r in seeds.values() for t in r["step_seconds"])
        extra = {}
        if all("train_set_loss" in r for r in seeds.values()):  # --task mlp: the training-set loss too
            extra["train_mean"], extra["train_sd"] = _mean_sd([r["train_set_loss"] for r in seeds.values()])
            train_gaps = [(r["train_set_loss"] / reference[s]["train_set_loss"] - 1) * 100 for s, r in seeds.items() if reference and s in reference]
            train_gap = _mean_sd(train_gaps) if train_gaps else None
            extra["train_gap_mean"], extra["train_gap_sd"] = train_gap if train_gap else (None, None)
            extra["train_gaps"] = train_gaps
        rows.append(
            {
                **extra,
                "label": label,
                "seeds": len(seeds),
                "val_mean": val_mean,
                "val_sd": val_sd,
                "gap_mean": gap[0] if gap else None,
                "gap_sd": gap[1] if gap else None,
                "gaps": gaps,
                "bytes_per_param": statistics.fmean(r["bytes_per_param"] for r in seeds.values()),
                "seconds": statistics.fmean(r["seconds"] for r in seeds.values()),
                "ms_per_step": 1000 * steps[len(steps) // 2],
            }
        )
    return rows


def _gap(mean, sd) -> str:
    return f"{mean:+.2f} ± {sd:.2f} %" if mean is not None else "-"


def markdown_table_mlp(rows: list[dict], runs: list[dict], args) -> str:
    first = runs[0]
    lines = [
        f"MLP classifier (`--task mlp`): {args.mlp_inputs} -> {args.mlp_width} -> {args.mlp_width} -> {args.mlp_classes}, "
        f"{first['params']:,} params, {args.mlp_train} training / {args.mlp_val} validation samples labelled by a random "
        f"teacher network, {args.steps} steps of batch {args.batch_size} (~{args.steps * args.batch_size // args.mlp_train} epochs), "
        f"{_optimizer_text(args)}, peak lr {args.lr} (warmup, cosine to 0), weight decay {args.weight_decay}, seeds {args.seeds}. "
        f"Losses on the whole training / validation set after the last step. Gaps: per-seed relative difference to "
        f"`{REFERENCE}`, mean ± sd over seeds; the training-set gap is the one that measures the optimizer "
        "(the validation loss mostly measures overfitting, which less training reduces).",
        "",
        f"| optimizer | seeds | final train loss | train gap vs fp32 {_optimizer_title(args)} | final val loss | val gap | state B/param | s/run | ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['seeds']} | {r['train_mean']:.5f} ± {r['train_sd']:.5f} | {_gap(r['train_gap_mean'], r['train_gap_sd'])} | "
            f"{r['val_mean']:.4f} ± {r['val_sd']:.4f} | {_gap(r['gap_mean'], r['gap_sd'])} | {r['bytes_per_param']:.3f} | "
            f"{r['seconds']:.1f} | {r['ms_per_step']:.2f} |"
        )
    lines += per_seed_table("Per-seed final training-set loss:", rows, runs, args, "train_set_loss", 5)
    return "\n".join(lines) + "\n"


def per_seed_table(title: str, rows: list[dict], runs: list[dict], args, key: str, digits: int) -> list[str]:
    """Markdown lines: each row's ``key`` for every seed ("-" where a run is missing)."""
    seeds = _seeds(args)
    lines = ["", title, "", "| optimizer | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---:|" * len(seeds)]
    for r in rows:
        per_seed = {x["seed"]: x[key] for x in runs if x["label"] == r["label"]}
        lines.append(f"| {r['label']} | " + " | ".join(f"{per_seed[s]:.{digits}f}" if s in per_seed else "-" for s in seeds) + " |")
    return lines


def _optimizer_title(args) -> str:
    return OPTIMIZERS[args.optimizer].title if args.optimizer else "AdamW"


def _optimizer_text(args) -> str:
    """The optimizer and its hyper-parameters besides lr and weight decay, for the table's caption."""
    if not args.optimizer:
        return f"AdamW, betas {args.betas}"  # the task's: (0.9, 0.999) for the MLP, (0.9, 0.99) for the char GPT
    info = OPTIMIZERS[args.optimizer]
    return f"{info.title} ({', '.join(f'{k} {v}' for k, v in info.kwargs(args).items())})"


def markdown_table(rows: list[dict], runs: list[dict], args) -> str:
    if args.task == "mlp":
        return markdown_table_mlp(rows, runs, args)
    first = runs[0]
    lines = [
        f"Char GPT: {args.layers} layers, d_model {args.d_model}, {first['params']:,} params, {args.steps} steps, "
        f"batch {args.batch_size} x {args.block_size}, {_optimizer_text(args)}, peak lr {args.lr}, weight decay {args.weight_decay}, "
        f"seeds {args.seeds}. Gap: per-seed relative difference of final val loss to `{REFERENCE}`, mean ± sd over seeds.",
        "",
        f"| optimizer | seeds | final val loss | gap vs fp32 {_optimizer_title(args)} | state B/param | s/run | ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gap = f"{r['gap_mean']:+.2f} ± {r['gap_sd']:.2f} %" if r["gap_mean"] is not None else "-"
        lines.append(
            f"| {r['label']} | {r['seeds']} | {r['val_mean']:.4f} ± {r['val_sd']:.4f} | {gap} | {r['bytes_per_param']:.3f} | "
            f"{r['seconds']:.1f} | {r['ms_per_step']:.1f} |"
        )
    lines += per_seed_table("Per-seed final val loss:", rows, runs, args, "val_loss", 4)
    return "\n".join(lines) + "\n"


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(runs: list[dict], labels: list[str], args, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(13, 5))
    palette = 10 if len(labels) <= 10 else 20  # past 20 rows a color repeats, with another marker
    cmap = plt.get_cmap(f"tab{palette}")
    mlp = args.task == "mlp"
    points = "train_set_history" if mlp else "val_history"  # the dots: whole training set (mlp), val batches (gpt)
    handles = []  # a curve's line and its dots' marker, which tell apart rows that share a color
    for i, label in enumerate(labels):
        mine = [r for r in runs if r["label"] == label]
        n = min(len(r["train_losses"]) for r in mine)
        curves = [_smooth(r["train_losses"][:n], args.smooth) for r in mine]
        mean = [statistics.fmean(c[k] for c in curves) for k in range(n)]
        style = "--" if label.startswith("torch") else "-"
        val_steps = [s for s, _ in mine[0][points]]
        same = [r for r in mine if len(r[points]) == len(val_steps)]  # a diverged run stops early
        val_mean = [statistics.fmean(r[points][k][1] for r in same) for k in range(len(val_steps))]
        for axis in (ax, zoom):
            color, marker = cmap(i % palette), "os^"[i // palette % 3]
            axis.plot(range(1, n + 1), mean, style, color=color, linewidth=1.2)
            axis.plot(val_steps, val_mean, marker, color=color, markersize=4)
        handles.append(Line2D([], [], linestyle=style, marker=marker, color=color, markersize=4, linewidth=1.2, label=label))
    counts = sorted({sum(r["label"] == label for r in runs) for label in labels})
    seeds = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    dots = "training-set loss" if mlp else "val loss"
    ax.set_title(f"train loss (moving average {args.smooth}, mean of {seeds} seeds); dots: {dots}", fontsize=10)
    zoom.set_title("last 40% of training")
    last = [r["train_losses"][-1] for r in runs if math.isfinite(r["train_losses"][-1])]
    start = int(0.6 * args.steps)
    zoom.set_xlim(start, args.steps + 2)
    if last:
        window = [v for r in runs for v in _smooth(r["train_losses"], args.smooth)[start:] if math.isfinite(v)]
        vals = [v for r in runs for _, v in r[points][-1:] if math.isfinite(v)]
        lo, hi = min(window + vals), max(window + vals)
        if mlp:  # log scale: the losses fall by orders of magnitude
            zoom.set_ylim(lo / 1.1, hi * 1.1)
        else:
            zoom.set_ylim(lo - 0.02 * (hi - lo), hi + 0.02 * (hi - lo))
    for axis in (ax, zoom):
        axis.set_xlabel("step")
        axis.set_ylabel("loss (nats/sample)" if mlp else "loss (nats/char)")
        axis.grid(alpha=0.3)
        if mlp:
            axis.set_yscale("log")
    # beside the plots, not over them: with every format there are ~26 rows
    zoom.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1 if len(labels) <= 16 else 2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _seeds(args) -> list[int]:
    return [int(s) for s in str(args.seeds).split(",") if s.strip()]


def compare(args, specs: list[OptimizerSpec], dataset) -> dict:
    runs = []
    run = train_run_mlp if args.task == "mlp" else train_run
    # seed-major: every optimizer once per round, so an interrupted run already covers every optimizer.
    # Compiled graphs are process-wide, so only the first round pays for torch.compile.
    seeds = _seeds(args)
    for i, seed in enumerate(seeds):
        for spec in specs:
            r = run(spec, dataset, args, seed, args.lr, args.betas, 1e-8, args.steps, args.eval_every)
            runs.append(r)
            train = f"train loss {r['train_set_loss']:.5f}  " if "train_set_loss" in r else ""
            print(f"{spec.label:<20} seed {seed}  {train}val loss {r['val_loss']:.4f}  {r['bytes_per_param']:.3f} B/param  {r['seconds']:.1f} s", flush=True)
            # rewritten after every run: an interrupted benchmark leaves the runs it finished
            labels = [s.label for s in specs if any(x["label"] == s.label for x in runs)]
            rows, table = _write(runs, labels, args, complete=len(runs) == len(seeds) * len(specs))
    print("\n" + table)
    return {"rows": rows, "runs": runs, "markdown": table}


def _write(runs: list[dict], labels: list[str], args, complete: bool) -> tuple[list[dict], str]:
    rows = summarize(runs, labels)
    table = markdown_table(rows, runs, args)
    status = "" if complete else f"**Partial: {len(runs)} run(s) finished so far (seeds per optimizer in the table).**\n\n"
    out_md = pathlib.Path(args.out_md)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    title = "final training-set loss of an MLP classifier" if args.task == "mlp" else "final validation loss"
    if args.optimizer:
        title += f", {_optimizer_title(args)}"
    out_md.write_text(f"# Convergence: {title} by optimizer-state format\n\n" + status + table)
    # every run's losses next to the table (same name, .json), to re-plot or re-summarize later
    out_md.with_suffix(".json").write_text(json.dumps({"args": vars(args), "runs": runs}))
    plot(runs, labels, args, pathlib.Path(args.out_png))
    return rows, table


# ---- stability sweep -------------------------------------------------------------------------------


def sweep_grid(args) -> list[dict]:
    return [
        {"lr": lr, "eps": eps, "betas": (b1, b2)}
        for lr in (args.lr, args.high_lr)
        for eps in (1e-8, 1e-6)
        for b1 in (0.9, 0.95)
        for b2 in (0.95, 0.999)
    ]


def stability_sweep(args, specs: list[OptimizerSpec], dataset: CharDataset) -> dict:
    grid = sweep_grid(args)
    seeds = _seeds(args)[: args.sweep_seeds]
    results = []
    for spec in specs:
        for config in grid:
            for seed in seeds:
                r = train_run(spec, dataset, args, seed, config["lr"], config["betas"], config["eps"], args.sweep_steps, 0)
                finite = all(math.isfinite(v) for v in r["train_losses"]) and math.isfinite(r["val_loss"])
                diverged = not finite or r["val_loss"] > r["initial_val_loss"]
                results.append({**config, "label": spec.label, "seed": seed, "val_loss": r["val_loss"], "diverged": diverged, "finite": finite})
                print(
                    f"{spec.label:<20} lr {config['lr']:g} eps {config['eps']:g} betas {config['betas']}  seed {seed}  "
                    f"val {r['val_loss']:.4f}{'  DIVERGED' if diverged else ''}",
                    flush=True,
                )
    lines = [
        f"Char GPT: {args.layers} layers, d_model {args.d_model}, {args.sweep_steps} steps per run, seeds {seeds}; grid "
        f"lr ∈ {{{args.lr:g}, {args.high_lr:g}}} x eps ∈ {{1e-8, 1e-6}} x beta1 ∈ {{0.9, 0.95}} x beta2 ∈ {{0.95, 0.999}}. "
        "Diverged: a NaN/inf training loss, or final val loss > initial val loss.",
        "",
        f"| optimizer | diverged (all) | diverged (lr {args.lr:g}) | diverged (lr {args.high_lr:g}) | non-finite | mean final val loss (lr {args.lr:g}) | mean final val loss (lr {args.high_lr:g}) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for spec in specs:
        mine = [r for r in results if r["label"] == spec.label]
        low = [r for r in mine if r["lr"] == args.lr]
        high = [r for r in mine if r["lr"] == args.high_lr]

        def frac(rs):
            return sum(r["diverged"] for r in rs) / max(len(rs), 1)

        def mean_val(rs):
            finite = [r["val_loss"] for r in rs if r["finite"]]
            return f"{statistics.fmean(finite):.4f}" if finite else "-"

        row = {"label": spec.label, "diverged": frac(mine), "runs": len(mine)}
        rows.append(row)
        lines.append(
            f"| {spec.label} | {sum(r['diverged'] for r in mine)}/{len(mine)} ({100 * frac(mine):.0f}%) | "
            f"{sum(r['diverged'] for r in low)}/{len(low)} | {sum(r['diverged'] for r in high)}/{len(high)} | "
            f"{sum(not r['finite'] for r in mine)} | {mean_val(low)} | {mean_val(high)} |"
        )
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    out = pathlib.Path(args.sweep_md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# Stability sweep: fraction of diverged runs by optimizer-state format\n\n" + table)
    return {"rows": rows, "runs": results, "markdown": table}


# ---- command line ----------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", choices=("gpt", "mlp"), default="gpt", help="the char GPT, or the MLP classifier trained to a low training loss")
    p.add_argument("--steps", type=int, help="default: gpt 300, mlp 3000")
    p.add_argument("--seeds", help="comma-separated seeds (init and batch order); default: gpt 0,1,2, mlp 0,1,2,3")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lr", type=float, help="peak learning rate; default: gpt 3e-3, mlp 2e-3")
    p.add_argument("--weight-decay", type=float, help="default: gpt 0.1, mlp 0")
    p.add_argument("--eval-every", type=int, help="default: gpt 50, mlp 500")
    p.add_argument("--mlp-train", type=int, default=4096, help="mlp: training samples")
    p.add_argument("--mlp-val", type=int, default=1024, help="mlp: validation samples")
    p.add_argument("--mlp-inputs", type=int, default=32, help="mlp: input dimension")
    p.add_argument("--mlp-classes", type=int, default=32, help="mlp: classes")
    p.add_argument("--mlp-width", type=int, default=256, help="mlp: hidden width (two hidden layers)")
    p.add_argument("--eval-batches", type=int, default=10)
    p.add_argument("--smooth", type=int, default=20, help="moving-average window of the plotted train loss")
    p.add_argument("--only", help="comma-separated optimizer labels, e.g. 'lowbit fp32,lowbit 8bit,torchao 8bit'")
    p.add_argument("--out-md", help="default: benchmarks/results/convergence.md (gpt), convergence_mlp.md (mlp), convergence_mlp_<optimizer>.md")
    p.add_argument("--out-png", help="default: benchmarks/results/convergence.png (gpt), convergence_mlp.png (mlp), convergence_mlp_<optimizer>.png")
    p.add_argument("--sweep", action="store_true", help="run the stability sweep instead of the comparison")
    p.add_argument("--sweep-steps", type=int, default=100)
    p.add_argument("--sweep-seeds", type=int, default=1, help="how many of --seeds the sweep uses")
    p.add_argument("--high-lr", type=float, default=0.1, help="the sweep's second peak lr (33x the default)")
    p.add_argument("--sweep-md", default=str(RESULTS / "stability.md"))
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), help="mlp: compare this optimizer's formats and bitsandbytes' versions")
    p.add_argument("--with-8bit-sr", action="store_true", help="--optimizer: add the 8bit-sr row (8-bit codes, stochastic rounding)")
    p.add_argument("--with-8bit-linear", action="store_true", help="--optimizer: add the 8bit-linear row (momenta on an even 8-bit grid)")
    p.add_argument(
        "--with-state-format", action="append", default=[], type=state_format_row, metavar="SPEC",
        help="--optimizer: add a row with this state_format (repeatable): a format's name, or JSON, a dict per state "
        "or {\"state_format\": ..., \"block_size\": N}; labelled by the formats' names joined by '/'",
    )  # fmt: skip
    p.add_argument("--with-8bit-sr-second", action="store_true", help="--optimizer: add a row with the momenta in 8bit, the second moments in 8bit-sr")
    p.add_argument("--with-8bit-lowrank", action="store_true", help="--optimizer: add the 8bit-lowrank row (momenta 8bit-lowrank, second moments 8bit-sr)")
    p.add_argument("--with-4bit-lowrank", action="store_true", help="--optimizer: add the 4bit-lowrank row (momenta 4bit-lowrank, second moments 4bit)")
    p.add_argument("--list", action="store_true", help="print the optimizer labels and exit")
    args = p.parse_args(argv)
    mlp = args.task == "mlp"
    if args.optimizer == "muon" and not mlp:
        raise SystemExit("--optimizer muon runs on the MLP task (its split names the MLP's matrices): add --task mlp")
    for flag in (*EXTRA_FORMATS, *SPLIT_ROWS, "with_state_format"):
        if getattr(args, flag) and not args.optimizer:
            raise SystemExit(f"--{flag.replace('_', '-')} adds a row to an --optimizer comparison: add --optimizer ...")
    results = f"convergence_{'mlp' if mlp else 'gpt'}_{args.optimizer}" if args.optimizer else ("convergence_mlp" if mlp else "convergence")
    defaults = {
        "steps": 3000 if mlp else 300,
        "seeds": "0,1,2" if args.optimizer else "0,1,2,3" if mlp else "0,1,2",
        "lr": OPTIMIZERS[args.optimizer].lr if args.optimizer else 2e-3 if mlp else 3e-3,
        "weight_decay": 0.0 if mlp else 0.1,
        "eval_every": 500 if mlp else 50,
        "out_md": str(RESULTS / f"{results}.md"),
        "out_png": str(RESULTS / f"{results}.png"),
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.betas = (0.9, 0.999) if mlp else (0.9, 0.99)
    if mlp and args.sweep:
        raise SystemExit("--sweep runs on the char GPT only (--task gpt)")
    if args.optimizer and args.sweep:  # its rows take lr and weight decay alone: every cell had run the same
        raise SystemExit("--sweep varies AdamW's eps and betas over the AdamW rows: run it without --optimizer")
    args.device = "cpu"  # evaluate() reads it
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    specs = optimizer_comparison_specs(args) if args.optimizer else optimizer_specs(args.task)
    if args.list:
        print("\n".join(s.label for s in specs))
        return {}
    if args.sweep and not args.only:
        specs = [s for s in specs if not s.torchao]
    specs = select(specs, args.only)
    dataset = make_mlp_dataset(args) if args.task == "mlp" else CharDataset(load_text())
    start = time.perf_counter()
    out = stability_sweep(args, specs, dataset) if args.sweep else compare(args, specs, dataset)
    print(f"total {time.perf_counter() - start:.0f} s")
    return out


if __name__ == "__main__":
    main()
