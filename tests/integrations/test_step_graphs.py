"""``ObjectiveTrainer(step_graphs=True)``: each training step one `cat_fast.step.CapturedStep` (on the CPU run
eagerly through the same plan): the Trainer's results, its refusals, and a non-finite step left unapplied."""
import pytest
import torch

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate>=1.1.0 (and psutil)")
datasets = pytest.importorskip("datasets")

from transformers import TrainingArguments  # noqa: E402

from cat_fast.integrations import NonFiniteLossError, ObjectiveTrainer  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.integrations.test_trainer import tiny_dataset  # noqa: E402


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                dataloader_num_workers=0, max_grad_norm=1.0, optim="adamw_torch_fused", warmup_steps=1)
    return TrainingArguments(**{**base, **kw})


def _train(tmp_path, objective, objective_kwargs, step_graphs, **kw):
    torch.manual_seed(0)
    model = tiny_model("bert", num_labels=2).train()
    trainer = ObjectiveTrainer(model=model, args=_args(tmp_path, **kw), train_dataset=tiny_dataset(),
                               objective=objective, objective_kwargs=objective_kwargs, step_graphs=step_graphs)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("objective,kwargs", [("erm", {}), ("cat", {"layers": [1, 2], "warmup_steps": 1}),
                                              ("cat", {"layers": [2], "generator": 5}), ("clp", {})])
def test_step_graphs_train_as_the_trainer(tmp_path, objective, kwargs):
    """The same losses and parameters as the Trainer's own step (forward, backward, clipping, AdamW, the linear
    schedule), dropout and CAT's draws included; the gradient norm is logged; the optimizer is a fused AdamW with a
    tensor learning rate that the schedule moves."""
    runs = []
    for step_graphs in (False, True):
        kw = dict(kwargs)
        if "generator" in kw:
            kw["generator"] = torch.Generator().manual_seed(kw["generator"])
        if objective == "clp":  # its virtual step takes the optimizer's (scheduled) learning rate
            data = tiny_dataset()
            kw["meta_batches"] = [{k: torch.tensor(data[k][:4]) for k in ("input_ids", "attention_mask", "labels")}]
            kw["epoch_size"] = 8
        runs.append(_train(tmp_path / str(step_graphs), objective, kw, step_graphs))
    (plain, want, want_params), (trainer, got, got_params) = runs
    assert len(got) == 4 and len(set(got)) > 1
    assert got == pytest.approx(want, rel=1e-5)
    for n in want_params:
        torch.testing.assert_close(got_params[n], want_params[n], rtol=1e-5, atol=1e-6, msg=n)
    raw = trainer.optimizer.optimizer
    assert all(g["fused"] for g in raw.param_groups) and isinstance(raw.param_groups[0]["lr"], torch.Tensor)
    assert float(raw.param_groups[0]["lr"]) == 0.0  # 1e-3 at the start: the linear schedule's end, filled in place
    norms = [h["objective/grad_norm"] for h in trainer.state.log_history if "objective/grad_norm" in h]
    assert len(norms) == 4 and all(v > 0 for v in norms)
    # the logged learning rate, computed on the host while steps are captured: the schedule's, as logged eagerly
    rates = [[h["learning_rate"] for h in t.state.log_history if "learning_rate" in h] for t in (plain, trainer)]
    assert len(rates[1]) == 4 and rates[1] == pytest.approx(rates[0], rel=1e-6)
    # the norm before clipping, as the Trainer's own step logs it
    assert norms == pytest.approx([h["grad_norm"] for h in plain.state.log_history if "grad_norm" in h], rel=1e-4)


