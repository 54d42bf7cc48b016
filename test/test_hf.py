"""Hugging Face Trainer and Accelerate: training, checkpoints and exact resumes keep the low-bit state.

The Trainer tests run examples/hf_trainer.py's tiny GPT-2 (2 layers, d_model 64, bytes as tokens), but
MuonWithAdamW's, which needs nn.Linear layers (a tiny Llama).
The FSDP2 test runs this file as a 2-process job (gloo), see ``_fsdp2_job``.
"""

import functools
import gc
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, import_script, torch_threads

import lowbit_optim

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402

from lowbit_optim.hf import optimizer_cls_and_kwargs  # noqa: E402

example = import_script("examples/hf_trainer")


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's ops gain nothing from a second thread, which under ``-n 2`` would wait for the
    core the other worker holds (a Trainer test took 55-63 s with 2 threads, 5 s with 1; conftest.py
    gives xdist's workers their share anyway)."""
    with torch_threads(1):
        yield


def _trainer(output_dir, *flags, optimizer=None):
    args = example.parse_args(["--output-dir", str(output_dir), "--steps", "20", "--save-steps", "10", "--logging-steps", "10", "--quiet", *flags])
    return example.build_trainer(args, optimizer)


def _params(module) -> dict:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"differ after resuming: {different}"


def _check_states(optimizer, fmt: str) -> None:
    """Embeddings keep fp32 state (the helper's default); the other weights ``fmt``'s state class."""
    cls = lowbit_optim.get_format(fmt)
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name in ("exp_avg", "exp_avg_sq"):
                state = optimizer.state[p][name]
                quantized = group["state_format"] == fmt and p.numel() >= group["min_quantize_numel"]
                assert isinstance(state, cls) if quantized else type(state) is torch.Tensor, (tuple(p.shape), name, type(state))
    assert any(group["state_format"] == fmt and len(group["params"]) > 1 for group in optimizer.param_groups)


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_trainer_resume_is_exact(tmp_path, fmt):
    full = _trainer(tmp_path / "full", "--state-format", fmt)
    full.train()
    part = _trainer(tmp_path / "part", "--state-format", fmt, "--stop-after", "10")
    part.train()
    assert part.state.global_step == 10
    # Trainer's own checkpoint, read as Trainer reads it: the states on disk are low-bit
    saved = torch.load(tmp_path / "part" / "checkpoint-10" / "optimizer.pt", weights_only=True)
    assert any(isinstance(s["exp_avg"], lowbit_optim.get_format(fmt)) for s in saved["state"].values())

    resumed = _trainer(tmp_path / "part", "--state-format", fmt)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 20
    _assert_same(_params(resumed.model), _params(full.model))  # bit for bit: data order, RNG, lr schedule, states
    _check_states(resumed.optimizer.optimizer, fmt)  # Trainer's optimizer is accelerate's wrapper


def test_example_takes_every_format_name_and_pairs_factored(tmp_path, capsys):
    """--state-format takes the registered names (a typo is a usage error, not a traceback) and
    factored, which holds second moments only, beside a 4bit first moment, as the other examples."""
    with pytest.raises(SystemExit):
        example.parse_args(["--state-format", "8bitt"])
    assert "invalid choice: '8bitt'" in capsys.readouterr().err
    trainer = _trainer(tmp_path, "--state-format", "factored")
    trainer.create_optimizer()
    formats = [group["state_format"] for group in trainer.optimizer.param_groups]
    assert {"exp_avg": "4bit", "exp_avg_sq": "factored"} in formats


def test_helper_takes_training_arguments(tmp_path):
    trainer = _trainer(tmp_path)
    model, args = trainer.model, trainer.args
    trainer.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs(model, args, state_format="4bit", eps=1e-6)
    opt = trainer.create_optimizer()
    assert type(opt) is lowbit_optim.AdamW
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len(set(params)) == len(list(model.parameters()))
    decayed = {p for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    named = dict(model.named_parameters(remove_duplicate=False))  # GPT-2 ties lm_head to wte
    assert decayed == {named[n] for n in trainer.get_decay_parameter_names(model)}  # Trainer's own split
    for g in opt.param_groups:
        assert g["lr"] == args.learning_rate and g["betas"] == (args.adam_beta1, args.adam_beta2) and g["eps"] == 1e-6
        assert g["weight_decay"] in (0.0, args.weight_decay)
        embedding = any(p is model.transformer.wte.weight or p is model.transformer.wpe.weight for p in g["params"])
        assert g["state_format"] == ("fp32" if embedding else "4bit")
    # read when Trainer builds the optimizer: a hyperparameter search sets each trial's on these args
    args.learning_rate, args.weight_decay = 1e-4, 0.0
    trainer.optimizer = None  # (Trainer builds one once)
    assert {(g["lr"], g["weight_decay"]) for g in trainer.create_optimizer().param_groups} == {(1e-4, 0.0)}


def test_helper_refuses_step_in_backward_where_trainer_uses_gradients():
    """Trainer accumulates and clips gradients after backward; the step in backward has used them."""
    from types import SimpleNamespace

    model = torch.nn.Linear(4, 4)
    args = SimpleNamespace(learning_rate=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                           gradient_accumulation_steps=1, max_grad_norm=0.0)  # fmt: skip
    factory, kwargs = optimizer_cls_and_kwargs(model, args, step_in_backward=True, max_grad_norm=1.0)
    assert factory()(model, **kwargs)._step_in_backward  # as Trainer builds it
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4 backward passes per step"):
        optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "gradient_accumulation_steps": 4}), step_in_backward=True)
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0\), when step_in_backward=True .*max_grad_norm=0"):
        optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "max_grad_norm": 1.0}), step_in_backward=True)
    with pytest.raises(ValueError, match=r"fp16=True\) scales the loss with a GradScaler .* use bf16=True"):
        optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "fp16": True}), step_in_backward=True)
    # the flag in a partial, or no args to check: refused too (Trainer stepped at every micro-batch)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4 backward passes per step"):
        partial = functools.partial(lowbit_optim.AdamW, step_in_backward=True)
        optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "gradient_accumulation_steps": 4}), optimizer_cls=partial)
    with pytest.raises(ValueError, match="step_in_backward=True needs args, the TrainingArguments"):
        optimizer_cls_and_kwargs(model, step_in_backward=True)
    with pytest.raises(ValueError, match=r"2 processes without FSDP .* drift apart: step after backward"):
        optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "world_size": 2}), step_in_backward=True)
    optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "world_size": 2, "fsdp": True}), step_in_backward=True)
    with pytest.raises(ValueError, match=r"FSDP version 1 accumulates gradients into flat parameters: set fsdp_config=\{'version': 2\}"):
        optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "world_size": 2, "fsdp": True, "fsdp_config": {"version": 1}}), step_in_backward=True)
    with pytest.MonkeyPatch.context() as launched:  # accelerate launch --use_fsdp, whose plugin's version defaults to 1
        launched.setenv("ACCELERATE_USE_FSDP", "true")
        with pytest.raises(ValueError, match="FSDP version 1"):
            optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "world_size": 2}), step_in_backward=True)
        launched.setenv("FSDP_VERSION", "2")
        optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "world_size": 2}), step_in_backward=True)
        launched.setenv("ACCELERATE_USE_FSDP", "1")  # accelerate's Accelerator shards only for "true"
        with pytest.raises(ValueError, match=r"2 processes without FSDP"):
            optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "world_size": 2}), step_in_backward=True)
    optimizer_cls_and_kwargs(model, SimpleNamespace(**{**vars(args), "world_size": 2, "parallelism_config": SimpleNamespace(dp_shard_size=2)}), step_in_backward=True)
    with pytest.raises(ValueError, match=r"max_grad_norm here clips in backward, for step_in_backward=True; .* TrainingArguments\(max_grad_norm"):
        optimizer_cls_and_kwargs(model, args, max_grad_norm=1.0)
    # a setting changed after the helper (a hyperparameter search's trial) is refused when Trainer builds it
    changing = SimpleNamespace(**vars(args))
    factory, kwargs = optimizer_cls_and_kwargs(model, changing, step_in_backward=True)
    changing.gradient_accumulation_steps = 4
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4 backward passes per step"):
        factory()(model, **kwargs)


