"""Smoke tests of the accuracy benchmarks (benchmarks/convergence.py, benchmarks/state_error.py), of
benchmarks/compute_bound.py, benchmarks/memory.py, benchmarks/lowrank_products.py,
benchmarks/slow_averages.py and benchmarks/default_vs_compiled.py: each main function runs on a tiny
configuration, writes its files, and reports finite numbers."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, import_script
from lowbit_optim import kernel_build

TINY = ["--layers", "1", "--d-model", "64", "--heads", "2", "--block-size", "32", "--batch-size", "16"]


@pytest.fixture(scope="module")
def convergence():
    pytest.importorskip("matplotlib")
    return import_script("benchmarks/convergence")


def test_convergence_smoke(convergence, tmp_path):
    md, png = tmp_path / "convergence.md", tmp_path / "convergence.png"
    out = convergence.main(
        [*TINY, "--steps", "10", "--seeds", "0", "--eval-every", "5", "--eval-batches", "2", "--smooth", "3",
         "--only", "lowbit fp32,torch AdamW", "--out-md", str(md), "--out-png", str(png)]
    )  # fmt: skip
    rows = {r["label"]: r for r in out["rows"]}
    assert set(rows) == {"lowbit fp32", "torch AdamW"}
    for r in rows.values():
        assert math.isfinite(r["val_mean"]) and math.isfinite(r["gap_mean"]) and r["bytes_per_param"] > 0
    assert rows["lowbit fp32"]["gap_mean"] == 0.0
    assert rows["torch AdamW"]["bytes_per_param"] == pytest.approx(8, rel=0.01)  # two fp32 moments (+ steps)
    text = md.read_text()
    assert "| lowbit fp32 |" in text and "| torch AdamW |" in text and "Partial" not in text
    assert "AdamW, betas (0.9, 0.99), peak lr" in text  # the char GPT's betas
    assert png.stat().st_size > 1000


def test_convergence_summary_of_a_diverged_run(convergence):
    """A run that diverged (NaN losses, as a too-coarse state can make) is summarized as nan, not
    a crash that loses the other rows (statistics.stdev raises on NaN)."""
    nan = float("nan")
    assert all(math.isnan(v) for v in convergence._mean_sd([0.1, nan]))
    assert convergence._mean_sd([1.0, 2.0, 3.0]) == (2.0, 1.0)


def test_convergence_mlp_smoke(convergence, tmp_path):
    """--task mlp: losses on the whole training and validation sets, paired gaps for both; the weight
    matrices (4,096 elements and more at width 128) hold quantized states."""
    md, png = tmp_path / "convergence_mlp.md", tmp_path / "convergence_mlp.png"
    out = convergence.main(
        ["--task", "mlp", "--steps", "20", "--seeds", "0,1", "--eval-every", "10", "--mlp-train", "256", "--mlp-val", "64",
         "--mlp-width", "128", "--smooth", "3", "--only", "lowbit fp32,lowbit 8bit", "--out-md", str(md), "--out-png", str(png)]
    )  # fmt: skip
    rows = {r["label"]: r for r in out["rows"]}
    assert set(rows) == {"lowbit fp32", "lowbit 8bit"}
    for r in rows.values():
        assert r["seeds"] == 2 and all(math.isfinite(r[k]) for k in ("train_mean", "val_mean", "train_gap_mean", "gap_mean"))
    assert rows["lowbit fp32"]["train_gap_mean"] == 0.0 and rows["lowbit fp32"]["gap_mean"] == 0.0
    assert rows["lowbit 8bit"]["bytes_per_param"] < 3  # quantized weights; only the biases keep fp32 states
    text = md.read_text()
    assert "| lowbit 8bit |" in text and "train gap" in text and "Partial" not in text
    assert png.stat().st_size > 1000


def test_convergence_sweep_smoke(convergence, tmp_path):
    md = tmp_path / "stability.md"
    # 16 runs: an even smaller model than TINY keeps them cheap
    smaller = ["--layers", "1", "--d-model", "32", "--heads", "2", "--block-size", "16", "--batch-size", "4"]
    out = convergence.main([*smaller, "--sweep", "--sweep-steps", "2", "--seeds", "0", "--eval-batches", "1",
                            "--only", "torch AdamW", "--sweep-md", str(md)])  # fmt: skip
    assert len(out["runs"]) == 16  # 2 lr x 2 eps x 2 beta1 x 2 beta2
    assert all(0 <= r["diverged"] <= 1 for r in out["rows"])
    assert "| torch AdamW |" in md.read_text()


def test_state_error_smoke(tmp_path):
    state_error = import_script("benchmarks/state_error")
    md = tmp_path / "state_error.md"
    out = state_error.main([*TINY, "--snapshots", "2,5", "--formats", "8bit,4bit,factored,4bit-torchao", "--out-md", str(md)])
    labels = ("8bit", "4bit", "4bit+factored", "4bit-torchao")  # factored (second moments only) beside a 4bit first moment
    assert {(r["step"], r["format"]) for r in out["rows"]} == {(s, f) for s in (2, 5) for f in labels}
    elements = {r["format"]: r["elements"] for r in out["rows"]}
    # at d_model 64 an odd vocabulary's embedding (vocabulary x 64) is no whole number of torchao's
    # 128-element blocks: lowbit_optim's 4bit-torchao keeps it in fp32, so its row leaves it out
    embedding = state_error.CharDataset(state_error.load_text()).vocab_size * 64
    assert elements["4bit-torchao"] == elements["8bit"] - (embedding if embedding % 128 else 0)
    assert elements["8bit"] == elements["4bit"] == elements["4bit+factored"]
    for r in out["rows"]:
        assert all(math.isfinite(v) and v >= 0 for v in (*r["m"], *r["v"], *r["update"]))
        assert 0 <= r["v_zero"] <= 1 and 0 < r["kept"] <= 1
    text = md.read_text()
    assert text.count("| 8bit |") == 2 and text.count("| 4bit |") == 2


def test_compute_bound_smoke():
    compute_bound = import_script("benchmarks/compute_bound")
    out = compute_bound.main(["--elements", "65536", "--dram-elements", "65536", "--max-divisions", "1", "--formats", "8bit,4bit", "--stages-reps", "20", "--optimizer", "ademamix"])
    # per-element times are differences (a step less a 1024-element step): at these tiny sizes, on a
    # busy machine, only their finiteness is a fact
    assert all(math.isfinite(ns) for ns in out["adamw_ns"].values()) and out["copy_gb_s"] > 0
    assert set(out["kernel_ns"]) == {"8bit", "4bit"} and all(math.isfinite(ns) for sizes in out["kernel_ns"].values() for ns in sizes.values())
    assert out["divider_s"] is None or (set(out["divider_s"]) == {0, 1} and all(s > 0 for s in out["divider_s"].values()))
    assert set(out["stage_ns"]) == set(compute_bound.STAGES) and all(0 < ns < math.inf for ns in out["stage_ns"].values())
    assert out["kernel_optimizer"] == "ademamix" and math.isfinite(compute_bound.kernel_ns_per_element("bf16", 4096, 2))  # and AdamW
    assert out["kernel_param_update"] is None and math.isfinite(compute_bound.kernel_ns_per_element("8bit", 4096, 2, param_update="int8-correction"))


def test_lowrank_refit_smoke(tmp_path):
    """benchmarks/lowrank_refit.py on a tiny MLP run, in a process of its own (it registers formats):
    its rows, and a refit at every write is exactly 8bit-lowrank."""
    pytest.importorskip("matplotlib")
    md = tmp_path / "refit.md"
    tiny = ["--mlp-train", "256", "--mlp-val", "64", "--mlp-width", "128", "--eval-every", "10"]
    command = [sys.executable, str(ROOT / "benchmarks" / "lowrank_refit.py"), "--optimizer", "sgd", "--seeds", "0", "--steps", "20", "--every", "1,4", "--out-md", str(md), "--mlp", *tiny]
    subprocess.run(command, check=True, capture_output=True)
    runs = {r["label"]: r for r in json.loads(md.with_suffix(".json").read_text())["runs"]}
    assert set(runs) == {"lowbit fp32", "lowbit momentum_buffer 8bit-lowrank", "lowbit momentum_buffer refit every 1", "lowbit momentum_buffer refit every 4"}
    assert runs["lowbit momentum_buffer refit every 1"]["train_losses"] == runs["lowbit momentum_buffer 8bit-lowrank"]["train_losses"]
    assert all(math.isfinite(r["train_set_loss"]) for r in runs.values())


def test_lowrank_products_smoke(monkeypatch, capsys):
    """benchmarks/lowrank_products.py on small matrices: a row per matrix and product or QR, and the total."""
    from lowbit_optim import fused_cpu

    if fused_cpu.library() is None:
        pytest.skip("the fused kernel's library cannot be built here")
    lowrank_products = import_script("benchmarks/lowrank_products")
    monkeypatch.setattr(lowrank_products, "SHAPES", [(40, 24), (24, 40)])
    lowrank_products.main(["--rank", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    assert out.count("| 40 x 24 |") == 5 and out.count("| 24 x 40 |") == 5
    assert "a step's four products and two QRs" in out


def test_slow_averages_smoke(tmp_path):
    """benchmarks/slow_averages.py on a small matrix: a row per format and beta with four finite
    ratios, fp32 (exactly the reference average) at 1, and the table written."""
    slow_averages = import_script("benchmarks/slow_averages")
    out = tmp_path / "slow.md"
    rows = slow_averages.main(["--formats", "fp32,8bit-lowrank", "--sizes", "40", "--betas", "0.9,0.99", "--writes", "8", "--out-md", str(out)])
    assert [(r["format"], r["beta"]) for r in rows] == [("fp32", 0.9), ("fp32", 0.99), ("8bit-lowrank", 0.9), ("8bit-lowrank", 0.99)]
    assert all(len(r["ratios"]) == 4 and all(math.isfinite(x) for x in r["ratios"]) for r in rows)
    assert all(r["ratios"] == [1.0] * 4 for r in rows if r["format"] == "fp32")
    assert out.read_text().count("| 8bit-lowrank | 40 |") == 2


def test_default_vs_compiled_smoke(tmp_path):
    """benchmarks/default_vs_compiled.py on two small shapes: SGD and Muon in 8bit timed both ways
    (Muon on the matrix only), factored refused for their signed momentum (with that reason, not a
    per-state dict's), AdEMAMix's second moment factored beside 4bit averages, and the table written."""
    default_vs_compiled = import_script("benchmarks/default_vs_compiled")
    out = tmp_path / "dvc.md"
    rows = default_vs_compiled.main(["--optimizers", "SGD,Muon,AdEMAMix", "--formats", "8bit,factored", "--shapes", "64x64,100", "--warmup", "1", "--steps", "1", "--out-md", str(out)])
    assert [(r["optimizer"], r["format"]) for r in rows] == [(o, f) for o in ("SGD", "Muon", "AdEMAMix") for f in ("8bit", "factored")]
    timed = [r for r in rows if r["format"] == "8bit" or r["optimizer"] == "AdEMAMix"]
    assert all(r["default_ms"] > 0 and r["compiled_ms"] > 0 and math.isfinite(r["ratio"]) for r in timed)
    assert all("holds nonnegative states only, and" in r["refused"] and "momentum_buffer can be negativ" in r["refused"] for r in rows if r not in timed)
    assert out.read_text().count("| SGD | 8bit |") == 1 and "Smallest compiled / default" in out.read_text()


def test_memory_smoke(tmp_path):
    """Two configurations in fresh processes: the step in backward holds no gradients (model bytes
    4.06/param: 2 weights + 1 correction + ~1.07 states), stepping after backward holds bf16 ones."""
    memory = import_script("benchmarks/memory")
    only = "4bit, 24-bit weights;4bit, 24-bit weights, step in backward"
    out = memory.main(["--layers", "1", "--d-model", "128", "--heads", "2", "--steps", "2", "--only", only, "--json", str(tmp_path / "m.json")])
    after, inside = (out[label] for label in only.split(";"))
    assert "error" not in after and "error" not in inside, (after, inside)
    assert inside["model_bytes_per_param"] == pytest.approx(after["model_bytes_per_param"] - 2)
    assert 4.0 < inside["model_bytes_per_param"] < 4.2
    assert all(math.isfinite(r["peak_bytes_per_param"]) and r["step_seconds"] > 0 for r in (after, inside))
    assert (tmp_path / "m.json").exists()


@pytest.fixture
def eager_lowbit_step(monkeypatch):
    """lowbit_optim's optimizers step eagerly: a smoke test of a benchmark needs no compiled graphs
    (test_optimizers.py holds the compiled step to the eager one)."""
    import lowbit_optim

    monkeypatch.setattr(lowbit_optim.base, "compiled_step", lambda step_function: step_function)


def test_convergence_optimizer_smoke(convergence, tmp_path, eager_lowbit_step):
    """--task mlp --optimizer: that optimizer's rows (lowbit_optim's formats, bitsandbytes' versions),
    paired gaps against its own fp32 state."""
    pytest.importorskip("bitsandbytes")
    md, png = tmp_path / "convergence_mlp_sgd.md", tmp_path / "convergence_mlp_sgd.png"
    out = convergence.main(
        ["--task", "mlp", "--optimizer", "sgd", "--steps", "6", "--seeds", "0", "--eval-every", "3", "--mlp-train", "256",
         "--mlp-val", "64", "--mlp-width", "128", "--smooth", "3", "--only", "lowbit fp32,lowbit 8bit,bitsandbytes 8bit,bitsandbytes 32bit",
         "--out-md", str(md), "--out-png", str(png)]
    )  # fmt: skip
    rows = {r["label"]: r for r in out["rows"]}
    assert set(rows) == {"lowbit fp32", "lowbit 8bit", "bitsandbytes 8bit", "bitsandbytes 32bit"}
    assert all(math.isfinite(r["train_gap_mean"]) for r in rows.values())
    assert abs(rows["bitsandbytes 32bit"]["train_gap_mean"]) < 0.01  # the same SGD, to fp32 round-off
    assert rows["lowbit 8bit"]["bytes_per_param"] < 1.5 and rows["bitsandbytes 8bit"]["bytes_per_param"] < 1.5  # one 8-bit buffer
    assert "train gap vs fp32 SGD" in md.read_text()


def test_convergence_optimizer_on_the_char_gpt(convergence, tmp_path, eager_lowbit_step):
    """--optimizer without --task mlp: that optimizer's rows on the char GPT, val-loss gaps against
    its own fp32 state, the table named after it; Muon's comparison is refused there."""
    md, png = tmp_path / "convergence_gpt_ademamix.md", tmp_path / "convergence_gpt_ademamix.png"
    out = convergence.main(
        [*TINY, "--optimizer", "ademamix", "--steps", "4", "--seeds", "0", "--eval-every", "2", "--eval-batches", "2",
         "--smooth", "2", "--only", "lowbit fp32,lowbit 8bit", "--out-md", str(md), "--out-png", str(png)]
    )  # fmt: skip
    rows = {r["label"]: r for r in out["rows"]}
    assert set(rows) == {"lowbit fp32", "lowbit 8bit"}
    assert rows["lowbit fp32"]["gap_mean"] == 0.0 and math.isfinite(rows["lowbit 8bit"]["gap_mean"])
    assert rows["lowbit 8bit"]["bytes_per_param"] < 4 < rows["lowbit fp32"]["bytes_per_param"]  # three states, 8-bit
    assert "gap vs fp32 AdEMAMix" in md.read_text() and "t_beta3 4" in md.read_text()
    assert convergence.parse_args(["--optimizer", "lion"]).out_md.endswith("convergence_gpt_lion.md")
    with pytest.raises(SystemExit, match="--task mlp"):
        convergence.parse_args(["--optimizer", "muon"])


def test_convergence_split_rows(convergence):
    """--with-8bit-sr-second, --with-8bit-lowrank, --with-4bit-lowrank: a format for the momenta and
    one for the second moments (8bit and 8bit-sr; 8bit-lowrank and 8bit-sr; 4bit-lowrank and 4bit)."""
    import lowbit_optim

    split = convergence.split_state_format
    assert split(lowbit_optim.AdEMAMix, "8bit-lowrank", "8bit-sr") == {"exp_avg": "8bit-lowrank", "exp_avg_slow": "8bit-lowrank", "exp_avg_sq": "8bit-sr"}
    assert split(lowbit_optim.AdamW, "8bit", "8bit-sr") == {"exp_avg": "8bit", "exp_avg_sq": "8bit-sr"}  # amsgrad's follows
    assert split(lowbit_optim.Lion, "4bit-lowrank", "4bit") == {"exp_avg": "4bit-lowrank"}
    args = convergence.parse_args(["--task", "mlp", "--optimizer", "adamw", "--with-8bit-sr-second", "--with-8bit-lowrank", "--with-4bit-lowrank"])
    labels = [spec.label for spec in convergence.optimizer_comparison_specs(args)]
    assert {"lowbit 8bit + sr second moments", "lowbit 8bit-lowrank", "lowbit 4bit-lowrank"} <= set(labels)
    for flag in ("--with-8bit-lowrank", "--with-8bit-sr-second"):
        with pytest.raises(SystemExit, match=f"{flag} adds a row"):
            convergence.parse_args([flag])


def test_convergence_extra_format_rows(convergence):
    """--with-8bit-sr, --with-8bit-linear: one row more each, in the Muon comparison too."""
    for optimizer in ("sgd", "muon"):
        args = convergence.parse_args(["--task", "mlp", "--optimizer", optimizer, "--with-8bit-linear"])
        labels = [spec.label for spec in convergence.optimizer_comparison_specs(args)]
        assert "lowbit 8bit-linear" in labels and "lowbit 8bit-sr" not in labels
    for flag in ("--with-8bit-linear", "--with-8bit-sr"):
        with pytest.raises(SystemExit, match=f"{flag} adds a row"):
            convergence.parse_args([flag])


def test_convergence_state_format_rows(convergence):
    """--with-state-format: a row per spec (a name, a per-state dict, or one with a block size), in
    the Muon comparison too; bad JSON and two rows of one label are refused with the reason."""
    per_state = '{"exp_avg": "8bit", "exp_avg_slow": "bf16", "exp_avg_sq": "8bit-sr"}'
    args = convergence.parse_args(["--task", "mlp", "--optimizer", "ademamix", "--with-state-format", per_state, "--with-state-format", '{"state_format": "8bit-linear", "block_size": 32}'])
    specs = {spec.label: spec for spec in convergence.optimizer_comparison_specs(args)}
    assert {"lowbit 8bit/bf16/8bit-sr", "lowbit 8bit-linear block_size 32"} <= specs.keys()
    param = torch.nn.Parameter(torch.zeros(8192))
    opt = specs["lowbit 8bit-linear block_size 32"].make([param], lr=1e-3, weight_decay=0.0)
    assert opt.param_groups[0]["block_size"] == 32 and opt.param_groups[0]["state_format"] == "8bit-linear"
    opt = specs["lowbit 8bit/bf16/8bit-sr"].make([param], lr=1e-3, weight_decay=0.0)
    assert opt.param_groups[0]["state_format"] == {"exp_avg": "8bit", "exp_avg_slow": "bf16", "exp_avg_sq": "8bit-sr"}
    args = convergence.parse_args(["--task", "mlp", "--optimizer", "muon", "--with-state-format", "8bit-linear"])
    assert "lowbit 8bit-linear" in [spec.label for spec in convergence.optimizer_comparison_specs(args)]
    with pytest.raises(SystemExit):
        convergence.parse_args(["--task", "mlp", "--optimizer", "sgd", "--with-state-format", "{bad"])
    args = convergence.parse_args(["--task", "mlp", "--optimizer", "sgd", "--with-8bit-sr", "--with-state-format", "8bit-sr"])
    with pytest.raises(SystemExit, match="share the label"):
        convergence.select(convergence.optimizer_comparison_specs(args), None)


def test_convergence_muon_smoke(convergence, tmp_path, eager_lowbit_step):
    """--optimizer muon: MuonWithAdamW per momentum format and AdamW alone, each group at its own
    peak lr through the schedule (the AdamW parts at the AdamW comparison's 2e-3)."""
    md, png = tmp_path / "convergence_mlp_muon.md", tmp_path / "convergence_mlp_muon.png"
    lrs = []
    set_lr = convergence.set_lr

    def spy(opt, lr):
        set_lr(opt, lr)
        lrs.append([g["lr"] for g in opt.param_groups])

    convergence.set_lr = spy
    try:
        out = convergence.main(
            ["--task", "mlp", "--optimizer", "muon", "--lr", "0.02", "--steps", "4", "--seeds", "0", "--eval-every", "2", "--mlp-train", "256",
             "--mlp-val", "64", "--mlp-width", "128", "--smooth", "2", "--only", "lowbit fp32,lowbit 8bit,AdamW fp32 (not Muon)",
             "--out-md", str(md), "--out-png", str(png)]
        )  # fmt: skip
    finally:
        convergence.set_lr = set_lr
    rows = {r["label"]: r for r in out["rows"]}
    assert set(rows) == {"lowbit fp32", "lowbit 8bit", "AdamW fp32 (not Muon)"}
    assert all(math.isfinite(r["train_gap_mean"]) for r in rows.values())
    muon_lrs = lrs[0]  # the first step of the first run: Muon's group at --lr, then AdamW's at 2e-3, both warming up
    assert len(muon_lrs) == 2 and muon_lrs[1] == pytest.approx(muon_lrs[0] * 2e-3 / 0.02)
    assert len(lrs) == 3 * 4 and lrs[8] == [pytest.approx(muon_lrs[0] * 2e-3 / 0.02)]  # the third run, AdamW alone: at 2e-3 too
    assert "train gap vs fp32 Muon" in md.read_text()


def test_step_time_optimizer_smoke(eager_lowbit_step):
    """benchmarks/step_time.py --optimizer sgd on a tiny parameter set: ratios to torch.optim.SGD(fused=True);
    lowbit_optim's rows say which step they took."""
    pytest.importorskip("bitsandbytes")
    step_time = import_script("benchmarks/step_time")
    args = step_time.parse_args(["--optimizer", "sgd", "--layers", "1", "--d", "64", "--vocab", "256", "--ctx", "32", "--steps", "1",
                                 "--warmup", "0", "--only", "torch-sgd-fused,bnb-8bit,lowbit-fp32"])  # fmt: skip
    results = {r.label: r for r in step_time.main(args)}
    assert set(results) == {"torch-sgd-fused", "bnb-8bit", "lowbit-fp32"} and results["torch-sgd-fused"].ratio_to_reference == 1.0
    assert all(r.median_step_s > 0 and r.state_bytes_per_param > 0 for r in results.values())
    assert ("compiled step" in results["lowbit-fp32"].note) == (lowbit_optim_sgd_fused_step() is None)


def test_step_time_sets_inductor_config():
    """--inductor KEY=VALUE sets torch._inductor.config (sub-configs by dotted keys); an unknown key,
    a method or sub-config of the config module, a value that is not a literal or not of the
    option's type stops the run with a message naming it."""
    import torch._inductor.config as inductor_config

    step_time = import_script("benchmarks/step_time")
    # restored after the test by the config's own patch: pytest 9.2's monkeypatch.undo deletes a
    # sub-config's option (delattr), and every later compile in the process then fails
    before = (inductor_config.combo_kernels, inductor_config.triton.cudagraphs)
    with inductor_config.patch({"combo_kernels": False, "triton.cudagraphs": False}):
        args = step_time.parse_args(["--inductor", "combo_kernels=True", "--inductor", "triton.cudagraphs=True"])
        assert step_time.set_inductor_config(args.inductor) == {"combo_kernels": True, "triton.cudagraphs": True}
        assert inductor_config.combo_kernels is True and inductor_config.triton.cudagraphs is True
    assert (inductor_config.combo_kernels, inductor_config.triton.cudagraphs) == before
    for bad in ("no_such_option=1", "triton.no_such=1", "combo_kernels", "combo_kernels=yes please", "save_config=1", "triton=1", "combo_kernels='yes'", "combo_kernels=1"):
        with pytest.raises(SystemExit, match="--inductor"):
            step_time.set_inductor_config([bad])


def test_step_time_profile_counts_compiled_calls(tmp_path):
    """--profile on the compiled step (fused=False: one graph call per parameter on the CPU): two
    parameters, two compiled calls per step; nothing launched on a device."""
    step_time = import_script("benchmarks/step_time")
    import lowbit_optim

    params = [torch.nn.Parameter(torch.randn(n)) for n in (71, 100)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = lowbit_optim.AdamW(params, lr=1e-3, state_format="fp32", fused=False)
    optimizer.step()  # compiled here, not under the profiler
    result = step_time.Result("compiled")
    step_time.profile(result, optimizer, torch.device("cpu"), tmp_path)
    assert (result.compiled_calls_per_step, result.launches_per_step, result.device_busy_s) == (2, 0, 0), result
    assert "2 compiled calls, 0 launches" in result.note


def test_step_time_interleaved_smoke(eager_lowbit_step, tmp_path):
    """--interleave: every optimizer built first, then stepped in turn; each row gets its steps and
    its state size, and no peak memory (the optimizers coexist). --profile: each row's note counts
    its calls and launches (none launched on the CPU), and a table of its ops lands in the folder."""
    step_time = import_script("benchmarks/step_time")
    args = step_time.parse_args(["--optimizer", "sgd", "--layers", "1", "--d", "64", "--vocab", "256", "--ctx", "32", "--steps", "2",
                                 "--warmup", "0", "--interleave", "--only", "torch-sgd-fused,lowbit-fp32,lowbit-8bit",
                                 "--profile", str(tmp_path)])  # fmt: skip
    results = step_time.main(args)
    assert [r.label for r in results] == ["torch-sgd-fused", "lowbit-fp32", "lowbit-8bit"] and results[0].ratio_to_reference == 1.0
    assert all(len(r.step_times_s) == 2 and r.state_bytes_per_param > 0 and r.peak_mem_delta_bytes is None for r in results)
    for r in results:
        assert r.launches_per_step == 0 and r.device_busy_s == 0 and "launches" in r.note, r
        assert "Self CPU" in (tmp_path / f"profile_{r.label}.txt").read_text()


@pytest.mark.skipif("avx2" not in (kernel_build.cpuinfo_field("flags") or "").split(), reason="needs an x86 CPU with AVX2")
def test_step_time_as_an_avx2_cpu(tmp_path):
    """--isa avx2 restarts the script with torch's kernels forced to AVX2, in an inductor cache of its
    own, and times the fused kernel built without AVX-512 (benchmarks/as_avx2.py): the JSON records
    which kernels ran."""
    out = tmp_path / "avx2.json"
    argv = ["--isa", "avx2", "--layers", "1", "--d", "16", "--vocab", "64", "--ctx", "8", "--steps", "1", "--warmup", "0",
            "--only", "torch-fused,lowbit-8bit", "--json", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")} | {"TMPDIR": str(tmp_path)}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_time.py"), *argv], env=env, check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert result["torch_cpu_capability"] == "AVX2" and result["config"]["isa"] == "avx2"
    assert "-mno-avx512f" in result["kernel_flags"]
    cache = result["torchinductor_cache_dir"]
    assert cache.startswith(str(tmp_path)) and cache.endswith("_avx2"), "a cache of its own (as_avx2.py says why)"
    assert [r["label"] for r in result["results"]] == ["torch-fused", "lowbit-8bit"]


def lowbit_optim_sgd_fused_step():
    import lowbit_optim

    return lowbit_optim.SGD._fused_step


def test_step_time_muon_smoke(eager_lowbit_step, monkeypatch):
    """--optimizer muon: the blocks' matrices only, ratios to torch.optim.Muon, and the Newton-Schulz
    iterations timed alone (run eagerly here: a smoke test needs no graph)."""
    step_time = import_script("benchmarks/step_time")
    monkeypatch.setattr(step_time.torch, "compile", lambda fn, **kwargs: fn)
    args = step_time.parse_args(["--optimizer", "muon", "--layers", "1", "--d", "32", "--vocab", "64", "--ctx", "16", "--steps", "1",
                                 "--warmup", "0", "--only", "torch-muon,lowbit-8bit,lowbit-8bit-lowrank,newton-schulz"])  # fmt: skip
    results = {r.label: r for r in step_time.main(args)}
    assert set(results) == {"torch-muon", "lowbit-8bit", "lowbit-8bit-lowrank", "newton-schulz"} and results["torch-muon"].ratio_to_reference == 1.0
    assert all(r.median_step_s > 0 for r in results.values()), [r.note for r in results.values()]
    assert results["newton-schulz"].state_bytes_per_param == 0 and results["lowbit-8bit"].state_bytes_per_param > 0


def test_state_precision_rounds_as_a_format_stores(convergence, tmp_path):
    """benchmarks/state_precision.py: a state rounded to 7 mantissa bits, to nearest, after every step
    trains exactly as that state in bf16 (the experiment rounds as a format would store); rounded
    stochastically it trains otherwise; main writes a row per rounding beside the fp32 reference."""
    import lowbit_optim

    precision = import_script("benchmarks/state_precision")
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3e38, 1e-40, 0.0, -0.0, math.inf, math.nan])
    x = torch.cat([torch.randn(4096) * 10.0 ** torch.randint(-30, 30, (4096,)), ties])
    rounded = x.clone()
    precision.round_mantissa(rounded, 7, None)
    converted = x.bfloat16().float()
    assert torch.equal(rounded.isnan(), converted.isnan())  # (NaN payloads aside)
    assert torch.equal(rounded.nan_to_num().view(torch.int32), converted.nan_to_num().view(torch.int32))
    task = convergence.parse_args(["--task", "mlp", "--optimizer", "ademamix", "--steps", "12", "--seeds", "0", "--eval-every", "0",
                                   "--mlp-train", "128", "--mlp-val", "64", "--mlp-width", "32"])  # fmt: skip
    task.state = "exp_avg_sq"
    data = convergence.make_mlp_dataset(task)
    kwargs = convergence.OPTIMIZERS["ademamix"].kwargs(task)
    bf16_state = {"exp_avg": "fp32", "exp_avg_slow": "fp32", "exp_avg_sq": "bf16"}
    bf16 = convergence.OptimizerSpec("bf16", lambda params, lr, weight_decay, **_: lowbit_optim.AdEMAMix(params, lr=lr, weight_decay=weight_decay, state_format=bf16_state, **kwargs), True)  # fmt: skip

    def losses(spec):
        return convergence.train_run_mlp(spec, data, task, 0, task.lr, task.betas, 1e-8, task.steps, 0)["train_losses"]

    reference = losses(bf16)
    assert losses(precision.spec("7rn", task, "7rn")) == reference
    assert losses(precision.spec("7sr", task, "7sr")) != reference
    p = torch.nn.Parameter(torch.randn(64, 128))  # --others: the other states' formats, the rounded one in fp32
    p.grad = torch.randn_like(p)
    beside = precision.spec("7rn", task, "7rn", {"exp_avg": "8bit-linear"}).make([p], lr=1e-3, weight_decay=0.0)
    beside.step()
    state = beside.state[p]
    assert type(state["exp_avg"]) is lowbit_optim.get_format("8bit-linear") and type(state["exp_avg_slow"]) is type(state["exp_avg_sq"]) is torch.Tensor
    md = tmp_path / "precision.md"
    out = precision.main(["--steps", "4", "--seeds", "0", "--rounding", "7sr,10rn", "--out-md", str(md)])
    assert [r["label"] for r in out["rows"]] == ["lowbit fp32", "exp_avg_sq 7-bit mantissa sr", "exp_avg_sq 10-bit mantissa rn"]
    text = md.read_text()
    assert text.startswith("# State precision: AdEMAMix with `exp_avg_sq` rounded") and "| exp_avg_sq 10-bit mantissa rn |" in text
    with pytest.raises(SystemExit):
        precision.main(["--state", "exp_avg_slow", "--optimizer", "adamw", "--steps", "1", "--out-md", str(md)])


