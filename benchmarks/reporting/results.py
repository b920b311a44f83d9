"""Reading the suite's results: `load` merges `--benchmark-json` files and CAT_FAST_BENCH_JSONL backups into
records; the rest picks the op and step records out of them and orders them as the tables do."""
import json
import sys

OP_ORDER = ("cmix", "cal_objective", "cal_step_", "crm_loss", "gs_cosine_loss", "poe_loss", "reweighted_loss",
            "reweight_loss", "learned_mixin_loss", "conf_reg_loss", "confidence_regularization_loss")  # (earlier names)
BACKEND_ORDER = ("triton", "cuda", "cpp", "reference", "compile")
# The step suite's methods (`benchmarks/steps/harness.METHODS`, whose case ids are ``{size}-{method}``) and their
# row labels, numbered as in `benchmarks/steps/harness.py`'s docstring.
METHOD_LABEL = {
    "plain": "(1) plain fine-tuning",
    "plain_first_token": "(1f) plain, first-token last layer",
    "plain_training_layers": "(1t) plain, first-token last layer + training layers",
    "naive_cat": "(2) naive CAT (eager, reference ops)",
    "cat": "(3) cat_fast.CAT (CUDA-graph CAL)",
    "cat_eager": "(3e) cat_fast.CAT, cuda_graph=False",
    "cat_full_last": "(3f) cat_fast.CAT, prune_last_layer=False",
    "cat_hf_layers": "(3h) cat_fast.CAT, fast_resume=False",
    "cat_hf_clean": "(3c) cat_fast.CAT, training_layers=False",
    "gs_exact": "(4) GS exact, token level (h_0), eager attention",
    "gs_exact_fused": "(4d) GS exact, token level (h_0), twice-differentiable fused attention",
    "gs_first_order": "(5) GS first-order central, token level (h_0)",
    "gs_first_order_fwd": "(5f) GS first-order forward, token level (h_0)",
    "gs_pooled": "(6) GS exact, pooled",
    "gs_pooled_hf_layers": "(6h) GS exact, pooled, training_layers=False",
    "poe": "(7p) PoE (bias model)",
    "reweight": "(7r) reweighting (bias model)",
    "learned_mixin": "(7l) learned-mixin +H (bias model)",
    "conf_reg": "(7c) confidence regularisation (bias model)",
    "clp": "(8) CLP, head-only virtual step",
    "clp_all": "(8a) CLP, virtual step of every parameter",
    "plain_compiled": "(9) plain, torch.compile(model)",
    "plain_compiled_ro": "(9r) plain, torch.compile(model, mode=\"reduce-overhead\")",
    "plain_captured": "(10) plain (ERM), CapturedStep",
    "plain_fast_captured": "(10f) plain, ERM(fast=True), CapturedStep",
    "cat_captured": "(11) cat_fast.CAT, CapturedStep",
    "gs_first_order_captured": "(12) GS first-order central (h_0), CapturedStep",
    "gs_first_order_fwd_captured": "(12f) GS first-order forward (h_0), CapturedStep",
    "gs_pooled_captured": "(12p) GS exact, pooled, CapturedStep",
    "gs_exact_captured": "(13g) GS exact, token level (h_0), eager attention, CapturedStep",
    "gs_exact_fused_captured": "(13d) GS exact, token level (h_0), fused attention, CapturedStep",
    "poe_captured": "(13p) PoE (bias model), CapturedStep",
    "reweight_captured": "(13r) reweighting (bias model), CapturedStep",
    "learned_mixin_captured": "(13l) learned-mixin +H (bias model), CapturedStep",
    "conf_reg_captured": "(13c) confidence regularisation (bias model), CapturedStep",
    "clp_captured": "(13a) CLP, head-only virtual step, CapturedStep",
}
METHOD_ORDER = tuple(METHOD_LABEL)


def _read_json(path, records):
    """(machine info, commit info) of a `--benchmark-json` file; its cases into `records` by name."""
    with open(path) as handle:
        data = json.load(handle)
    for bench in data.get("benchmarks", []):
        records[bench.get("fullname") or bench["name"]] = bench
    return (data.get("machine_info") or {}).get("cat_fast") or {}, data.get("commit_info") or {}


def _read_jsonl(path, records):
    """The cases of a CAT_FAST_BENCH_JSONL backup not in `records` yet (a line cut short by a killed run skipped)."""
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            records.setdefault(row.get("fullname") or row.get("name"), row)


def load(paths):
    """(records, machine info, commit info) from JSON / JSONL inputs; later JSON inputs win on duplicate case
    names, the JSONL backups fill in the cases the JSON files lack."""
    records, machine, commit_info = {}, {}, {}
    for path in paths:
        if path.endswith(".jsonl"):
            continue
        info, commit = _read_json(path, records)
        if info and (not machine or (info.get("gpu") and not machine.get("gpu"))):
            machine = info
        commit_info = commit_info or commit
    for path in paths:
        if path.endswith(".jsonl"):
            _read_jsonl(path, records)
    return list(records.values()), machine, commit_info


def extra(record):
    return record.get("extra_info") or {}


def size_key(shape):
    try:
        return tuple(int(x) for x in str(shape).split("x"))
    except ValueError:
        return (sys.maxsize,)


def rank(value, order):
    return order.index(value) if value in order else len(order)


def ops_by_name(records, device):
    """{op: [extra_info of each case on `device`]}."""
    ops = {}
    for r in records:
        e = extra(r)
        if "op" in e and e.get("device") == device:
            ops.setdefault(e["op"], []).append(e)
    return ops


def by_case(entries):
    """{(shape, dtype): {backend: extra_info}} of one op's cases."""
    cases = {}
    for e in entries:
        cases.setdefault((e.get("shape"), e.get("dtype")), {})[e.get("backend")] = e
    return cases


def step_records(records):
    """The extra_info of the step cases (a method of `METHOD_ORDER`)."""
    return [extra(r) for r in records if extra(r).get("method") in METHOD_ORDER]


def steps_by_size(steps):
    """{size: {method: extra_info}}."""
    out = {}
    for e in steps:
        out.setdefault(e.get("size"), {})[e["method"]] = e
    return out