@pytest.mark.parametrize("cls", [lowbit_optim.SGD, lowbit_optim.Lion, lowbit_optim.AdEMAMix])
def test_helper_builds_other_optimizers(tmp_path, cls):
    """TrainingArguments' lr and weight decay reach any optimizer; its Adam betas and eps reach only
    Adam's family (Lion's betas mean something else, SGD has none)."""
    trainer = _trainer(tmp_path)
    extra = {"momentum": 0.9} if cls is lowbit_optim.SGD else {}
    trainer.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs(trainer.model, trainer.args, optimizer_cls=cls, state_format="8bit", **extra)
    opt = trainer.create_optimizer()
    assert type(opt) is cls
    defaults = cls(trainer.model.parameters()).defaults
    for g in opt.param_groups:
        assert g["lr"] == trainer.args.learning_rate and g["weight_decay"] in (0.0, trainer.args.weight_decay)
        assert g.get("betas") == defaults.get("betas") and g.get("eps") == defaults.get("eps")
        assert g.get("momentum") == extra.get("momentum", defaults.get("momentum"))


class SGDWithoutDecay(lowbit_optim.SGD):
    """An optimizer of one's own whose constructor takes no weight_decay."""

    def __init__(self, params, lr=1e-3, momentum=0.0):
        super().__init__(params, lr=lr, momentum=momentum, state_format="8bit")


