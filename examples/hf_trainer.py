"""Train a tiny GPT-2 with Hugging Face's Trainer and a lowbit_optim optimizer; checkpoint and resume.

The model is built from a config (nothing is downloaded) and reads bytes of Python's own help pages
(``pydoc_data.topics``). Checkpoints go to ``--output-dir`` every ``--save-steps`` steps; a resumed
run continues exactly, with its optimizer state still in the low-bit format::

    python examples/hf_trainer.py --state-format 8bit --stop-after 100   # stop (and save) at step 100
    python examples/hf_trainer.py --state-format 8bit --resume           # go on from the last checkpoint

Needs ``pip install -e ".[hf]"`` (transformers, accelerate).
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import lowbit_optim
from lowbit_optim.formats import paired_state_format
from lowbit_optim.hf import optimizer_cls_and_kwargs


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``block_size`` bytes of Python's help text, as causal-LM examples."""

    def __init__(self, block_size: int):
        from pydoc_data.topics import topics

        text = "".join(topics[key] for key in sorted(topics)).encode()
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.windows = data[: len(data) // block_size * block_size].view(-1, block_size)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}  # the model shifts the labels


class StopAfter(TrainerCallback):
    """Stop at ``step`` with a checkpoint, as if the job were interrupted: the lr schedule still runs to max_steps."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = control.should_training_stop = True


def build_model(args) -> GPT2LMHeadModel:
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=256, n_positions=args.block_size, n_embd=args.d_model, n_layer=args.layers, n_head=args.heads,
                        bos_token_id=None, eos_token_id=None)  # bytes: no special tokens
    return GPT2LMHeadModel(config)


def build_trainer(args, optimizer=None) -> Trainer:
    """The Trainer; ``optimizer`` is an ``optimizer_cls_and_kwargs`` pair (default: lowbit_optim's AdamW in ``--state-format``)."""
    model = build_model(args)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=args.steps // 10,
        save_steps=args.save_steps,
        logging_steps=args.logging_steps,
        seed=args.seed,
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=args.quiet,
    )
    optimizer = optimizer or optimizer_cls_and_kwargs(model, training_args, state_format=paired_state_format(args.state_format))
    callbacks = [StopAfter(args.stop_after)] if args.stop_after else []
    return Trainer(model, training_args, train_dataset=ByteWindows(args.block_size), optimizer_cls_and_kwargs=optimizer, callbacks=callbacks)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--state-format", default="8bit", choices=list(lowbit_optim.registered_formats()),
        help="optimizer state format (factored, for second moments only, pairs with a 4bit first moment)",
    )  # fmt: skip
    # under out/, which git ignores: a run from the repository root leaves no untracked files
    p.add_argument("--output-dir", default="out/hf_trainer", help="where checkpoint-<step> folders go")
    p.add_argument("--steps", type=int, default=200, help="training steps (max_steps)")
    p.add_argument("--save-steps", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--stop-after", type=int, default=0, help="stop at this step, with a checkpoint (0: run to --steps)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64, help="context length in bytes")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logging-steps", type=int, default=25)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> Trainer:
    args = parse_args(argv)
    trainer = build_trainer(args)
    result = trainer.train(resume_from_checkpoint=args.resume or None)
    state = lowbit_optim.bytes_per_param(trainer.optimizer.optimizer)  # Trainer's optimizer is accelerate's wrapper
    print(f"step {trainer.state.global_step}: mean train loss of this run {result.training_loss:.4f}, "
          f"optimizer state {state:.2f} bytes/param; checkpoints in {args.output_dir}")
    return trainer


if __name__ == "__main__":
    main()
