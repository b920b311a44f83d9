"""cat_fast.CATTrainer / GSTrainer: a tiny BERT trains a few steps with each on an in-memory dataset."""
import math

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate>=1.1.0 (and psutil)")
datasets = pytest.importorskip("datasets")

from transformers import TrainingArguments  # noqa: E402

from cat_fast.integrations import CATTrainer, GSTrainer  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402


def tiny_dataset(n=8, length=8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[1::2, -2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = torch.tensor([0, 1] * (n // 2))
    return datasets.Dataset.from_dict({
        "input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist(),
        "pair_group": [i // 2 for i in range(n)],  # (0,1), (2,3), ...: counterfactual pairs, labels differ
        "unused_text": ["x"] * n,  # dropped by remove_unused_columns
    })


def args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             seed=0, data_seed=0, dataloader_num_workers=0)


def run(trainer_cls, tmp_path, **kw):
    model = tiny_model("bert", num_labels=2).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = trainer_cls(model=model, args=args(tmp_path), train_dataset=tiny_dataset(), **kw)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    changed = [n for n, p in model.named_parameters() if (p.detach() - before[n]).abs().max() > 0]
    assert "classifier.weight" in changed and any("encoder.layer.0" in n for n in changed)
    return trainer


def test_cat_trainer_trains(tmp_path):
    trainer = run(CATTrainer, tmp_path, cat_kwargs={"layers": [2], "warmup_steps": 1,
                                                    "generator": torch.Generator().manual_seed(0)})
    logged = [h for h in trainer.state.log_history if "cat/crm_loss" in h]
    assert [h["cat/cat_active"] for h in logged] == [0.0, 1.0, 1.0]  # warm-up counted in optimizer steps


def test_gs_trainer_trains_with_pair_groups(tmp_path):
    trainer = run(GSTrainer, tmp_path, gs_kwargs={"weight": 1.0})
    logged = [h for h in trainer.state.log_history if "gs/gs_loss" in h]
    assert logged and all(h["gs/gs_pairs"] == 8.0 for h in logged)  # the batch holds all 4 pairs, both ways


def test_objective_trainer_takes_a_registered_name(tmp_path):
    from cat_fast.integrations import ObjectiveTrainer
    from cat_fast.objectives import CAT

    trainer = run(ObjectiveTrainer, tmp_path, objective="cat-star",
                  objective_kwargs={"layers": [2], "generator": torch.Generator().manual_seed(0)})
    assert isinstance(trainer.objective, CAT) and trainer.objective.adv_steps == 0
    assert any("objective/crm_loss" in h for h in trainer.state.log_history)
    with pytest.raises(ValueError, match="objective: expected one of"):
        ObjectiveTrainer(model=tiny_model("bert", num_labels=2), args=args(tmp_path), train_dataset=tiny_dataset(),
                         objective="nope")


def grouped_dataset(n=16, length=8):
    """Groups (i, i + n/2) far apart in the file: a shuffled or sequential sampler of batch 4 rarely joins them."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (n, length), generator=g)
    half = n // 2
    return datasets.Dataset.from_dict({
        "input_ids": ids.tolist(), "attention_mask": [[1] * length] * n,
        "labels": [0] * half + [1] * half, "pair_group": [i % half for i in range(n)],
    })


def small_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0)
    return TrainingArguments(**{**base, **kw})


def test_gs_trainer_keeps_groups_in_one_batch(tmp_path):
    trainer = GSTrainer(model=tiny_model("bert", num_labels=2).train(), args=small_args(tmp_path),
                        train_dataset=grouped_dataset(), gs_kwargs={"weight": 1.0})
    trainer.train()
    logged = [h["gs/gs_pairs"] for h in trainer.state.log_history if "gs/gs_pairs" in h]
    assert logged == [4.0] * 4  # two whole groups per batch of 4, both directions


def test_gs_trainer_warns_when_batches_split_the_groups(tmp_path):
    trainer = GSTrainer(model=tiny_model("bert", num_labels=2).train(), args=small_args(tmp_path, max_steps=2),
                        train_dataset=grouped_dataset(), gs_kwargs={"weight": 1.0}, keep_groups=False)
    with pytest.warns(RuntimeWarning, match="no training step since the last log saw a counterfactual pair"):
        trainer.train()


def test_info_is_averaged_over_the_logging_window(tmp_path):
    trainer = CATTrainer(model=tiny_model("bert", num_labels=2).train(), args=small_args(tmp_path, logging_steps=2),
                         train_dataset=tiny_dataset(), cat_kwargs={"layers": [2], "warmup_steps": 1,
                                                                   "generator": torch.Generator().manual_seed(0)})
    trainer.train()
    active = [h["cat/cat_active"] for h in trainer.state.log_history if "cat/cat_active" in h]
    assert active == [0.5, 1.0]  # steps 1-2: warm-up then CAT; steps 3-4: CAT


def _trained(tmp_path, trainer_cls, compile_=None, **kw):
    """Losses and final parameters of 3 steps; `compile_`: "args" (TrainingArguments(torch_compile=True), eager
    backend) or "in-place" (model.compile(backend="eager") before the Trainer gets it)."""
    model = tiny_model("bert", num_labels=2).train()
    if compile_ == "in-place":
        model.compile(backend="eager")
    extra = dict(torch_compile=True, torch_compile_backend="eager") if compile_ == "args" else {}
    trainer = trainer_cls(model=model, args=small_args(tmp_path, max_steps=3, **extra), train_dataset=tiny_dataset(),
                          **kw)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compile_", ["args", "in-place"])
@pytest.mark.parametrize("kind", ["cat", "gs", "erm"])
def test_compiled_models_train_as_the_uncompiled_model(tmp_path, kind, compile_):
    """torch_compile=True (accelerate wraps the model in torch.compile) and a model compiled in place: the same
    losses and parameters as the uncompiled model (dropout on). The objectives' passes run the original model;
    ERM's forward runs the compiled one (the Trainer's wrapper)."""
    from cat_fast.integrations import ObjectiveTrainer

    def kwargs():
        if kind == "cat":
            return dict(cat_kwargs={"layers": [2], "generator": torch.Generator().manual_seed(0)})
        return dict(gs_kwargs={"weight": 1.0}) if kind == "gs" else dict(objective="erm")

    cls = {"cat": CATTrainer, "gs": GSTrainer, "erm": ObjectiveTrainer}[kind]
    _, want_losses, want = _trained(tmp_path / "plain", cls, **kwargs())
    trainer, losses, got = _trained(tmp_path / "compiled", cls, compile_, **kwargs())
    if compile_ == "args":
        assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
        if kind == "erm":
            assert trainer.objective.compiled_model is trainer.model_wrapped
    assert losses == want_losses
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("mode", ["exact", "first_order"])
def test_gs_trainer_under_bf16_mixed_precision(tmp_path, mode):
    """accelerate applies bf16 autocast inside the model's forward only: GS's head re-runs must follow it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("bert", num_labels=2, attn="sdpa").to(device).train()
    trainer = GSTrainer(model=model, args=small_args(tmp_path, bf16=True, use_cpu=device == "cpu"),
                        train_dataset=grouped_dataset(), gs_kwargs={"mode": mode})
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)


def test_a_non_finite_loss_stops_training(tmp_path):
    from cat_fast.integrations import NonFiniteLossError

    trainer = CATTrainer(model=tiny_model("bert", num_labels=2).train(), args=small_args(tmp_path),
                         train_dataset=tiny_dataset(), cat_kwargs={"layers": [2], "eta": 1e308, "gamma": 1e308})
    with pytest.raises(NonFiniteLossError, match=r"at step 1 \(in "):
        trainer.train()


def test_a_nan_counterfactual_pass_stops_training(tmp_path, monkeypatch):
    """NaN counterfactual logits (what CAT's CAL-graph replays gave under the Trainer with bf16 on a GPU) must reach
    the loss and stop the run, not become CRM weight a1 = 0 and train on as ERM."""
    from cat_fast.integrations import NonFiniteLossError
    from cat_fast.objectives import CAT

    real = CAT.counterfactual_logits

    def nan_logits(self, *args, **kwargs):
        return real(self, *args, **kwargs) * float("nan")

    monkeypatch.setattr(CAT, "counterfactual_logits", nan_logits)
    trainer = CATTrainer(model=tiny_model("bert", num_labels=2).train(), args=small_args(tmp_path),
                         train_dataset=tiny_dataset(), cat_kwargs={"layers": [2], "adv_steps": 1})
    with pytest.raises(NonFiniteLossError, match=r"at step 1 \(in "):
        trainer.train()


def test_resume_restores_the_objectives_random_state(tmp_path):
    args = small_args(tmp_path, save_strategy="steps", save_steps=2, max_steps=4)
    model = tiny_model("bert", num_labels=2).train()
    trainer = CATTrainer(model=model, args=args, train_dataset=tiny_dataset(),
                         cat_kwargs={"layers": [1, 2], "generator": torch.Generator().manual_seed(0)})
    trainer.train()
    full = [(h["cat/layer"], h["cat/lambda_before"]) for h in trainer.state.log_history if "cat/layer" in h]
    model = tiny_model("bert", num_labels=2).train()
    again = CATTrainer(model=model, args=args, train_dataset=tiny_dataset(),
                       cat_kwargs={"layers": [1, 2], "generator": torch.Generator().manual_seed(123)})
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    resumed = [(h["cat/layer"], h["cat/lambda_before"]) for h in again.state.log_history if "cat/layer" in h]
    flat = lambda pairs: [v for pair in pairs for v in pair]  # noqa: E731
    assert flat(resumed[-2:]) == pytest.approx(flat(full[-2:]))  # the generator state came back from the checkpoint


def _ddp_trainer_worker(rank, out):
    model = tiny_model("bert", num_labels=2, seed=rank).train()  # DDP broadcasts rank 0's weights
    trainer = GSTrainer(model=model, args=small_args(out), train_dataset=grouped_dataset(), gs_kwargs={})
    trainer.train()
    logged = [h["gs/gs_pairs"] for h in trainer.state.log_history if "gs/gs_pairs" in h]
    torch.save({"state": model.state_dict(), "pairs": logged, "steps": trainer.state.global_step,
                "wrapped": type(trainer.model_wrapped).__name__}, f"{out}/rank{rank}.pt")


def test_objective_trainer_under_ddp_two_processes(tmp_path):
    """Under torchrun the Trainer wraps the model in DDP and the objective runs inside its forward: both ranks end
    with the same parameters, each rank's batches hold whole groups (accelerate deals out whole batches)."""
    from tests.ranks import spawn

    spawn(_ddp_trainer_worker, str(tmp_path), tmp_path=tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["wrapped"] == "DistributedDataParallel" and r0["steps"] == r1["steps"] > 0
    start = tiny_model("bert", num_labels=2, seed=0).state_dict()
    assert max(float((v - start[k]).abs().max()) for k, v in r0["state"].items() if v.is_floating_point()) > 1e-4
    for k, v in r0["state"].items():
        torch.testing.assert_close(r1["state"][k], v, rtol=0, atol=0, msg=k)
    assert r0["pairs"] and all(p > 0 for p in r0["pairs"])  # groups kept whole on the rank


def test_a_wrapper_other_than_ddp_is_refused(tmp_path):
    trainer = GSTrainer(model=tiny_model("bert", num_labels=2), args=small_args(tmp_path), train_dataset=tiny_dataset())
    batch = {k: torch.tensor(v) for k, v in tiny_dataset()[:4].items() if k != "unused_text"}
    with pytest.raises(ValueError, match="DistributedDataParallel .torchrun. only, not FSDP or DeepSpeed"):
        trainer.compute_loss(torch.nn.DataParallel(trainer.model), batch)


def _ddp_non_finite_worker(rank, out, step_graphs=None):
    from cat_fast.integrations import NonFiniteLossError

    # rank 1 alone gets a loss that overflows; rank 0's own loss stays finite
    huge = {"eta": 1e308, "gamma": 1e308} if rank == 1 else {}
    trainer = CATTrainer(model=tiny_model("bert", num_labels=2).train(), args=small_args(out),
                         train_dataset=tiny_dataset(), cat_kwargs={"layers": [2], **huge}, step_graphs=step_graphs)
    try:
        trainer.train()
        message = ""
    except NonFiniteLossError as error:
        message = str(error)
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(f"{trainer.state.global_step} {message}")


def _ddp_non_finite_graph_worker(rank, out):
    _ddp_non_finite_worker(rank, out, step_graphs=True)


def test_a_non_finite_loss_on_one_rank_stops_every_rank(tmp_path):
    """Under DDP the gradients of a non-finite loss reach every rank: all ranks stop at that step, before the
    optimizer applies it, each with a NonFiniteLossError (not only the rank whose own loss overflowed)."""
    from tests.ranks import spawn

    spawn(_ddp_non_finite_worker, str(tmp_path), tmp_path=tmp_path)
    m0, m1 = ((tmp_path / f"rank{r}.txt").read_text() for r in range(2))
    assert "non-finite on another rank at step 1" in m0
    assert "at step 1 (in " in m1


def test_a_non_finite_captured_step_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """The same with step graphs (`CapturedStep` under DDP, eager on the CPU): every rank reads the ranks' skip flag
    of step 1 at step 2 (`step_graphs.ASYNC`: a step's finiteness read at the next one, on every rank alike) and
    stops there with a NonFiniteLossError naming step 1."""
    from tests.ranks import spawn

    spawn(_ddp_non_finite_graph_worker, str(tmp_path), tmp_path=tmp_path)
    for r in range(2):
        steps, message = (tmp_path / f"rank{r}.txt").read_text().split(" ", 1)
        assert steps == "1" and "non-finite loss or gradient norm on a rank at step 1" in message, (r, message)


def test_the_objective_runs_under_the_trainers_mixed_precision(tmp_path):
    """bf16=True: the objective's whole call is under autocast (accelerate autocasts inside the model's forward only;
    CAT's CAL loop and counterfactual passes run outside it)."""
    from cat_fast.objectives import ERM

    seen = []

    class Probe(ERM):
        def __call__(self, batch, pairs=None):
            seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
            return super().__call__(batch, pairs)

    from cat_fast.integrations import ObjectiveTrainer

    model = tiny_model("bert", num_labels=2).train()
    a = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3,
                          save_strategy="no", report_to=[], use_cpu=True, seed=0, bf16=True)
    ObjectiveTrainer(model=model, args=a, train_dataset=tiny_dataset(), objective=Probe(model)).train()
    assert seen == [True, True]


def test_several_gpus_outside_torchrun_train_on_one(tmp_path):
    """Several GPUs visible without torchrun (`TrainingArguments.n_gpu` > 1, here set by hand on the CPU): the
    Trainer would wrap the model in DataParallel, which the objective bypasses; one device trains instead, at the
    batch size per device, with one warning naming the torchrun command."""
    from cat_fast.integrations import ObjectiveTrainer, SingleGPUWarning

    a = args(tmp_path)
    assert a.n_gpu == 0  # the devices set up (the CPU), then two GPUs claimed
    a._n_gpu = 2
    assert a.train_batch_size == 16
    model = tiny_model("bert", num_labels=2).train()
    with pytest.warns(SingleGPUWarning, match=r"2 GPUs are visible outside torchrun; training runs on one .*"
                                              r"torchrun --nproc_per_node 2"):
        trainer = ObjectiveTrainer(model=model, args=a, train_dataset=tiny_dataset(), objective="erm")
    assert trainer.args.n_gpu == 1 and trainer._train_batch_size == 8
    trainer.train()
    assert not isinstance(trainer.model_wrapped, torch.nn.DataParallel)
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 3