def test_step_graphs_refuse_what_they_cannot_replay(tmp_path):
    model = tiny_model("bert", num_labels=2).train()
    cases = [(dict(gradient_accumulation_steps=2), "erm", {}, "gradient_accumulation_steps"),
             (dict(optim="sgd"), "erm", {}, "fused AdamW"),
             ({}, "erm-two-step", {}, "inner optimizer step")]
    for i, (kw, objective, okw, match) in enumerate(cases):
        trainer = ObjectiveTrainer(model=model, args=_args(tmp_path / str(i), **kw), train_dataset=tiny_dataset(),
                                   objective=objective, objective_kwargs=okw, step_graphs=True)
        with pytest.raises(ValueError, match=match):
            trainer.train()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = ObjectiveTrainer(model=model, args=_args(tmp_path / "given"), train_dataset=tiny_dataset(),
                               objective="erm", optimizers=(plain, None), step_graphs=True)
    with pytest.raises(ValueError, match="fused=True"):
        trainer.train()


@pytest.mark.parametrize("read_later", [True, False], ids=["async", "at-once"])
def test_a_non_finite_step_is_not_applied(tmp_path, monkeypatch, read_later):
    """CAT with an overflowing CAL objective at its first active step: NonFiniteLossError naming step 2, and the
    parameters are those after the warm-up step (the fused AdamW skipped the step on the device). `ASYNC` reads a
    step's finiteness at the next step (here 3, skipped too), else at once."""
    from cat_fast.integrations import step_graphs

    monkeypatch.setattr(step_graphs, "ASYNC", read_later)
    torch.manual_seed(0)
    model = tiny_model("bert", num_labels=2).train()
    trainer = ObjectiveTrainer(model=model, args=_args(tmp_path), train_dataset=tiny_dataset(), objective="cat",
                               objective_kwargs={"layers": [2], "warmup_steps": 1, "eta": 1e308, "gamma": 1e308},
                               step_graphs=True)
    seen = {}

    def snapshot(*_):
        if trainer.state.global_step == 1 and not seen:
            seen.update({n: p.detach().clone() for n, p in model.named_parameters()})

    trainer.objective.model.register_forward_pre_hook(lambda *a: snapshot())
    with pytest.raises(NonFiniteLossError, match=r"became nan at step 2 \(in crm_loss.*before the optimizer applied it"):
        trainer.train()
    assert trainer.state.global_step == (2 if read_later else 1)  # raised in the training step of step 3, or 2
    assert seen
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), seen[n], rtol=0, atol=0, msg=n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("objective,kwargs", [("erm", {}), ("cat", {"layers": [1, 2], "warmup_steps": 1})])
def test_gpu_step_graphs_train_as_the_trainer(tmp_path, objective, kwargs):
    """On a GPU (SDPA, bf16, dropout): graphs captured and replayed, and the run equal to the Trainer's own step
    to bf16 rounding over 8 steps."""
    runs = []
    for step_graphs in (False, True):
        torch.manual_seed(0)
        model = tiny_model("bert", num_labels=2, attn="sdpa").cuda().train()
        trainer = ObjectiveTrainer(model=model, args=_args(tmp_path / str(step_graphs), use_cpu=False, bf16=True,
                                                           max_steps=8),
                                   train_dataset=tiny_dataset(), objective=objective, objective_kwargs=kwargs,
                                   step_graphs=step_graphs)
        trainer.train()
        runs.append(([h["loss"] for h in trainer.state.log_history if "loss" in h],
                     {n: p.detach().float().cpu() for n, p in model.named_parameters()}, trainer))
    (want, want_params, _), (got, got_params, trainer) = runs
    assert trainer._captured.num_graphs >= 1
    assert got == pytest.approx(want, rel=2e-3)
    for n in want_params:
        torch.testing.assert_close(got_params[n], want_params[n], rtol=1e-3, atol=1e-4, msg=n)


