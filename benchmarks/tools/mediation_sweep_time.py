"""A whole exact mediation sweep, timed, on one GPU or several.

    python -m benchmarks.tools.mediation_sweep_time --model bert-base --precision bf16 --save one.pt
    torchrun --standalone --nproc_per_node 2 -m benchmarks.tools.mediation_sweep_time --model bert-base \
        --precision bf16 --compare one.pt

The samples and treatment of `mediation_bench.py` (300 class-balanced CAD NLI dev pairs at their real lengths);
every neuron of every layer (`neuron_effects`, under torchrun with ``distributed=True``: the (layer, component) tables
split over the ranks by cost). Models: the shipped MiniLM-L6 or a BERT-base-config model with random weights (seed 0;
every rank builds the same). Prints one JSON line (rank 0): wall seconds of the sweep (after a warm-up and a barrier,
to the end of the all-gather), each rank's own sweep seconds, and with --compare the largest absolute difference to
a saved sweep (`--save` of the one-process run).
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from benchmarks.tools import mediation_bench as MB
from cat_fast import distributed as D
from cat_fast.analysis import mediation as M


def _parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("minilm", "bert-base"), default="bert-base")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--max-tokens", type=int, default=131072)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, nargs="+", default=None, help="default: every layer")
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--looped-neurons", type=int, default=0,
                   help="also time the paper's looped method (fp32, one hooked forward per neuron over batches of 128 "
                        "padded to their longest) on this many neurons spread over every layer and component, in the "
                        "same process, extrapolated per neuron to all (one process only)")
    p.add_argument("--save")
    p.add_argument("--compare")
    p.add_argument("--out")
    return p.parse_args()


def _init_distributed():
    """(world size, rank): the process group started under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank = dist.get_rank()
    return world, rank


def _model_and_inputs(args, device):
    """The model on `device` in eval mode, the samples and the treatment (the same in every process)."""
    from transformers import BertConfig, BertForSequenceClassification

    from cat_fast.models.pretrained import load_classifier

    torch.manual_seed(0)  # the same fresh head in every process
    minilm, tokenizer = load_classifier("minilm", 3, new_head=True)
    samples, treat = MB.samples_and_treatment(tokenizer, args.per_class)
    if args.model == "minilm":
        model = minilm
    else:
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(num_labels=3, attn_implementation="sdpa"))
    model = model.to(device).eval()
    samples = {k: v.to(device) for k, v in samples.items()}
    treat = {k: v.to(device) for k, v in treat.items()}
    return model, samples, treat


def _timed_sweep(args, model, samples, treat, device, world, sync):
    """(effects, seconds): the whole sweep after a warm-up and a barrier, to the end of the all-gather."""
    L = model.config.num_hidden_layers
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        zbar = M.treatment_means(model, treat)
        M.neuron_effects(model, {k: v[:8] for k, v in samples.items()}, zbar, layers=[L])  # warm-up
        sync()
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        effects = M.neuron_effects(model, samples, zbar, layers=args.layers, max_tokens=args.max_tokens, batch_tokens=args.batch_tokens,
                                   distributed=world > 1)
        sync()
        seconds = time.perf_counter() - t0
    return effects, seconds


def _timed_looped(model, samples, treat, neurons, sync):
    """(neurons timed, seconds per neuron) of the looped method (fp32) on about `neurons` neurons."""
    zbar32 = M.treatment_means(model, treat)
    per_key = max(1, neurons // len(zbar32))
    chosen = {key: torch.linspace(0, v.numel() - 1, per_key).long().tolist() for key, v in zbar32.items()}
    n_chosen = sum(len(v) for v in chosen.values())
    sync()
    t1 = time.perf_counter()
    M.neuron_effects_looped(model, samples, zbar32, neurons=chosen)
    sync()
    return n_chosen, (time.perf_counter() - t1) / n_chosen


def _write(result, values, args):
    """Rank 0: the saved sweep, the JSON line printed and appended to --out."""
    if args.save:
        torch.save(values, args.save)
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


def main():
    args = _parse_args()
    world, rank = _init_distributed()
    cuda = torch.cuda.is_available()  # the CPU only for a smoke test
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, samples, treat = _model_and_inputs(args, device)
    effects, seconds = _timed_sweep(args, model, samples, treat, device, world, sync)
    mine = [seconds]
    if world > 1:
        mine = [None] * world
        dist.all_gather_object(mine, seconds)
    if args.looped_neurons and world == 1:
        n_chosen, per_neuron = _timed_looped(model, samples, treat, args.looped_neurons, sync)
    values, _ = effects.flat()
    result = {"model": args.model, "precision": args.precision, "processes": world,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "neurons": int(values.numel()), "samples": int(samples["input_ids"].shape[0]),
              "seconds": seconds, "rank_seconds": mine, "commit": os.environ.get("CAT_FAST_BENCH_COMMIT")}
    if args.looped_neurons and world == 1:
        result.update(looped_fp32_neurons_timed=n_chosen, looped_fp32_s_per_neuron=per_neuron,
                      looped_fp32_full_s=per_neuron * values.numel(),
                      sweep_vs_looped_fp32=per_neuron * values.numel() / seconds)
    if args.compare and rank == 0:
        other = torch.load(args.compare, weights_only=True)
        result["max_abs_diff_vs_saved"] = float((values - other).abs().max())
        result["bit_identical_vs_saved"] = bool(torch.equal(values, other))
    if rank == 0:
        _write(result, values, args)
    if world > 1:
        D.leave()


if __name__ == "__main__":
    main()