class SignSGD(lowbit_optim.LowBitOptimizer):
    """One written as examples/custom_optimizer.py is: its hyperparameters, then **options for
    LowBitOptimizer, which refuse weight_decay."""

    step_function = staticmethod(lowbit_optim.functional.sgd_step)
    states = ()

    def __init__(self, params, lr=1e-3, **options):
        super().__init__(params, dict(lr=lr), **options)


class AdamWPassingKeywords(lowbit_optim.AdamW):
    def __init__(self, params, **kwargs):
        super().__init__(params, state_format="8bit", **kwargs)


def test_helper_builds_an_optimizer_without_weight_decay(tmp_path):
    """TrainingArguments' weight decay is not passed to an optimizer that takes none (its lr is), with
    a warning that names it dropped. One whose **options go to LowBitOptimizer (SignSGD) had been
    passed it, which they refuse: Trainer could not build it."""
    trainer = _trainer(tmp_path)
    with pytest.warns(UserWarning, match="is not passed to SGDWithoutDecay"):  # (its weight decay dropped, said)
        factory, kwargs = optimizer_cls_and_kwargs(trainer.model, trainer.args, optimizer_cls=SGDWithoutDecay, momentum=0.9)
    opt = factory()(trainer.model, **kwargs)
    assert all(g["lr"] == trainer.args.learning_rate and g["momentum"] == 0.9 and g["weight_decay"] == 0.0 for g in opt.param_groups)
    with pytest.warns(UserWarning, match=rf"weight_decay \({trainer.args.weight_decay}\) is not passed to SignSGD"):
        factory, kwargs = optimizer_cls_and_kwargs(trainer.model, trainer.args, optimizer_cls=SignSGD)
    assert all("weight_decay" not in g for g in factory()(trainer.model, **kwargs).param_groups)
    # one that passes **kwargs on takes weight_decay: args' for matrices, none for biases and norms
    factory, kwargs = optimizer_cls_and_kwargs(trainer.model, trainer.args, optimizer_cls=AdamWPassingKeywords)
    opt = factory()(trainer.model, **kwargs)
    assert {g["weight_decay"] for g in opt.param_groups} == {trainer.args.weight_decay, 0.0} != {lowbit_optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]}


