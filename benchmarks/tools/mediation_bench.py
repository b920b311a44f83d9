"""Timing of the neuron mediation sweep (cat_fast.analysis.mediation) against the paper's looped method, side by side.

    python benchmarks/tools/mediation_bench.py [--models minilm bert-base] [--looped-neurons 48] [--out FILE.json]

Samples: 300 class-balanced CAD NLI dev pairs (100 per label, at their real lengths, MiniLM's tokenizer: the
bert-base-uncased vocabulary); treatment: the dev pairs at or above the 95th percentile of the share of hypothesis
words found in the premise, class-balanced. Models: the shipped MiniLM-L6 (its pretrained encoder, a fresh head) and
a BERT-base-config model with random weights (the timing does not depend on the weights). For each precision (fp32,
bf16 autocast): the exact batched sweep over every neuron of the layers timed (`--bert-layers` for BERT-base: a subset
of layers, extrapolated by FLOPs), the looped reference (one hooked forward per neuron over batches of 128 padded to
their longest) on `--looped-neurons` neurons spread over layers and components, extrapolated to all neurons, and the
first-order estimate. Reports seconds, ratios, the FLOP floor of the exact sweep (and of the previous stacked path),
its achieved TFLOP/s, the bf16 vs fp32 top-k overlap and the Spearman correlation / top-k overlap of the first-order
estimate with the exact effects.
"""
import argparse
import json
import time

import torch

from cat_fast import data
from cat_fast.analysis import mediation as M
from cat_fast.bias.features import FEATURE_NAMES, overlap_features


