"""The step-level sections: one row per size and method with its ratios to the plain step (and the notes that say
how the steps were timed and counted), CAT's steps by mixing layer, and the host-synchronisation check."""
from benchmarks.reporting.markdown import error_row, fmt, short_error, size_label, table
from benchmarks.reporting.ratios import largest_flop_ratios, like_for_like, step_ratios
from benchmarks.reporting.results import METHOD_LABEL, METHOD_ORDER, rank, size_key, step_records, steps_by_size

STEP_HEADER = ["B×T", "method", "attn", "step ms", "tokens/s", "peak MiB", "time × (1)", "paired time × (1)",
               "memory × (1)", "FLOP × (1)", "model TFLOP/s"]


def _step_row(e, base):
    time_ratio, mem_ratio = step_ratios(e, base)
    paired = e.get("paired_ratio")
    paired = fmt(paired, 2) + f" ({e['paired_step_ms']:.1f} / {e['paired_plain_ms']:.1f} ms)" if paired else "—"
    return [fmt(e.get("step_ms"), 1), fmt(e.get("tokens_per_s"), 0), fmt(e.get("peak_mib"), 0), fmt(time_ratio, 2),
            paired, fmt(mem_ratio, 2), fmt(e.get("flop_ratio"), 2), fmt(e.get("tflops_per_s"), 1)]


def _step_notes(steps, by_size):
    ratios = ", ".join(f"{m} {e['flop_ratio']:.2f} → {e['flop_ratio_final_backward']:.2f} ({e.get('size')})"
                       for m, e in largest_flop_ratios(steps).items())
    timer = "CUDA-event timings" if steps[0].get("device") == "cuda" else "perf_counter timings (CPU smoke run)"
    notes = [
        "Step = forward, loss, backward, AdamW step, zero_grad; bf16 autocast; median of "
        f"{timer} over {steps[0].get('timed_steps', '?')} steps after {steps[0].get('warmup_steps', '?')} warm-up steps. "
        "Peak memory = torch.cuda.max_memory_allocated over the timed steps (weights, grads, AdamW state included). "
        "`paired time × (1)`: the method and a plain SDPA step on a second model, timed right after, interleaved "
        "in blocks of 2 steps (20 rounds, the order flipped every round; steady state, one synchronisation at the "
        "end); median method / median plain of that pair (both medians in parentheses). The small-batch steps are "
        "host-bound and the host's speed drifts; the pair shares the drift. The targets are read on it.",
        "FLOP × (1): matmul FLOPs from the config (forward 2·params·tokens + attention 4·B·T²·D·L, backward 2×), "
        "CAT adds per CAL step a forward + input-only backward of layers m+1..L (m = 9, the mean of {8, 9, 10}) and "
        "the final counterfactual forward, which runs without autograd (detached CRM weight). Counting a backward "
        "of that final pass as well (the issue's formula) gives: "
        + ratios + ".",
        "GS first-order at h_0 (FLOP × (1) column): g is an input-only backward (~1 forward) and each perturbed pass "
        "a forward + full backward (3 forwards): central (2 passes) 10/3 = 3.33×, forward (1 pass) 7/3 = 2.33×.",
        "First-token last layer: (1f), (1t), (3), (3e), (3h), (3c), (5), (5f), (6) and (6h) run layer L of every "
        "pass for row 0 only (keys and values of every token, the rest of the layer for row 0; same logits and "
        "gradients); their FLOP counts include it. (1), (2), (3f) and (4) run it whole.",
        "Training layers (`cat_fast.layers.training`: each encoder layer one autograd node, its parameter gradients "
        "included; same values, dropout draws and gradients): (1t), (6) and the clean forward of (3), (3e), (3f), "
        "(3h) run them, and so do the perturbed passes of (5) and (5f); (1), (1f), (2), (3c), (4) and (6h) run the "
        "model's own layers.",
        "Model TFLOP/s = those FLOPs / step time.",
    ]
    found = like_for_like(by_size)
    for base, text in (("plain_first_token", "CAT against a plain step with the same first-token cut, (3) paired / "
                                             "(1f) paired: "),
                       ("plain_training_layers", "CAT against a plain step with the same first-token cut and training "
                                                 "layers, (3) paired / (1t) paired: ")):
        if found[base]:
            notes.append(text + ", ".join(f"{size_label(size)} {ratio:.2f}" for size, ratio in found[base]) + ".")
    return "\n".join(f"- {n}" for n in notes)