def test_trainer_with_model_init_steps_the_model_it_trains(tmp_path):
    """Trainer(model_init=...) builds its model in train(): the helper's groups are that model's (a
    factory Trainer calls with it), not those of the model the helper was given."""

    trainer = _trainer(tmp_path, "--steps", "2")
    model_init = functools.partial(copy_of, trainer.model)
    helper = optimizer_cls_and_kwargs(model_init(), trainer.args, state_format="8bit")
    initial = _params(trainer.model)
    from transformers import Trainer

    fresh = Trainer(model_init=model_init, args=trainer.args, train_dataset=trainer.train_dataset, optimizer_cls_and_kwargs=helper)
    fresh.train()
    stepped = {id(p) for g in fresh.optimizer.param_groups for p in g["params"]}
    assert all(id(p) in stepped for p in fresh.model.parameters() if p.requires_grad)
    after = _params(fresh.model)
    assert any(not torch.equal(after[n], initial[n]) for n in initial)  # it trained


def copy_of(model):
    import copy

    return copy.deepcopy(model)


def test_helper_takes_a_partial_and_refuses_what_it_cannot_build():
    from types import SimpleNamespace

    model = torch.nn.Linear(4, 4)
    factory, kwargs = optimizer_cls_and_kwargs(model, optimizer_cls=functools.partial(lowbit_optim.Lion, state_format="8bit"), lr=1e-4)
    opt = factory()(model, **kwargs)
    assert type(opt) is lowbit_optim.Lion and {g["state_format"] for g in opt.param_groups} == {"8bit"}
    # what a partial binds wins over TrainingArguments, as keywords do
    args = SimpleNamespace(learning_rate=5e-5, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8)
    bound = functools.partial(lowbit_optim.AdamW, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    factory, kwargs = optimizer_cls_and_kwargs(model, args, optimizer_cls=bound)
    group = factory()(model, **kwargs).param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"], group["eps"]) == (1e-3, (0.9, 0.95), 0.1, 1e-8)
    with pytest.raises(TypeError, match=r"from transformers 5.23 on .* factory\(\)\(model, \*\*kwargs\)"):
        factory(list(model.parameters()), **kwargs)  # as transformers < 5.23 would call it
    with pytest.raises(AttributeError, match=r"'step': this is the optimizer factory .* Trainer\(optimizer_cls_and_kwargs=...\), not as optimizers="):
        factory.step()  # the pair passed as Trainer(optimizers=...)
    with pytest.raises(TypeError, match=r"MuonWithAdamW splits a model .* optimizers=\(lowbit_optim.MuonWithAdamW\(model, ...\), None\)"):
        optimizer_cls_and_kwargs(model, optimizer_cls=lowbit_optim.MuonWithAdamW)
    with pytest.raises(TypeError, match="optimizer_cls must be an optimizer class or a functools.partial of one"):
        optimizer_cls_and_kwargs(model, optimizer_cls=lambda params, **kw: lowbit_optim.AdamW(params, **kw))
    with pytest.raises(TypeError, match=r"args must be the TrainingArguments \(or None\), got <class .*AdamW8bit'>: pass the optimizer as optimizer_cls="):
        optimizer_cls_and_kwargs(model, lowbit_optim.AdamW8bit)  # (accepted, it failed inside Trainer)


def test_helper_refuses_another_libraries_optimizer_and_warns_without_args():
    """torch.optim.AdamW would ignore the groups' formats and get TrainingArguments' lr but not its
    betas and eps: refused. Without args (and lr) the optimizer would run at its default lr, not
    Trainer's: a warning (none with args or lr)."""
    import warnings

    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"optimizer_cls must be a lowbit_optim optimizer .* got torch.optim.adamw.AdamW"):
        optimizer_cls_and_kwargs(model, lr=1e-3, optimizer_cls=torch.optim.AdamW)
    with pytest.warns(UserWarning, match=r"without args \(the TrainingArguments\): the optimizer takes AdamW's default lr"):
        optimizer_cls_and_kwargs(model, state_format="8bit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer_cls_and_kwargs(model, state_format="8bit", lr=1e-3)
        optimizer_cls_and_kwargs(model, optimizer_cls=functools.partial(lowbit_optim.Lion, lr=1e-4))


def test_an_overrides_weight_decay_holds_for_parameters_of_every_dimension():
    """Biases and norm weights get no weight decay, unless an override gives their module its own."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    factory, kwargs = optimizer_cls_and_kwargs(model, lr=1e-3, weight_decay=0.1, overrides={torch.nn.LayerNorm: {"weight_decay": 0.05}})
    decay = {p: g["weight_decay"] for g in factory()(model, **kwargs).param_groups for p in g["params"]}
    assert [decay[p] for p in model.parameters()] == [0.1, 0.0, 0.05, 0.05]


def _llama_trainer(output_dir, stop_at: int | None = None):
    """A tiny Llama (nn.Linear projections, which MuonWithAdamW gives Muon; GPT-2's Conv1D it cannot)
    under Trainer(optimizers=(MuonWithAdamW(model, ...), None)), the helper's suggestion for it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=16)  # fmt: skip
    model = LlamaForCausalLM(config)
    opt = lowbit_optim.MuonWithAdamW(model, muon=dict(lr=0.02), adamw=dict(lr=3e-3), state_format="8bit", min_quantize_numel=0, compile=False)
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in tokens]
    args = TrainingArguments(output_dir, max_steps=6, save_steps=3, per_device_train_batch_size=8, report_to=[], disable_tqdm=True, use_cpu=True)
    return Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None), callbacks=[example.StopAfter(stop_at)] if stop_at else None)


