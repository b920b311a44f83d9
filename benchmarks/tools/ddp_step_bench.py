"""Training-step time of cat_fast's objectives under DistributedDataParallel (`cat_fast.distributed`), N GPUs.

    torchrun --standalone --nproc_per_node 2 benchmarks/tools/ddp_step_bench.py --methods erm cat gs --size 64x256
    python benchmarks/tools/ddp_step_bench.py --methods erm cat gs            # one process: the baseline
    torchrun --standalone --nproc_per_node 2 benchmarks/tools/ddp_step_bench.py --tiny   # CPU smoke test (gloo)

BERT-base config (random weights, SDPA attention, bf16 autocast, AdamW), the step suite's batch per rank
(benchmarks/steps/harness.py `make_batch`: random ids, lengths T/2..T, labels, random pairs; each rank its
own draw) and its method settings (CAT: layers 8-10, 3 CAL steps; GS: first order at h_0, central differences, here
with ``low_memory=False`` as DDP requires). Each step: the objective inside DDP's forward, backward (DDP all-reduces
the gradients), AdamW step. Warm-up steps, then timed steps between synchronisations; rank 0 prints one JSON line per
method: world size, ms per step and tokens/s = world × batch × tokens / step time (padding included).

Diagnostics: ``--no-ddp`` runs each rank's step without DDP (no gradient averaging: what N independent processes on
one host reach, the scaling ceiling); ``--profile DIR`` then profiles 3 more steps per method with torch.profiler
and writes each rank's operator table (CUDA and CPU time) and timeline (a Chrome trace) to DIR. The JSON row also
gives the host time to issue one step (``host_ms``: until ``step()`` returns, measured on separate steps after a
synchronisation) and, for CAT, the number of captured CAL-graph signatures and of steps that replayed them, and
``timed_layers``: how many timed steps mixed at each layer (a step at layer 8 resumes four layers, one at 10 two).
One process draws CAT's layers from the stream DDP gives every rank, as do the ranks of ``--no-ddp``, so every run
times the same layers. ``--captured``:
each step is one `cat_fast.step.CapturedStep` (one CUDA graph per batch signature, the gradient all-reduce inside it:
`cat_fast.step_ddp`; a fused, capturable AdamW with a tensor lr); the row gives its graphs and replayed steps, and
``timed_replays``: how many of the timed steps replayed a graph (one that did not ran eagerly or captured, and its
time counts in the mean: raise ``--warmup``; CAT's packed steps, from `CAT.packed_min_rows` rows, key a graph per
layer and row count).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.steps.harness import make_batch  # noqa: E402  (the step suite's batch)
from cat_fast import distributed as D  # noqa: E402

TINY = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=2000,
            max_position_embeddings=64)


def make_model(device, tiny):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(num_labels=2, attn_implementation="sdpa", **(TINY if tiny else {}))
    torch.manual_seed(0)  # the same weights on every rank (DDP broadcasts rank 0's anyway)
    return BertForSequenceClassification(config).to(device).train()


def make_objective(method, model, tiny, ddp=True):
    from cat_fast import CAT, GradientSupervision
    from cat_fast.objectives import ERM

    if method == "erm":
        return ERM(model)
    if method in ("cat", "cat-eager"):  # cat-eager: the CAL loop without CUDA graphs (a diagnostic)
        layers = [2, 3] if tiny else [8, 9, 10]
        cat = CAT(model, layers=layers, adv_steps=3, alpha=0.3, beta=0.3, gamma=10.0, eta=20.0, adv_lr=2e-2,
                  generator=torch.Generator().manual_seed(D.rank_seed(0)), cuda_graph=method == "cat")
        if not ddp:  # the mixing-layer stream DDP gives every rank (`distributed.prepare_objective`: rank 0's seed):
            # the same layers drawn as in a DDP run, whose steps cost as much as this one's
            cat.layer_generator = torch.Generator().manual_seed(D.rank_seed(0) - D.rank())
        return cat
    if method == "gs":
        return GradientSupervision(model, weight=1.0, representation=0, mode="first_order", difference="central",
                                   low_memory=False)
    raise ValueError(f"--methods: expected erm, cat, cat-eager or gs, got {method!r}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allreduce_row(device, numel, repeats=10):
    """All-reduce bandwidth of one `numel`-element fp32 tensor (BERT-base's gradients: 109.5M): NCCL's bus
    bandwidth 2 (N - 1) / N × bytes / time, the figure the link's peak compares with."""
    x = torch.ones(numel, device=device)
    for _ in range(2):
        dist.all_reduce(x)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x)
    sync(device)
    seconds = (time.perf_counter() - start) / repeats
    n = D.world()
    return {"method": "allreduce", "world": n, "mib": round(numel * 4 / 2**20, 1), "ms": round(seconds * 1e3, 3),
            "bus_gb_per_s": round(2 * (n - 1) / n * numel * 4 / seconds / 1e9, 1)}