def step_section(records):
    steps = step_records(records)
    if not steps:
        return None
    by_size = steps_by_size(steps)
    rows = []
    for size in sorted(by_size, key=size_key):
        methods = by_size[size]
        for method in sorted(methods, key=lambda m: rank(m, METHOD_ORDER)):
            e = methods[method]
            row = [size_label(size), METHOD_LABEL.get(method, method), e.get("attn", "")]
            rows.append(error_row(row, e, len(STEP_HEADER)) if "error" in e else row + _step_row(e, methods.get("plain")))
    return table(STEP_HEADER, rows) + "\n\n" + _step_notes(steps, by_size)


def layer_section(records):
    """CAT steps by the mixing layer drawn at each step (records that carry `paired_by_layer`)."""
    rows = []
    for e in sorted((e for e in step_records(records) if e.get("paired_by_layer")),
                    key=lambda e: (size_key(e.get("size")), rank(e["method"], METHOD_ORDER))):
        by = e["paired_by_layer"]
        layers = sorted(by, key=int)
        cells = ", ".join(f"m={m}: {by[m][0]:.1f} ({by[m][1]})" for m in layers)
        rows.append([size_label(e.get("size")), METHOD_LABEL.get(e["method"], e["method"]), cells,
                     fmt(e.get("paired_layer_mean_ms"), 1), fmt(e.get("paired_plain_ms"), 1),
                     fmt(e.get("paired_layer_ratio"), 2), fmt(e.get("paired_ratio"), 2), fmt(e.get("flop_ratio"), 2)])
    if not rows:
        return None
    header = ["B×T", "method", "paired steps: median ms at each drawn m (calls)", "mean over m", "plain median",
              "layer-mean ratio", "median ratio", "FLOP × (1)"]
    note = ("- CAT draws m uniformly from its layers at every step ({8, 9, 10} of BERT-base's 12): a step at m = 8 "
            "resumes 4 layers, one at m = 10 two, so the step times have three modes and their median follows "
            "whichever mode the draws in the timed window favour. `mean over m` = the mean of the three per-layer medians: the expected step cost, for the same "
            "mean m as the FLOP count; `layer-mean ratio` = that / the paired plain median.")
    return table(header, rows) + "\n\n" + note


SYNC_CASES = (("sync_cat_nomask", "CAT step (forward + backward), batch without padding mask"),
              ("sync_cat", "CAT step, padded batch with attention_mask"),
              ("sync_plain_nomask", "plain step, batch without padding mask"),
              ("sync_plain", "plain step, padded batch with attention_mask"))
SYNC_NOTE = ("- torch.cuda.set_sync_debug_mode(\"error\"); the target is no host sync in the CAT step. "
             "Hugging Face's SDPA mask creation (`padding_mask.all()`) syncs on padded batches (the plain "
             "step's own forward); cat_fast gives SDPA models their 4-D mask (`models.sync_free_inputs`), "
             "so its passes skip that check.")


def _sync_verdict(e, key):
    value = e[key]
    if e.get(key + "_raised") is None and value is not None:
        return "not checked (no CUDA device)"
    return "no host sync" if value is None else f"RAISED: {short_error(value, 300)}"


def sync_section(records):
    for r in records:
        e = r.get("extra_info") or {}
        if e.get("method") == "cat_sync_check" or "sync_cat" in e:
            if "error" in e:
                return f"- host-sync check failed to run: {short_error(e['error'], 300)}"
            lines = [f"- {label} (B×T {e.get('size')}): {_sync_verdict(e, key)}" for key, label in SYNC_CASES if key in e]
            return "\n".join(lines + [SYNC_NOTE])
    return None