def test_state_precision_block_float_grid():
    """state_precision.py's <M>bf<E>: every value lands on its spacing's grid next to where it was
    (the spacing of its binade, at least that of its block's largest exponent less 2**E - 1), zeros
    and non-finite values stay, and the rounding is unbiased over draws."""
    precision = import_script("benchmarks/state_precision")
    assert precision.parse_rounding("7bf3") == (7, "bf", 3) and precision.parse_rounding("7bf") is None and precision.parse_rounding("7bf9") is None
    generator = torch.Generator().manual_seed(0)
    block = torch.ldexp(torch.rand(precision.BLOCK, generator=generator) + 0.5, torch.arange(precision.BLOCK) % 24 - 20)  # 2**-21 .. 2**3
    block[:3] = torch.tensor([0.0, -1.5, math.inf])
    x = torch.cat([block, torch.full((10,), -3e-3)])  # a second block, padded
    mantissa_bits, exponent_bits = 3, 2
    tops = [max(math.floor(math.log2(abs(v))) for v in values.tolist() if v and math.isfinite(v)) for values in (block, x[precision.BLOCK :])]
    exponent = torch.frexp(x).exponent - 1
    lowest = torch.cat([torch.full((precision.BLOCK,), tops[0]), torch.full((10,), tops[1])]) - (2**exponent_bits - 1)
    spacing = torch.ldexp(torch.ones_like(x), torch.maximum(exponent, lowest) - mantissa_bits).double()
    finite = torch.isfinite(x)
    total = torch.zeros_like(x, dtype=torch.float64)
    draws = 400
    for _ in range(draws):
        y = x.clone()
        precision.round_block_float(y, mantissa_bits, exponent_bits, generator)
        assert y[2] == math.inf and y[0] == 0.0
        steps = y[finite].double() / spacing[finite]
        assert torch.equal(steps, steps.round()) and bool(((y[finite].double() - x[finite].double()).abs() < spacing[finite]).all())
        total += y.double()
    bias = (total[finite] / draws - x[finite].double()).abs() / spacing[finite]
    assert float(bias.max()) < 0.15  # the mean of 400 draws within 0.15 spacings (sd <= 0.025)