def _ddp(model, device, use_ddp, comm_hook, bucket_mb):
    """`model` inside DistributedDataParallel (None in one process or with use_ddp=False)."""
    kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
    kwargs["broadcast_buffers"] = False  # BERT's buffers (position and token-type ids) are constants
    if bucket_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_mb
    wrapped = DDP(model, **kwargs) if D.world() > 1 and use_ddp else None
    if wrapped is not None and comm_hook == "bf16":  # PyTorch's own: gradients sent as bf16, averaged in fp32
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        wrapped.register_comm_hook(None, bf16_compress_hook)
    return wrapped


def _training_step(call, objective, model, device, batch_size, tokens, captured, overlap=True, exchange="auto",
                   split=True, row_sparse=True, rank_batches=1):
    """(step, whole): one training step on this rank's batch as a call without arguments, and the CapturedStep
    (None unless `captured`); one process with `rank_batches` > 1 steps through the batches of ranks 0, 1, ... in
    turn."""
    gpu = device.type == "cuda"
    lr = torch.tensor(2e-5, device=device) if captured and gpu else 2e-5  # a captured step replays a tensor lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=gpu, capturable=captured and gpu)
    ranks = range(rank_batches) if D.world() == 1 else [D.rank()]
    data = [make_batch(batch_size, tokens, model.config.vocab_size, device, seed=1234 + r) for r in ranks]
    dtype = torch.bfloat16
    whole = None
    if captured:
        from cat_fast import gradient_averaging
        from cat_fast import step as step_module
        from cat_fast.objectives import CAT
        from cat_fast.step import CapturedStep

        gradient_averaging.OVERLAP = overlap  # False: the all-reduce after the backward instead of overlapped with it
        gradient_averaging.EXCHANGE = exchange  # "copy": the copy engines move the bytes; "auto": copy where it can
        step_module.SPLIT_UPDATE = split  # False: the optimizer waits for the last bucket too
        gradient_averaging.ROW_SPARSE = row_sparse  # False: the vocabulary table pulled whole
        # CAT's packed steps (from `CAT.packed_min_rows` rows) key a graph per layer and row count of every rank, of
        # which CapturedStep keeps packed graphs to half of max_graphs: room for five row-count pairs a layer
        whole = CapturedStep(call, optimizer, autocast=dtype, strict=True,
                             max_graphs=32 if isinstance(objective, CAT) else 8)

    def step():
        batch, pairs = data[step.count % len(data)]
        step.count += 1
        args = (pairs,) if objective.needs_pairs else ()
        if captured:
            _, info = whole(batch, *args)
        else:
            with torch.autocast(device.type, dtype=dtype):
                loss, info = call(batch, *args)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if "layer" in info:  # CAT's mixing layer: a step's cost depends on it
            step.layers.append(int(info["layer"]))

    step.layers, step.count = [], 0
    return step, whole


def _seconds_per_step(step, device, warmup, steps, whole=None):
    """(seconds per step after `warmup` steps, the slowest rank's; how many of the timed steps replayed a graph of
    `whole`, the CapturedStep, or None)."""
    for _ in range(warmup):
        step()
    sync(device)
    step.layers.clear()  # the timed steps' mixing layers from here
    if D.world() > 1:
        dist.barrier()
    replays = None if whole is None else whole.num_replays
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - start) / steps
    if whole is not None:  # a timed step that replayed nothing ran eagerly or captured: raise --warmup
        replays = whole.num_replays - replays
    if D.world() > 1:  # the slowest rank's time is the step's
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = float(t)
    return seconds, replays