def test_trainer_resumes_muon_with_adamw_exactly(tmp_path):
    """MuonWithAdamW passed to Trainer as the helper says: Trainer saves its {'muon', 'adamw'} state
    dict in optimizer.pt, low-bit, and a resumed run ends with an uninterrupted one's parameters."""
    full = _llama_trainer(tmp_path / "full")
    full.train()
    part = _llama_trainer(tmp_path / "part", stop_at=3)
    part.train()
    saved = torch.load(tmp_path / "part" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert isinstance(next(iter(saved["muon"]["state"].values()))["momentum_buffer"], lowbit_optim.OptimState8bit)
    resumed = _llama_trainer(tmp_path / "part")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    _assert_same(_params(resumed.model), _params(full.model))


def _steps(model, opt, accelerator, n: int) -> None:
    for _ in range(n):
        accelerator.backward(model(torch.randn(8, 64)).square().mean())
        opt.step()
        opt.zero_grad()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))


def _mixed_formats(model) -> lowbit_optim.AdamW:
    # two formats in two groups: accelerate must keep each group's
    return lowbit_optim.AdamW([{"params": model[0].parameters(), "state_format": "4bit"}, {"params": model[2].parameters()}], lr=1e-2, state_format="8bit")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _check_mixed_formats(opt) -> None:
    weights = [g["params"][0] for g in opt.param_groups]
    assert [type(_local(opt.state[w]["exp_avg"])) for w in weights] == [lowbit_optim.OptimState4bit, lowbit_optim.OptimState8bit]


def _muon_with_adamw(model) -> lowbit_optim.MuonWithAdamW:
    # Muon on the first weight, AdamW (4bit) on the rest: two optimizers behind one, in one checkpoint
    return lowbit_optim.MuonWithAdamW(model, head="2", muon=dict(lr=2e-2), adamw=dict(lr=1e-2, state_format="4bit"), state_format="8bit")


def _check_muon_with_adamw(opt) -> None:
    (matrix,), head = opt.muon.param_groups[0]["params"], max(opt.adamw.param_groups[0]["params"], key=torch.Tensor.numel)
    assert type(_local(opt.state[matrix]["momentum_buffer"])) is lowbit_optim.OptimState8bit
    assert type(_local(opt.state[head]["exp_avg"])) is lowbit_optim.OptimState4bit


def _save_step_load(model, opt, accelerator, checkpoint, full=lambda t: t, check=_check_mixed_formats) -> None:
    """save_state, 2 steps, load_state, the same 2 steps (load_state restores the RNG): same bits."""
    _steps(model, opt, accelerator, 3)
    accelerator.save_state(checkpoint)
    saved = {n: full(p) for n, p in _params(model).items()}
    _steps(model, opt, accelerator, 2)
    after = {n: full(p) for n, p in _params(model).items()}
    accelerator.load_state(checkpoint)
    check(opt.optimizer)
    _assert_same({n: full(p) for n, p in _params(model).items()}, saved)
    _steps(model, opt, accelerator, 2)
    _assert_same({n: full(p) for n, p in _params(model).items()}, after)


