"""The examples run and learn: the char-GPT with every registered format, and the custom-format script."""

import pathlib
import subprocess
import sys

import pytest
from conftest import CUSTOM_FORMAT_EXAMPLE, FORMATS, import_script

import lowbit_optim

char_gpt = import_script("examples/train_char_gpt")

# 1 layer, d_model 64: the 64x64 attention projection (4096 elements) is the smallest weight, so every
# weight matrix still reaches min_quantize_numel and gets the quantized format
TINY = ["--layers", "1", "--d-model", "64", "--heads", "2", "--block-size", "32", "--batch-size", "32",
        "--lr", "5e-3", "--eval-every", "0", "--eval-batches", "4", "--sample-chars", "16", "--quiet"]  # fmt: skip


@pytest.mark.parametrize("info", FORMATS, ids=[f.name for f in FORMATS])
def test_char_gpt_learns(info):
    args = char_gpt.parse_args([*TINY, "--state-format", info.name, "--steps", "40"])
    results = char_gpt.train(args)
    # an untrained model is near uniform over ~100 characters (~4.5 nats); 40 steps reach ~0.65 of that
    # with every format and seed we tried (worst 0.67), so 0.8 leaves room for noise
    assert results["val_loss"] < 0.8 * results["initial_val_loss"], results["val_history"]
    assert len(results["sample"]) == len("The ") + 16


@pytest.mark.parametrize("in_backward", [[], ["--step-in-backward"]], ids=["after backward", "in backward"])
def test_char_gpt_without_clipping(in_backward):
    """--clip 0 trains unclipped (clip_grad_norm_ with 0 zeroed every gradient: nothing learned)."""
    results = char_gpt.train(char_gpt.parse_args([*TINY, "--steps", "20", "--clip", "0", *in_backward]))
    assert results["val_loss"] < 0.9 * results["initial_val_loss"], results["val_history"]


def test_char_gpt_main_prints_summary(capsys):
    char_gpt.main([*TINY, "--steps", "2"])
    out = capsys.readouterr().out
    assert "val loss" in out and "bytes/param" in out and "saved" in out


def test_large_model_example_trains_a_small_model():
    """examples/train_large_model.py at a tiny size (its default is 4B parameters): bf16 weights with an
    int8-correction, 4-bit states, the step in backward with clipping; the loss falls."""
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, str(root / "examples/train_large_model.py"), "--layers", "1", "--d-model", "64", "--heads", "2", "--steps", "25", "--lr", "3e-3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(line.split()[3]) for line in done.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 25 and sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses
    assert "bytes/param" in done.stdout


def test_custom_format_is_registered():
    assert CUSTOM_FORMAT_EXAMPLE is not None, "examples/custom_format.py is missing"
    fmt = lowbit_optim.registered_formats()["int8-linear"]
    assert fmt.__name__ == "OptimStateInt8Linear" and issubclass(fmt, lowbit_optim.CodebookState)
    assert fmt.codebook(True) == CUSTOM_FORMAT_EXAMPLE.OptimStateInt8Linear.codebook(True)
    assert "int8-linear" in [f.name for f in FORMATS]


def test_custom_format_script_runs(capsys):
    results = CUSTOM_FORMAT_EXAMPLE.main(steps=5)
    assert set(results) >= {"int8-linear", "8bit"}
    assert "int8-linear" in capsys.readouterr().out