def _host_seconds(step, device):
    """Host time to issue one step, each of 3 measured from a synchronised start."""
    host = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    sync(device)
    return host


def _write_profile(step, device, directory, tag):
    """3 more steps under torch.profiler; the operator tables to `directory`/`tag`.txt, the timeline (every stream's
    kernels and copies, for chrome://tracing or Perfetto) to `directory`/`tag`.json."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(3):
            step()
        sync(device)
    os.makedirs(directory, exist_ok=True)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with open(os.path.join(directory, tag + ".txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=70))
        f.write("\n\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
    prof.export_chrome_trace(os.path.join(directory, tag + ".json"))


def interference_rows(device, numel, exchanges, repeats=10, matmuls=16, size=4096, parts=13):
    """Whether a gradient exchange slows work beside it (GPUs): bf16 matmuls on a stream of their own, and the
    averaging of `numel` fp32 gradients in `parts` buckets by `GradientAverager` (each `exchanges` in turn: "nccl",
    "copy"), each alone and both launched together. Per exchange: ms per repeat of each alone and of both (wall), and
    the matmuls' own span when both run (CUDA events on their stream)."""
    from cat_fast.gradient_averaging import GradientAverager

    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    side = torch.cuda.Stream(device)

    def products():
        with torch.cuda.stream(side):
            for _ in range(matmuls):
                torch.mm(a, b)

    rows = []
    for exchange in exchanges:
        params = [torch.nn.Parameter(torch.zeros(numel // parts, device=device)) for _ in range(parts)]
        for p in params:
            p.grad = torch.ones_like(p)
        averager = GradientAverager(params, overlap=False, exchange=exchange)

        def average(averager=averager):
            averager.begin(None)
            averager()

        for _ in range(2):
            products()
            average()
        row = {"method": "interference", "exchange": exchange, "world": D.world(), "buckets": len(averager.buckets),
               "mib": round(numel * 4 / 2**20, 1), "matmul_tflop": round(matmuls * 2 * size**3 / 1e12, 2)}
        for name, calls in (("matmul", (products,)), ("exchange", (average,)), ("both", (products, average))):
            sync(device)
            dist.barrier()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(side)
            start = time.perf_counter()
            for _ in range(repeats):
                for call in calls:
                    call()
            end.record(side)
            sync(device)
            row[f"{name}_ms"] = round((time.perf_counter() - start) / repeats * 1e3, 3)
            if name == "both":
                row["matmul_in_both_ms"] = round(begin.elapsed_time(end) / repeats, 3)
        rows.append(row)
        del averager, params
    return rows


def copy_bandwidth_rows(device, sizes_mib=(8, 16, 45, 209), repeats=20):
    """The link the copy exchange uses (GPUs, 2 ranks): per buffer size, every rank copying the other rank's
    symmetric-memory buffer into its own memory (pull) or its own into the other's (push), at once, in one copy or
    cut into 2 or 4 on as many streams; NCCL's all-reduce of the same buffer; and the symmetric-memory barrier. ms
    per call and GB/s (bytes copied per rank, or the buffer's bytes for the all-reduce)."""
    from cat_fast.gradient_averaging import share_symmetric, symmetric_zeros

    streams = [torch.cuda.Stream(device) for _ in range(4)]
    other = 1 - D.rank()

    def timed(call):
        for _ in range(3):
            call()
        sync(device)
        dist.barrier()
        sync(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeats):
            call()
        end.record()
        sync(device)
        return begin.elapsed_time(end) / repeats

    def copies(dst, src, parts):
        n = dst.numel()
        size, current = -(-n // parts), torch.cuda.current_stream(device)
        for i, stream in enumerate(streams[:parts]):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                dst[i * size:(i + 1) * size].copy_(src[i * size:(i + 1) * size])
        for stream in streams[:parts]:
            current.wait_stream(stream)

    rows = []
    for mib in sizes_mib:
        n = mib * 2**20 // 4
        mine = symmetric_zeros(n, torch.float32, device).normal_()
        handle = share_symmetric(mine)
        theirs = handle.get_buffer(other, (n,), torch.float32, 0)
        local = torch.empty(n, device=device)
        row = {"method": "copy_bandwidth", "world": D.world(), "mib": mib}
        for direction, (dst, src) in (("pull", (local, theirs)), ("push", (theirs, local))):
            for parts in (1, 2, 4):
                ms = timed(lambda dst=dst, src=src, parts=parts: copies(dst, src, parts))
                row[f"{direction}{parts}_ms"], row[f"{direction}{parts}_gbs"] = round(ms, 4), round(n * 4 / ms / 1e6)
        ms = timed(lambda: dist.all_reduce(local))
        row["all_reduce_ms"], row["all_reduce_gbs"] = round(ms, 4), round(n * 4 / ms / 1e6)
        row["barrier_ms"] = round(timed(handle.barrier), 4)
        rows.append(row)
        del handle, theirs, mine
    return rows


def bench(method, device, size, tiny, warmup, steps, use_ddp=True, profile=None, comm_hook=None, bucket_mb=None,
          captured=False, overlap=True, exchange="auto", split=True, row_sparse=True, rank_batches=1):
    batch_size, tokens = (int(x) for x in size.lower().split("x"))
    model = make_model(device, tiny)
    wrapped = _ddp(model, device, use_ddp, comm_hook, bucket_mb)
    objective = make_objective(method, model, tiny, ddp=wrapped is not None)
    call = D.DistributedObjective(objective, wrapped) if wrapped is not None else objective
    step, whole = _training_step(call, objective, model, device, batch_size, tokens, captured, overlap, exchange,
                                 split, row_sparse, rank_batches)
    seconds, timed_replays = _seconds_per_step(step, device, warmup, steps, whole)
    layers = {str(m): step.layers.count(m) for m in sorted(set(step.layers))}
    host = _host_seconds(step, device)
    if profile:
        tag = f"{method}-w{D.world()}{'' if wrapped is not None or D.world() == 1 else '-noddp'}-r{D.rank()}"
        _write_profile(step, device, profile, tag)
    world = D.world()
    graphs = getattr(objective, "graphs", None)
    extra = {} if graphs is None else {"cat_graphs": graphs.num_graphs, "replays_in_forward": graphs.replays_in_forward}
    if layers:
        extra["timed_layers"] = layers  # CAT: how many timed steps mixed at each layer
    if captured:
        extra.update(captured_graphs=whole.num_graphs, replayed_steps=whole.num_replays, timed_replays=timed_replays)
        average = whole.gradient_averager
        if average is not None:  # buckets of the last captured (or eager) step reduced during its backward
            extra.update(overlap=average.overlap, buckets=len(average.buckets), overlapped=average.overlapped,
                         exchange=average.exchange, deferred=average.deferred,
                         sparse_exchanged=average.sparse_exchanged)
    if rank_batches > 1:
        extra["rank_batches"] = rank_batches
    return {"method": method, "world": world, "ddp": wrapped is not None, "size": size, **extra,
            "comm_hook": comm_hook if wrapped is not None else None, "bucket_mb": bucket_mb,
            "nccl_max_ctas": os.environ.get("NCCL_MAX_CTAS"),
            "host_ms": round(min(host) * 1e3, 2), "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else "cpu", "bf16": True, "warmup": warmup, "steps": steps,
            "ms_per_step": round(seconds * 1e3, 3),
            "tokens_per_s": round(world * batch_size * tokens / seconds, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["erm", "cat", "gs"], choices=("erm", "cat", "cat-eager", "gs"))
    parser.add_argument("--size", default=None, help="per-rank batch BxT (default 64x256; --tiny: 4x32)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5; --tiny: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20; --tiny: 2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny BERT on the CPU (smoke test)")
    parser.add_argument("--no-ddp", action="store_true", help="each rank steps on its own, no DDP (the ceiling)")
    parser.add_argument("--comm-hook", choices=("bf16",), default=None,
                        help="DDP communication hook: bf16 = torch's bf16_compress_hook (half the bytes)")
    parser.add_argument("--bucket-mb", type=float, default=None, help="DDP's bucket_cap_mb (default: DDP's, 25)")
    parser.add_argument("--allreduce", action="store_true", help="first, the all-reduce bandwidth of BERT-base's "
                        "gradient size (fp32)")
    parser.add_argument("--interference", action="store_true", help="first, on GPUs: bf16 matmuls and the "
                        "averaging of BERT-base's gradient size (fp32) by each exchange, alone and together")
    parser.add_argument("--copy-bandwidth", action="store_true", help="first, on 2 GPUs: the peer copies the copy "
                        "exchange makes (pull and push, 1, 2 or 4 streams) and NCCL's all-reduce, by buffer size")
    parser.add_argument("--profile", default=None, metavar="DIR", help="write per-rank torch.profiler tables and "
                        "timelines to DIR")
    parser.add_argument("--captured", action="store_true", help="each step one cat_fast CapturedStep (a CUDA graph "
                        "with the gradient all-reduce inside; eager on the CPU)")
    parser.add_argument("--no-overlap", action="store_true", help="with --captured: the gradient all-reduce after "
                        "the backward (the default overlaps it, bucket by bucket)")
    parser.add_argument("--no-split", action="store_true", help="with --captured: the optimizer steps after every "
                        "bucket is averaged (the default steps the others while the last bucket is averaged)")
    parser.add_argument("--exchange", choices=("auto", "nccl", "copy"), default="auto", help="with --captured: how "
                        "the gradient buckets are reduced: NCCL's all-reduce, pulls by the GPUs' copy engines through "
                        "PyTorch's symmetric memory (GPUs of one host), or auto (the library's default: copy where "
                        "every rank can, else nccl; the row names the one used)")
    parser.add_argument("--dense-embeddings", action="store_true", help="with --captured and the copy exchange: "
                        "the vocabulary table pulled whole (the default reads only the rows the other rank's gradient "
                        "uses)")
    parser.add_argument("--packed", choices=("auto", "true", "false"), default="auto", help="the training layers' "
                        "packed path (`cat_fast.layers.training.PACKED`; default auto)")
    parser.add_argument("--rank-batches", type=int, default=1, metavar="N", help="one process: step through the "
                        "batches of ranks 0..N-1 in turn, the data N ranks take (a baseline for a packed step, whose "
                        "time follows its batch's real tokens; default 1: rank 0's)")
    args = parser.parse_args(argv)
    if args.rank_batches < 1:
        parser.error(f"--rank-batches: expected a count >= 1, got {args.rank_batches}")
    from cat_fast.layers import training

    training.PACKED = {"auto": "auto", "true": True, "false": False}[args.packed]
    size = args.size or ("4x32" if args.tiny else "64x256")
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    steps = args.steps if args.steps is not None else (2 if args.tiny else 20)
    wanted = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    device, rank, world = D.init_from_env(wanted)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        if args.rank_batches > 1 and world > 1:
            parser.error("--rank-batches: a one-process baseline; under torchrun each rank takes its own batch")
        if args.allreduce and world > 1:
            row = allreduce_row(device, 2**16 if args.tiny else 109_483_778)
            if rank == 0:
                print(json.dumps(row), flush=True)
        if args.exchange == "copy" and (device.type != "cuda" or not args.captured):
            parser.error("--exchange copy: expected --captured steps on GPUs")
        if args.interference:
            if device.type != "cuda" or world < 2:
                parser.error("--interference: expected a run on 2 or more GPUs (torchrun)")
            for row in interference_rows(device, 109_483_778, ("nccl", "copy")):
                if rank == 0:
                    print(json.dumps(row), flush=True)
        if args.copy_bandwidth:
            if device.type != "cuda" or world != 2:
                parser.error("--copy-bandwidth: expected a run on 2 GPUs (torchrun --nproc_per_node 2)")
            for row in copy_bandwidth_rows(device):
                if rank == 0:
                    print(json.dumps(row), flush=True)
        for method in args.methods:
            row = bench(method, device, size, args.tiny, warmup, steps, use_ddp=not args.no_ddp, profile=args.profile,
                        comm_hook=args.comm_hook, bucket_mb=args.bucket_mb, captured=args.captured,
                        overlap=not args.no_overlap, exchange=args.exchange, split=not args.no_split,
                        row_sparse=not args.dense_embeddings, rank_batches=args.rank_batches)
            if rank == 0:
                print(json.dumps({**row, "packed": args.packed}), flush=True)
    finally:
        D.leave()  # the garbage (CapturedStep's agreement group among it) first, then the groups


if __name__ == "__main__":
    main()