@pytest.mark.parametrize("rounding", ["1lg", "1rs", "1bl0"])
def test_state_precision_unbiased_in(rounding):
    """state_precision.py's <M>lg, <M>rs and <M>bl<E>: a value between two grid values rounds up with
    the probability that leaves f of the result unbiased (log; 1/sqrt), not the one that leaves the
    value unbiased; zeros and non-finite values stay, and bl rounds no positive value down to 0."""
    precision = import_script("benchmarks/state_precision")
    mantissa_bits, kind, exponent_bits = precision.parse_rounding(rounding)
    n = 40 * precision.BLOCK
    x = torch.full((n,), 1.25)  # between 1 and 1.5 on a grid of 1 mantissa bit (the block's too)
    x[:3] = torch.tensor([0.0, math.inf, 1.25 * 2.0**-8])  # the last below bl0's one binade
    generator = torch.Generator().manual_seed(0)
    if kind == "bl":
        precision.round_block_float(x, mantissa_bits, exponent_bits, generator, log=True)
    else:
        precision.round_mantissa_unbiased_in(x, mantissa_bits, kind, generator)
    assert x[0] == 0.0 and x[1] == math.inf
    assert x[2] == 0.5 if kind == "bl" else float(x[2]) in (2.0**-8, 1.5 * 2.0**-8)  # bl: up to its lowest spacing, never 0
    rest = x[3:]
    assert bool(((rest == 1.0) | (rest == 1.5)).all())
    f = math.log if kind in ("lg", "bl") else lambda v: v**-0.5
    p = (f(1.25) - f(1.0)) / (f(1.5) - f(1.0))  # 0.550 (log), 0.575 (1/sqrt); 0.5 keeps 1.25 unbiased
    assert abs(float((rest == 1.5).double().mean()) - p) < 0.01  # sd of the share: 0.0025


