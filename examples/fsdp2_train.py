"""Train the character-level GPT of ``train_char_gpt.py`` with FSDP2 and quantized optimizer state, save
a distributed checkpoint (``torch.distributed.checkpoint``) and resume from it, on CPU with gloo::

    torchrun --nproc_per_node 2 examples/fsdp2_train.py --state-format 8bit --stop-after 100
    torchrun --nproc_per_node 2 examples/fsdp2_train.py --state-format 8bit --resume
    torchrun --nproc_per_node 1 examples/fsdp2_train.py --state-format 8bit --resume   # resharded 2 -> 1

Each step draws one global batch and each rank trains on its slice of it, so the data does not depend on
the number of processes and a run resumed on another world size sees the same batches. Parameters and
optimizer states are sharded: every rank holds the 8-bit / 4-bit / fp8 state of its own shard.
"""

import argparse
import math
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import lowbit_optim
from lowbit_optim.formats import paired_state_format
from train_char_gpt import GPT, CharDataset, get_batch, load_text


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--state-format", default="8bit", choices=list(lowbit_optim.registered_formats()))
    p.add_argument("--steps", type=int, default=200, help="total training steps")
    p.add_argument("--stop-after", type=int, default=None, help="save and stop after this many steps (to resume later)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    # under out/, which git ignores: a run from the repository root leaves no untracked files
    p.add_argument("--checkpoint-dir", default="out/checkpoints/fsdp2_char_gpt")
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split between the ranks")
    p.add_argument("--block-size", type=int, default=128, help="context length in characters")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=10)
    return p.parse_args(argv)


def learning_rate(step: int, args) -> float:
    """Linear warmup over the first 10% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(args.steps // 10, 1)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(args.steps - warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def rank_batch(data, step: int, args, rank: int, world: int):
    """This rank's slice of step ``step``'s global batch (the same global batch for any world size)."""
    inputs, targets = get_batch(data, args.batch_size, args.block_size, torch.Generator().manual_seed(args.seed * 100_003 + step))
    per_rank = args.batch_size // world
    return inputs[rank * per_rank : (rank + 1) * per_rank], targets[rank * per_rank : (rank + 1) * per_rank]


def mean_over_ranks(value: float) -> float:
    t = torch.tensor(value)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model, data, args, rank: int, world: int) -> float:
    model.eval()
    losses = [model(*rank_batch(data, 10**9 + i, args, rank, world))[1].item() for i in range(args.eval_batches)]
    model.train()
    return mean_over_ranks(sum(losses) / len(losses))


def local_state_bytes(opt) -> int:
    """Bytes of optimizer state this rank holds (codes and scales, or factors, of its shards; step counters)."""
    total = 0
    for state in opt.state.values():
        for value in state.values():
            value = value.to_local() if hasattr(value, "to_local") else value
            parts = value._inner().values() if isinstance(value, lowbit_optim.StateTensor) else [value]
            total += sum(t.numel() * t.element_size() for t in parts)
    return total


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the number of processes ({world})")
    log = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    dataset = CharDataset(load_text())
    model = GPT(dataset.vocab_size, args.block_size, args.layers, args.d_model, args.heads)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)  # embeddings, final LayerNorm and the tied head
    # whether a parameter's state is quantized depends on its global shape, not on the world size
    opt = lowbit_optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1, state_format=paired_state_format(args.state_format))

    start = 0
    if args.resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "trainer": {"step": torch.tensor(0)}}
        dcp.load(state, checkpoint_id=args.checkpoint_dir)  # reshards if the world size changed
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["trainer"]["step"])
        log(f"resumed from {args.checkpoint_dir} at step {start} on {world} process(es)")

    stop = min(args.stop_after or args.steps, args.steps)
    clock = time.perf_counter()
    for step in range(start, stop):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args)  # no recompilation when lr changes
        _, loss = model(*rank_batch(dataset.train, step, args, rank, world))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0 or step + 1 == stop:
            log(f"step {step + 1:5d}  train loss {mean_over_ranks(loss.item()):.4f}  ({time.perf_counter() - clock:.0f} s)")

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "trainer": {"step": torch.tensor(stop)}}
    with warnings.catch_warnings():  # a resumed run replaces the checkpoint it started from, on purpose
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        dcp.save(state, checkpoint_id=args.checkpoint_dir)
    log(f"saved step {stop} to {args.checkpoint_dir}")
    val_loss = evaluate(model, dataset.val, args, rank, world)
    state_mib = mean_over_ranks(local_state_bytes(opt)) * world / 2**20
    n_params = sum(p.numel() for p in model.parameters())
    log(f"val loss {val_loss:.4f}   optimizer state {state_mib:.3f} MiB over {world} rank(s) "
        f"({state_mib * 2**20 / n_params:.2f} bytes/param; fp32 Adam: 8)")  # fmt: skip
    # every rank past its last collective first: gloo tearing down while a peer still sends aborted
    # 1-6 runs in 10 with "terminate called without an active exception" (plain torch FSDP2 too); 2 in
    # 16 still do (README)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
