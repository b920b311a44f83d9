"""Matmul FLOPs of one training step of a suite method, from the model's config (the `flops*` and `tflops_per_s`
fields of the step records)."""
from benchmarks.steps.harness import SPECS
from benchmarks.steps.setting import ADV_STEPS


def model_flops(config, batch, tokens, method, m=None, adv_steps=ADV_STEPS, final_backward=False):
    """Matmul FLOPs of one step of `method` (a key of `SPECS`) from the config.

    forward = 2 * (matmul params) * tokens + attention 4 * B * T^2 * D per layer (+ pooler/classifier per sample);
    backward = 2 x forward. CAT adds, per CAL step, a forward of layers m+1..L (+ head) and an input-only
    backward of those (~1 x forward: no weight-gradient matmuls), plus the final counterfactual forward of
    layers m+1..L. The methods whose spec says ``first_token`` run layer L of every pass (clean forward, CAL steps,
    final pass, GS passes) for the first token only (`cat_fast.layers.first_token`, `prune_last_layer`, the
    default: K and V of every token, row 0's Q, attention, attention output and feed-forward); `plain`,
    `naive_cat`, `cat_full_last` and `gs_exact` run it whole. With the default detached CRM weight the final
    counterfactual pass has no backward (the implementations run it without autograd); `final_backward=True`
    counts one anyway (2 x forward more). First-order GS at h_0 adds g (an input-only
    backward, ~1 x forward) and per perturbed pass a forward and a full backward (3 x forward): 2 passes (central)
    → 10/3 of the method's own forward, 1 pass (forward) → 7/3. Embedding lookups, layer norms, softmax and
    elementwise work are not counted.
    """
    spec = SPECS[method]
    D, I, L, C = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_labels  # noqa: E741
    n_tok = batch * tokens
    layer = 2 * n_tok * (4 * D * D + 2 * D * I) + 4 * batch * tokens * tokens * D
    first_token_layer = 2 * n_tok * 2 * D * D + 2 * batch * (2 * D * D + 2 * D * I) + 4 * batch * tokens * D
    last = first_token_layer if spec.first_token else layer
    head = 2 * batch * (D * D + D * C)
    forward = (L - 1) * layer + last + head
    total = 3 * forward
    if spec.forward == "naive_cat" or spec.per_layer:
        upper = (L - m - 1) * layer + last + head
        total += adv_steps * 2 * upper + upper * (3 if final_backward else 1)
    if spec.kwargs.get("mode") == "first_order":  # representation h_0: every pass covers all L layers
        passes = 1 if spec.kwargs.get("difference") == "forward" else 2
        total += forward + passes * 3 * forward  # g (input-only backward) + each pass's forward and backward
    if spec.objective == "clp":  # + the metadata batch's forward (the virtual step is the head's only)
        total += forward
    if spec.objective == "clp-all":  # + the virtual step's backward with create_graph (~2), the metadata forward
        total += 7 * forward  # through the updated parameters (1) and its backward to Ω through it (~4): approximate
    return total


def flop_fields(config, batch, tokens, method, m, seconds):
    """The FLOP fields of a step record (empty where the count does not cover `method`): FLOPs with and without a
    backward of the final pass, plain's, their ratios, and model TFLOP/s at `seconds` a step."""
    if not SPECS[method].flops:
        return {}
    flops = model_flops(config, batch, tokens, method, m)
    with_final = model_flops(config, batch, tokens, method, m, final_backward=True)
    plain = model_flops(config, batch, tokens, "plain")
    return dict(flops=flops, flops_final_backward=with_final, flops_plain=plain, flop_ratio=flops / plain,
                flop_ratio_final_backward=with_final / plain, tflops_per_s=flops / seconds / 1e12)
