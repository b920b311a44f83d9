"""The `naive_cat` row: CAT (docs/METHODS.md §1, Algorithm 1, summed update) written directly in eager PyTorch with
`cat_fast.kernels.reference` ops and no cat_fast machinery, the baseline `cat` is measured against.

Lower layers once with output_hidden_states, h_m = hidden_states[m] (m = the suite's naive layer); the upper layers
+ pooler + classifier called directly with the model's own (SDPA) mask; the CAL steps with torch.autograd.grad
w.r.t. lambda only; the final counterfactual forward without autograd (detached CRM weight); loss = ERM + CRM.
"""
import torch
import torch.nn.functional as F

from benchmarks.steps.setting import ADV_LR, ADV_STEPS, ALPHA, BETA, ETA, GAMMA, NAIVE_M, autocast


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


def _extended_mask(model, h, mask):
    try:
        from transformers.masking_utils import create_bidirectional_mask

        return create_bidirectional_mask(config=model.config, inputs_embeds=h, attention_mask=mask)
    except ImportError:  # older transformers: additive [B, 1, 1, T] mask
        return model.get_extended_attention_mask(mask, mask.shape, dtype=h.dtype)


def naive_cat_step(model, batch, finish_step):
    """A closure of one naive CAT step; `finish_step(loss)` back-propagates and steps the optimizer."""
    from cat_fast.kernels import reference

    bert = model.bert
    upper_layers = bert.encoder.layer[NAIVE_M:]
    input_ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    B = input_ids.shape[0]
    alpha = torch.full((B,), ALPHA, device=input_ids.device)
    beta = torch.full((B,), BETA, device=input_ids.device)

    def upper(h, ext):
        for layer in upper_layers:
            h = _layer_out(layer(h, ext))
        return model.classifier(model.dropout(bert.pooler(h)))

    def step():
        with autocast():
            out = bert(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
            logits = model.classifier(model.dropout(out.pooler_output))
            erm = F.cross_entropy(logits.float(), labels)
            h_m = out.hidden_states[NAIVE_M].detach()
            ext = _extended_mask(model, h_m, mask)  # mask_mode "self": the mixed sequence keeps sample i's mask
            partner = torch.randperm(B, device=h_m.device)
            lam = torch.distributions.Beta(alpha, beta, validate_args=False).sample()
            for _ in range(ADV_STEPS):
                lam_var = lam.detach().requires_grad_(True)
                h_mix, _ = reference.cmix(h_m, lam_var, partner)
                objective = reference.cal_objective(upper(h_mix, ext), labels, GAMMA, ETA).sum()
                (grad,) = torch.autograd.grad(objective, lam_var)
                reference.cal_step_(lam, grad, ADV_LR, 1.0, 0.0, 1.0)
            with torch.no_grad():  # detached CRM weight: the counterfactual logits need no graph
                h_mix, _ = reference.cmix(h_m, lam, partner)
                cf_logits = upper(h_mix, ext)
            crm = reference.crm_loss(logits, cf_logits, labels, 0.0, 10.0, True, "mean")
            loss = erm + crm
        finish_step(loss)

    return step