def test_accelerate_prepare_keeps_state_format(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = _mlp()
    model, opt = accelerator.prepare(model, _mixed_formats(model))
    _save_step_load(model, opt, accelerator, tmp_path / "checkpoint")
    assert isinstance(opt.state_dict()["state"][0]["exp_avg"], lowbit_optim.OptimState4bit)


_FSDP2_CASES = {"mixed_formats": (_mixed_formats, _check_mixed_formats), "muon_with_adamw": (_muon_with_adamw, _check_muon_with_adamw)}


def _fsdp2_job(checkpoint: str, case: str) -> None:
    """One rank: accelerate's FSDP2 prepare, steps, save_state (DCP) and load_state, on CPU, of an
    AdamW with two formats or of a MuonWithAdamW (one optimizer to accelerate, two inside).

    accelerate ignores ``fsdp_plugin`` on CPU (its FSDP is for MULTI_GPU and the like; MULTI_CPU gets
    DDP), so the job overrides ``Accelerator.distributed_type``: everything else is accelerate's own
    FSDP2 code (fully_shard, swapping the optimizer's parameters, sharded checkpoints). One case per
    job: a second prepare() in the process took FSDP1's path."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.tensor import DTensor

    build, check = _FSDP2_CASES[case]
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    Accelerator.distributed_type = property(lambda self: DistributedType.FSDP)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    accelerator.state.distributed_type, accelerator.state.fsdp_plugin = DistributedType.FSDP, plugin  # what prepare() reads
    model = _mlp()
    model, opt = accelerator.prepare(model, build(model))
    if not isinstance(model[0].weight, DTensor):
        open(os.path.join(checkpoint, "not_sharded"), "w").close()  # the test skips: torchrun hides exit codes
        return
    _save_step_load(model, opt, accelerator, checkpoint, full=DTensor.full_tensor, check=check)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("case", _FSDP2_CASES)
def test_accelerate_fsdp2_keeps_state_format(tmp_path, case):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "test"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, str(tmp_path), case]
    job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-5000:] + job.stderr[-5000:]
    if (tmp_path / "not_sharded").exists():
        pytest.skip("this accelerate version did not shard the model under its FSDP2 path on CPU")


if __name__ == "__main__":  # one rank of test_accelerate_fsdp2_keeps_state_format: test_hf.py CHECKPOINT_DIR CASE
    _fsdp2_job(sys.argv[1], sys.argv[2])
    # The job's objects hold gloo process groups in reference cycles. Left to the interpreter's
    # final collection, a group's destructor ran while Python was finalizing, and its worker thread,
    # stopped there by Python, aborted the process ("terminate called without an active
    # exception" in pt_gloo_runloop: 1 run in 2 to 6 on an AMD EPYC family 26). Free them first.
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_a_checkpoint_of_trainers_own_optimizer_needs_its_two_groups():
    """Trainer's AdamW has two groups (with and without weight decay); the helper's default adds one
    for embeddings: loading is refused with the fix, which then loads (quantizing the states)."""
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    trainers = torch.optim.AdamW([{"params": decayed}, {"params": [model[1].bias], "weight_decay": 0.0}])
    model(torch.arange(8)).sum().backward()
    trainers.step()
    factory, kwargs = optimizer_cls_and_kwargs(model, state_format="8bit", lr=1e-3)
    with pytest.raises(ValueError, match=r"the checkpoint has 2 param groups and this optimizer 3: .* overrides=\{\}"):
        factory()(model, **kwargs).load_state_dict(trainers.state_dict())
    factory, kwargs = optimizer_cls_and_kwargs(model, state_format="8bit", overrides={}, lr=1e-3)
    opt = factory()(model, **kwargs)
    opt.load_state_dict(trainers.state_dict())
    assert opt.state[model[0].weight]["exp_avg"].shape == (8, 4)
