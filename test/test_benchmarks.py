"""Smoke tests of the accuracy benchmarks (benchmarks/convergence.py, benchmarks/state_error.py) and of
benchmarks/compute_bound.py: each main function runs on a tiny configuration, writes its files, and
reports finite numbers."""

import math

import pytest

from conftest import import_script

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
    out = state_error.main([*TINY, "--snapshots", "2,5", "--formats", "8bit,4bit,factored", "--out-md", str(md)])
    labels = ("8bit", "4bit", "4bit+factored")  # factored (second moments only) beside a 4bit first moment
    assert {(r["step"], r["format"]) for r in out["rows"]} == {(s, f) for s in (2, 5) for f in labels}
    for r in out["rows"]:
        assert all(math.isfinite(v) and v >= 0 for v in (*r["m"], *r["v"], *r["update"]))
        assert 0 <= r["v_zero"] <= 1 and 0 < r["kept"] <= 1
    text = md.read_text()
    assert text.count("| 8bit |") == 2 and text.count("| 4bit |") == 2


def test_compute_bound_smoke():
    compute_bound = import_script("benchmarks/compute_bound")
    out = compute_bound.main(["--elements", "65536", "--dram-elements", "65536", "--max-divisions", "1", "--formats", "8bit,4bit"])
    # per-element times are differences (a step less a 1024-element step): at these tiny sizes, on a
    # busy machine, only their finiteness is a fact
    assert all(math.isfinite(ns) for ns in out["adamw_ns"].values()) and out["copy_gb_s"] > 0
    assert set(out["kernel_ns"]) == {"8bit", "4bit"} and all(math.isfinite(ns) for sizes in out["kernel_ns"].values() for ns in sizes.values())
    assert out["divider_s"] is None or (set(out["divider_s"]) == {0, 1} and all(s > 0 for s in out["divider_s"].values()))