def samples_and_treatment(tokenizer, n_per_class=100, seed=0):
    dev = data.load_builtin("nli", "dev")
    labels = torch.tensor(dev.labels)
    g = torch.Generator().manual_seed(seed)
    chosen = torch.cat([torch.nonzero(labels == c).flatten()[torch.randperm(int((labels == c).sum()), generator=g)]
                        [:n_per_class] for c in range(3)])
    feats = overlap_features(dev.text, dev.text_pair)[:, FEATURE_NAMES.index("h_fraction_in_p")]
    high = feats >= torch.quantile(feats, 0.95)
    per = min(int((high & (labels == c)).sum()) for c in range(3))
    treat = torch.cat([torch.nonzero(high & (labels == c)).flatten()[:max(per, 1)] for c in range(3)])

    def tok(idx):
        enc = tokenizer([dev.text[i] for i in idx.tolist()], [dev.text_pair[i] for i in idx.tolist()],
                        padding=True, truncation=True, max_length=128, return_tensors="pt")
        return {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    return tok(chosen), tok(treat)


def sweep_flops(config, lengths, layers):
    """Matmul FLOPs (projections, feed-forward and attention) of the exact sweep, `neuron_effects`' fast path: per
    neuron of layer l and sample, row 0 of layer l (nothing for an output neuron; attention and the rest of the layer
    for every row, without the projections, for a key or value neuron), layer l+1 with the clean projections of rows
    >= 1 (for a key or value neuron the whole layer), layers l+2..L-1 whole and layer L for the first token; plus the
    clean forwards (the probabilities, one recording forward per batch and layer swept). Samples at their real
    lengths (the floor: the sweep pads within length batches); the formula is `mediation.sweep_flops`."""
    return M.sweep_flops(config, lengths, layers)


def sweep_flops_stacked_path(config, lengths, layers):
    """The same count for the previous stacked path (`neuron_effects(..., fast=False)`): per neuron of layer l and
    sample, layers l..L-1 whole and layer L for the first token."""
    return M.sweep_flops(config, lengths, layers, fast=False)


def spearman(a, b):
    ra = torch.argsort(torch.argsort(a)).double()
    rb = torch.argsort(torch.argsort(b)).double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def overlap(a, b, k):
    ta = set(torch.topk(a, k).indices.tolist())
    tb = set(torch.topk(b, k).indices.tolist())
    return len(ta & tb) / k


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def timed(fn):
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run(name, model, samples, treat, args):
    cfg = model.config
    L = cfg.num_hidden_layers
    layers = (args.minilm_layers or list(range(1, L + 1))) if name == "minilm" else args.bert_layers
    lengths = samples["attention_mask"].sum(-1)
    all_neurons = L * (5 * cfg.hidden_size + cfg.intermediate_size)
    k = max(1, round(all_neurons * 700 / 82944))
    result = {"model": name, "neurons": all_neurons, "top_k": k, "samples": int(lengths.numel()),
              "mean_length": float(lengths.float().mean()), "swept_layers": layers}
    effects = {}
    for precision in ("fp32", "bf16"):
        ctx = torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=precision == "bf16")
        with ctx:
            zbar = M.treatment_means(model, treat)
            M.neuron_effects(model, {k_: v[:8] for k_, v in samples.items()}, zbar, layers=[L])  # warm-up
            exact, secs = timed(lambda: M.neuron_effects(model, samples, zbar, layers=layers,
                                                         max_tokens=args.max_tokens, batch_tokens=args.batch_tokens))
            flops = sweep_flops(cfg, lengths, layers)
            stacked_flops = sweep_flops_stacked_path(cfg, lengths, layers)
            full_flops = sweep_flops(cfg, lengths, range(1, L + 1))
            # looped reference on a spread subset of neurons
            per_key = max(1, args.looped_neurons // (len(layers) * 6))
            chosen = {key: torch.linspace(0, v.numel() - 1, per_key).long().tolist() for key, v in zbar.items()
                      if key[0] in layers}
            n_chosen = sum(len(v) for v in chosen.values())
            looped, loop_secs = timed(lambda: M.neuron_effects_looped(model, samples, zbar, layers=layers,
                                                                      neurons=chosen))
            approx, att_secs = timed(lambda: M.attribution_effects(model, samples, zbar))
        e, _ = exact.flat()
        a_all, names = approx.flat()
        keep = torch.tensor([n[0] in layers for n in names])
        a = a_all[keep]
        effects[precision] = e
        full_secs = secs * full_flops / flops
        looped_full = loop_secs / n_chosen * all_neurons
        diffs = [(exact.effects[key][idx] - looped.effects[key][idx]).abs().max().item()
                 for key, idx in ((key, torch.tensor(v)) for key, v in chosen.items())]
        scale = max(looped.effects[key][torch.tensor(v)].abs().max().item() for key, v in chosen.items())
        result[precision] = {
            "exact_vs_looped_max_abs": max(diffs), "looped_max_abs_effect": scale,
            "exact_s": secs, "exact_full_s": full_secs, "exact_tflops": flops / secs / 1e12,
            "exact_flops": flops, "stacked_path_flops": stacked_flops,
            "looped_s_per_neuron": loop_secs / n_chosen, "looped_full_s": looped_full,
            "speedup_vs_looped": looped_full / full_secs, "attribution_s": att_secs,
            "attribution_spearman": spearman(a, e), "attribution_top_k_overlap": overlap(a, e, min(k, e.numel())),
            "looped_neurons_timed": n_chosen,
        }
        print(name, precision, json.dumps(result[precision]), flush=True)
    result["bf16_fp32_top_k_overlap"] = overlap(effects["bf16"], effects["fp32"], min(k, effects["fp32"].numel()))
    result["fp32_looped_paper_style_s"] = result["fp32"]["looped_full_s"]
    result["bf16_vs_fp32_looped"] = result["fp32"]["looped_full_s"] / result["bf16"]["exact_full_s"]
    print(name, "bf16/fp32 top-k overlap", result["bf16_fp32_top_k_overlap"], "bf16 exact vs fp32 looped",
          result["bf16_vs_fp32_looped"], flush=True)
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["minilm", "bert-base"])
    p.add_argument("--looped-neurons", type=int, default=48)
    p.add_argument("--bert-layers", type=int, nargs="+", default=[1, 6, 12])
    p.add_argument("--max-tokens", type=int, default=131072)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--minilm-layers", type=int, nargs="+", default=None)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--out")
    args = p.parse_args()
    from transformers import BertConfig, BertForSequenceClassification

    from cat_fast.models.pretrained import load_classifier

    minilm, tokenizer = load_classifier("minilm", 3, new_head=True)
    samples, treat = samples_and_treatment(tokenizer, args.per_class)
    results = []
    for name in args.models:
        if name == "minilm":
            model = minilm
        else:
            torch.manual_seed(0)
            model = BertForSequenceClassification(BertConfig(num_labels=3, attn_implementation="sdpa"))
        model = model.to(DEVICE).eval()
        results.append(run(name, model, samples, treat, args))
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
