"""Train a small character-level GPT with quantized optimizer state.

The text is Python's own help pages (``pydoc_data.topics``, ~465k characters), so nothing is downloaded.
The default run takes 70-110 s on 2 CPU cores and prints the validation loss, the optimizer
state memory and a generated sample::

    python examples/train_char_gpt.py --state-format 8bit     # or 4bit, fp8, bf16, fp32, ...

Every flag has a default; see ``--help``. The model, data and training loop are importable functions,
used by the tests and benchmarks.
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

import lowbit_optim
from lowbit_optim.formats import paired_state_format

FP32_ADAM_BYTES_PER_PARAM = 8  # two fp32 moments


# ---- data ------------------------------------------------------------------------------------------


def load_text() -> str:
    """Python's help text, in a fixed order (sorted topic names), as one string."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


class CharDataset:
    """Character vocabulary plus the encoded text, split 90/10 by position into train and val."""

    def __init__(self, text: str, val_fraction: float = 0.1):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor(self.encode(text), dtype=torch.long)
        n_train = int(len(data) * (1 - val_fraction))
        self.train, self.val = data[:n_train], data[n_train:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


def get_batch(data: Tensor, batch_size: int, block_size: int, generator: torch.Generator, device="cpu") -> tuple[Tensor, Tensor]:
    """Random windows of ``data``: inputs and the same windows shifted by one character (targets)."""
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = data[starts[:, None] + offsets]
    return windows[:, :-1].to(device), windows[:, 1:].to(device)


# ---- model -----------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, final LayerNorm, and an output head
    tied to the token embedding (fewer parameters, and it helps a model this small)."""

    def __init__(self, vocab_size: int, block_size: int, n_layers: int = 4, d_model: int = 128, n_heads: int = 4):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for block in self.blocks:  # GPT-2: scale down the residual projections, one pair per layer
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * n_layers))

    @classmethod
    def empty_then_init(cls, *args, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0, **kwargs) -> "GPT":
        """The model built directly in ``dtype`` on ``device``: its shapes on the meta device, then its
        weights allocated once and initialized in place, so a bf16 model of N parameters never holds the
        4N bytes of an fp32 copy (the largest models this machine can train)."""
        with torch.device("meta"):
            model = cls(*args, **kwargs).to(dtype)
        model = model.to_empty(device=device)
        model.head.weight = model.tok_emb.weight  # to_empty keeps the tie only by name: tie the new tensors
        torch.manual_seed(seed)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.LayerNorm):
                    module.reset_parameters()
            model.apply(cls._init_weights)
            for block in model.blocks:
                for proj in (block.attn.proj, block.mlp[2]):
                    nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * len(model.blocks)))
        return model

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor, targets: Tensor | None = None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # fp32 loss for bf16 models too

    @torch.no_grad()
    def generate(self, idx: Tensor, new_tokens: int, temperature: float = 0.8, generator: torch.Generator | None = None) -> Tensor:
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1] / temperature
            next_id = torch.multinomial(F.softmax(logits, dim=-1).cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, next_id], dim=1)
        return idx


# ---- training --------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: nn.Module, data: Tensor, args, batches: int) -> float:
    """Mean loss over ``batches`` fixed batches (same seed every call, so evaluations are comparable)."""
    model.eval()
    generator = torch.Generator().manual_seed(1234)
    losses = [model(*get_batch(data, args.batch_size, args.block_size, generator, args.device))[1].item() for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(args) -> dict:
    """Train as ``args`` (from ``parse_args``) says; return losses, memory figures and a text sample."""
    torch.manual_seed(args.seed)
    dataset = CharDataset(load_text())
    model = GPT(dataset.vocab_size, args.block_size, args.layers, args.d_model, args.heads).to(args.device)
    # every parameter gets the chosen format; those under min_quantize_numel (biases, LayerNorms) stay fp32
    # --step-in-backward: each parameter stepped as backward produces its gradient (no gradients kept),
    # clipped with an estimate of the step's global norm (this step's is not known until backward ends)
    clip = args.clip or None  # --clip 0: no clipping
    in_backward = dict(step_in_backward=True, max_grad_norm=clip) if args.step_in_backward else {}
    opt = lowbit_optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1, state_format=paired_state_format(args.state_format), **in_backward
    )
    warmup = min(100, args.steps // 10 + 1)  # short runs (tests) need a short warmup to learn at all
    # lowbit_optim takes lr changes from any scheduler without recompiling its step
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, args.steps, warmup))
    forward = torch.compile(model) if args.compile_model else model

    generator = torch.Generator().manual_seed(args.seed)
    initial_val_loss = evaluate(model, dataset.val, args, args.eval_batches)
    train_losses, val_history, step_seconds = [], [], []
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"{args.state_format:>6}", disable=args.quiet)
    for step in bar:
        step_start = time.perf_counter()
        _, loss = forward(*get_batch(dataset.train, args.batch_size, args.block_size, generator, args.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip and not args.step_in_backward:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        scheduler.step()
        train_losses.append(loss.item())
        step_seconds.append(time.perf_counter() - step_start)
        bar.set_postfix(loss=f"{train_losses[-1]:.3f}")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            val_history.append((step + 1, evaluate(model, dataset.val, args, args.eval_batches)))
            bar.write(f"step {step + 1:5d}  val loss {val_history[-1][1]:.3f}")
    train_seconds = time.perf_counter() - start
    val_loss = evaluate(model, dataset.val, args, args.eval_batches)
    val_history.append((args.steps, val_loss))

    n_params = sum(p.numel() for p in model.parameters())
    bytes_per_param = lowbit_optim.bytes_per_param(opt)
    prompt = torch.tensor([dataset.encode("The ")], device=args.device)
    sample = model.generate(prompt, args.sample_chars, generator=torch.Generator().manual_seed(args.seed))
    return {
        "state_format": args.state_format,
        "params": n_params,
        "initial_val_loss": initial_val_loss,
        "train_losses": train_losses,
        "val_loss": val_loss,
        "val_history": val_history,
        "bytes_per_param": bytes_per_param,
        "state_bytes": bytes_per_param * n_params,
        "train_seconds": train_seconds,
        "step_seconds": step_seconds,  # the first one includes compiling the optimizer step
        "sample": dataset.decode(sample[0].tolist()),
    }


def parse_args(argv=None) -> argparse.Namespace:
    formats = list(lowbit_optim.registered_formats())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--state-format", default="8bit", choices=formats, help="optimizer state format (factored, for second moments only, pairs with a 4bit first moment)"
    )
    p.add_argument("--steps", type=int, default=600, help="training steps (the default run takes 70-110 s on 2 CPU cores)")
    p.add_argument("--device", default="cpu", help="e.g. cpu, cuda")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--block-size", type=int, default=64, help="context length in characters")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, the batches and the sample")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=128, help="embedding width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--eval-every", type=int, default=100, help="steps between validation losses (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=20, help="fixed validation batches per evaluation")
    p.add_argument("--sample-chars", type=int, default=200, help="characters to generate at the end")
    p.add_argument("--compile-model", action="store_true", help="torch.compile the model (the optimizer step is always compiled)")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clipping (0: none)")
    p.add_argument("--step-in-backward", action="store_true", help="step each parameter in backward (step_in_backward=True, max_grad_norm=--clip)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    results = train(args)
    mib = 2**20
    fp32_bytes = FP32_ADAM_BYTES_PER_PARAM * results["params"]
    print(f"\n--- sample ---\n{results['sample']}\n--------------")
    print(f"state format      {args.state_format}   ({results['params']:,} params, {args.steps} steps, {time.perf_counter() - start:.0f} s)")
    print(f"val loss          {results['val_loss']:.3f}   (initial {results['initial_val_loss']:.3f})")
    print(f"optimizer state   {results['state_bytes'] / mib:.3f} MiB = {results['bytes_per_param']:.3f} bytes/param")
    print(
        f"vs fp32 Adam      {fp32_bytes / mib:.3f} MiB = {FP32_ADAM_BYTES_PER_PARAM} bytes/param: "
        f"{max(fp32_bytes - results['state_bytes'], 0) / mib:.3f} MiB saved ({fp32_bytes / results['state_bytes']:.1f}x smaller)"  # (fp32: its step counters)
    )
    return results


if __name__ == "__main__":
    main()
