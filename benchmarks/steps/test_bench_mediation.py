"""The neuron mediation sweep in the suite: MiniLM-L6 on 300 class-balanced CAD NLI dev pairs, the exact
batched sweep of all 20,736 neurons in fp32 and under bf16 autocast, side by side with the paper's looped method on a
spread subset of neurons (extrapolated per neuron) and the first-order estimate; `benchmarks/tools/mediation_bench.py`
has the measurement (and the BERT-base case, too long for the suite's budget). GPU only. The recorded time is the
bf16 exact sweep; extra_info holds every number of the tool's report."""
import pytest

from benchmarks import _harness as H

pytestmark = [pytest.mark.benchmark(timer=H.virtual_clock), pytest.mark.bench_step]


@pytest.mark.skipif(not H.HAS_CUDA, reason=H.NO_CUDA_REASON)
def test_mediation_sweep_minilm(benchmark):  # past CAT_FAST_BENCH_DEADLINE_STEP, conftest skips it (bench_step)
    import argparse

    from benchmarks.tools import mediation_bench as MB

    def measure():
        from cat_fast.models.pretrained import load_classifier

        model, tokenizer = load_classifier("minilm", 3, new_head=True)
        samples, treat = MB.samples_and_treatment(tokenizer)
        args = argparse.Namespace(minilm_layers=None, bert_layers=[], looped_neurons=36, max_tokens=131072,
                                  batch_tokens=8192)
        result = MB.run("minilm", model.cuda().eval(), samples, treat, args)
        extra = {"method": "mediation_minilm", **{k: v for k, v in result.items() if not isinstance(v, dict)}}
        for precision in ("fp32", "bf16"):
            extra.update({f"{precision}_{k}": v for k, v in result[precision].items()})
        return result["bf16"]["exact_s"], extra

    H.finish(H.record(benchmark, measure, group="mediation", method="mediation_minilm"))