def test_a_non_finite_step_is_read_before_its_checkpoint_is_written(tmp_path):
    """`ASYNC` reads a step's finiteness at the next step, but a checkpoint due at the non-finite step (save_steps=2)
    reads it first: NonFiniteLossError naming step 2 and no checkpoint of step 2, as without step graphs."""
    torch.manual_seed(0)
    model = tiny_model("bert", num_labels=2).train()
    trainer = ObjectiveTrainer(model=model, args=_args(tmp_path, save_strategy="steps", save_steps=2),
                               train_dataset=tiny_dataset(), objective="cat",
                               objective_kwargs={"layers": [2], "warmup_steps": 1, "eta": 1e308, "gamma": 1e308},
                               step_graphs=True)
    with pytest.raises(NonFiniteLossError, match=r"became nan at step 2 "):
        trainer.train()
    assert trainer.state.global_step == 2
    assert not any(p.name.endswith("-2") or "checkpoint" in p.name for p in tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("objective,kwargs", [("erm", {}), ("cat", {"layers": [2], "warmup_steps": 1})])
def test_gpu_captured_trainer_steps_wait_for_nothing(tmp_path, monkeypatch, objective, kwargs):
    """`step_graphs.ASYNC` on a GPU: the loader's batches reach the captured step pinned on the host (the step moves
    them), and from step 6 on (ERM's graph captured at step 4, CAT's at 5) a training step, from `on_step_begin` to
    `on_step_end`, makes no host synchronisation (`torch.cuda.set_sync_debug_mode` warns of none); the losses, logged
    learning rates and parameters are those of the same run with `ASYNC` off (the batches placed by accelerate, each
    step's finiteness read at once), bit for bit."""
    import warnings

    from transformers import TrainerCallback

    from cat_fast.integrations import step_graphs
    from cat_fast.step import CapturedStep

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.set_sync_debug_mode("warn" if state.global_step >= 5 else 0)

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.set_sync_debug_mode(0)

    seen = []
    call = CapturedStep.__call__

    def spy(self, batch, *args):
        seen.append(all(v.device.type == "cpu" and v.is_pinned() for v in batch.values()
                        if isinstance(v, torch.Tensor)))
        return call(self, batch, *args)

    monkeypatch.setattr(CapturedStep, "__call__", spy)
    runs = []
    for read_later in (True, False):
        monkeypatch.setattr(step_graphs, "ASYNC", read_later)
        seen.clear()
        torch.manual_seed(0)
        model = tiny_model("bert", num_labels=2, attn="sdpa").cuda().train()
        trainer = ObjectiveTrainer(model=model, args=_args(tmp_path / str(read_later), use_cpu=False, bf16=True,
                                                           max_steps=10),
                                   train_dataset=tiny_dataset(), objective=objective, objective_kwargs=kwargs,
                                   step_graphs=True, callbacks=[Watch()])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        torch.cuda.set_sync_debug_mode(0)
        # the warnings of the debug mode (not its one notice that it is a prototype)
        syncs = [str(w.message)[:200] for w in caught if "called a synchronizing" in str(w.message)]
        history = trainer.state.log_history
        runs.append(([h["loss"] for h in history if "loss" in h],
                     [h["learning_rate"] for h in history if "learning_rate" in h],
                     {n: p.detach().float().cpu() for n, p in model.named_parameters()}, list(seen), syncs))
    (losses, rates, params, host, syncs), (want_losses, want_rates, want_params, placed, _) = runs
    assert len(host) == 10 and all(host) and not any(placed)
    assert not syncs, syncs
    assert losses == want_losses and rates == want_rates
    for n in want_params:
        torch.testing.assert_close(params[n], want_params[n], rtol=0, atol=0, msg=n)


def test_step_graphs_resume_as_an_uninterrupted_run(tmp_path):
    """A run resumed from its step-2 checkpoint (the fused AdamW's state and tensor lr, CAT's generator) ends with
    the parameters of the uninterrupted run."""
    def make(out):
        torch.manual_seed(0)
        model = tiny_model("bert", num_labels=2).train()
        trainer = ObjectiveTrainer(model=model, args=_args(out, save_strategy="steps", save_steps=2),
                                   train_dataset=tiny_dataset(), objective="cat", step_graphs=True,
                                   objective_kwargs={"layers": [1, 2], "generator": torch.Generator().manual_seed(1)})
        return model, trainer

    whole, trainer = make(tmp_path / "whole")
    trainer.train()
    resumed, trainer = make(tmp_path / "resumed")
    trainer.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert isinstance(trainer.optimizer.optimizer.param_groups[0]["lr"], torch.Tensor)
    for (n, p), q in zip(whole.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=0, msg=n)