def test_state_precision_low_discrepancy_draws():
    """state_precision.py's ld rounding: a value whose dropped fraction stays f rounds up in f of
    the steps to within a few steps, for every element (independent draws, sr, stray by about
    sqrt(steps)); the draws are the dropped bits' width."""
    precision = import_script("benchmarks/state_precision")
    steps, bits = 1000, 7
    fraction = torch.rand(512, generator=torch.Generator().manual_seed(0))
    x = 1 + (fraction * 2**16).floor() * 2**-23  # 16 dropped bits of 7-bit mantissas: the fraction
    exact = (x.view(torch.int32) & 0xFFFF).double() / 2**16
    ups = {}
    for kind in ("ld", "sr"):
        draws, ups[kind] = precision.draw_source(f"{bits}{kind}", bits), torch.zeros_like(x)
        for step in range(1, steps + 1):
            d = draws(step, "p", x)
            assert d.dtype == torch.int32 and int(d.min()) >= 0 and int(d.max()) < 2**16
            rounded = x.clone()
            precision.round_mantissa(rounded, bits, d)
            ups[kind] += rounded > 1
    assert float((ups["ld"] - exact * steps).abs().max()) <= 3
    assert float((ups["sr"] - exact * steps).abs().max()) > 10


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("convergence", ["--optimizer", "sgd", "--sweep"], "--sweep varies AdamW's eps and betas over the AdamW rows: run it without --optimizer"),
        ("memory", ["--only", "8bit,4bit"], r"--only: unknown label\(s\) \['8bit,4bit'\]; the labels, separated by ';'"),
        ("compute_bound", ["--dram-elements", str(2**18)], "--dram-elements must be more than 1024 and another size than the in-cache one"),
        ("compute_bound", ["--dram-elements", "1024"], "--dram-elements must be more than 1024"),
        ("default_vs_compiled", ["--formats", "8bitt"], r"--formats: unknown \['8bitt'\]; use some of fp32, bf16"),
    ],
    ids=["convergence-sweep-optimizer", "memory-only", "compute_bound-in-cache", "compute_bound-1024", "default_vs_compiled-formats"],
)
def test_benchmark_arguments_that_would_measure_nothing_or_crash_are_refused(script, argv, message, capsys):
    """Arguments that ran every sweep cell alike, ran nothing, divided by zero or timed a typo as a
    refused format: refused, naming the argument, before anything is measured."""
    if script == "convergence":
        pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as exit_info:
        import_script(f"benchmarks/{script}").main(argv)
    said = str(exit_info.value.code) + capsys.readouterr().err  # argparse's error: on stderr, exit code 2
    assert re.search(message, said), said
