"""`cat_fast.gradient_averaging.GradientAverager` on 2 processes (gloo): the average of the complete gradients in
every step, its buckets reduced during the backward once a step's key has been seen, and the ranks' agreement when a
step's backward accumulates where its key's first step did not."""
import gc
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from cat_fast import gradient_averaging
from cat_fast.gradient_averaging import GradientAverager, _spans
from cat_fast.graphs import side_stream
from cat_fast.step_ddp import Lockstep
from tests.ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 30), torch.nn.Tanh(),
                               torch.nn.Linear(30, 3))


class _Tokens(torch.nn.Module):
    """A vocabulary table (rows of the ids a batch holds get gradients), a position table, a head; ``unused``: the
    vocabulary table gets no gradient on this call."""

    def __init__(self, seed, vocabulary=300, width=20):
        super().__init__()
        torch.manual_seed(seed)
        self.words = torch.nn.Embedding(vocabulary, width)
        self.positions = torch.nn.Embedding(8, width)
        self.head = torch.nn.Linear(width, 3)
        self.unused = False

    def forward(self, ids):
        words = self.words.weight.detach() if self.unused else self.words.weight
        h = torch.nn.functional.embedding(ids, words) + self.positions.weight[:ids.shape[1]]
        return self.head(torch.tanh(h).mean(1))


def _ids(seed, rank, vocabulary=300):
    return torch.randint(0, vocabulary, (4, 6), generator=torch.Generator().manual_seed(seed + 10 * rank))


def _captured_step(net, averager, static):
    """A CUDA graph of one averaged step of `net` on `static` (gradients zeroed in place, the backward, the average),
    captured after two eager steps of its key on a side stream: the key's first (counted), then one overlapped."""

    def step():
        for p in net.parameters():
            if p.grad is not None:
                p.grad.zero_()
        averager.begin("g")
        net(static).square().sum().backward()
        averager()

    with side_stream(static.device):
        for _ in range(2):
            step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _sparse_rows(rank, host, device, exchanges):
    """("sparse", what, step, exchange, tables exchanged by rows, buckets, the table's bucket members, error against
    the exact average, against NCCL's): a vocabulary table passed as ``sparse_rows``, eager steps of one key with
    the overlap (step 2: the table unused on rank 0, redone), then (GPUs) replayed as a CUDA graph and deferred."""
    agree = lambda flag: not host.all(not flag)  # noqa: E731
    rows = []
    nets = {name: _Tokens(0).to(device) for name in exchanges}
    averagers = {name: GradientAverager(list(net.parameters()), bucket_mb=2**-12, agree=agree, exchange=name,
                                        sparse_rows=[net.words.weight]) for name, net in nets.items()}
    for i in range(4):
        ids = _ids(1100 + i, rank).to(device)
        unused = i == 2 and rank == 0
        nets[exchanges[0]].unused = unused
        exact = _reference(nets[exchanges[0]], ids, 1)
        got = {}
        for name, net in nets.items():
            net.unused = unused
            net.zero_grad(set_to_none=True)
            averagers[name].begin("s")
            net(ids).square().sum().backward()
            averagers[name]()
            got[name] = [p.grad.clone() for p in net.parameters()]
        for name, averager in averagers.items():
            table = next(b for b in averager.buckets if any(p is nets[name].words.weight for p in b.members))
            rows.append(("sparse", "eager", i, name, averager.sparse_exchanged, len(averager.buckets),
                         len(table.members), max(float((g - e).abs().max()) for g, e in zip(got[name], exact)),
                         max(float((g - n).abs().max()) for g, n in zip(got[name], got[exchanges[0]]))))
    if device.type != "cuda":
        return rows
    net, ref = nets["copy"], nets["nccl"]
    net.unused = ref.unused = False
    averager, plain = averagers["copy"], averagers["nccl"]
    static = torch.zeros(4, 6, dtype=torch.long, device=device)
    graph = _captured_step(net, averager, static)
    for i in range(3):
        ids = _ids(1200 + i, rank).to(device)
        static.copy_(ids)
        graph.replay()
        ref.zero_grad(set_to_none=True)
        plain.begin()
        ref(ids).square().sum().backward()
        plain()
        rows.append(("sparse", "captured", i, "copy", averager.sparse_exchanged, len(averager.buckets), 1,
                     0.0, max(float((p.grad - q.grad).abs().max()) for p, q in zip(net.parameters(),
                                                                                   ref.parameters()))))
    torch.cuda.synchronize()
    del graph
    for i in range(2):  # defer_last: the table (the last bucket) joined after the others
        ids = _ids(1300 + i, rank).to(device)
        for name, n in nets.items():
            n.zero_grad(set_to_none=True)
            averagers[name].begin("d")
            n(ids).square().sum().backward()
        late = averager(defer_last=True)
        waiting = [p is net.words.weight and p.grad is None for p in late]
        plain()
        averager.finish()
        rows.append(("sparse", "deferred", i, "copy", len(late), all(waiting), 1, 0.0,
                     max(float((p.grad - q.grad).abs().max()) for p, q in zip(net.parameters(), ref.parameters()))))
    return rows


def _reference(model, x, passes, skip_last=False):
    """The gradients of `passes` backwards (summed) averaged over the ranks by all_gather."""
    model.zero_grad(set_to_none=True)
    for _ in range(passes):
        model(x).square().sum().backward()
    if skip_last:
        model[4].weight.grad = model[4].bias.grad = None
    out = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        every = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(every, g.contiguous())
        out.append(torch.stack(every).mean(0))
    model.zero_grad(set_to_none=True)
    return out


def _worker(rank, out):
    model = _model(0)
    host = Lockstep()
    # 256-byte buckets: the six parameters make three
    averager = GradientAverager(list(model.parameters()), agree=lambda flag: not host.all(not flag), bucket_mb=2**-12)
    plain = GradientAverager(list(model.parameters()), overlap=False)
    # (key, backward passes on this rank, the last layer unused on this rank)
    steps = [("a", 1, False), ("a", 1, False), ("b", 2, False), ("b", 2, False), ("a", 2 if rank == 1 else 1, False),
             ("a", 1, rank == 0)]
    rows = []
    for i, (key, passes, skip_last) in enumerate(steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * i + rank))
        want = _reference(model, x, passes, skip_last)
        for name, avg in (("overlap", averager), ("plain", plain)):
            model.zero_grad(set_to_none=True)
            avg.begin(key)
            for _ in range(passes):
                y = model[:4](x)
                head = y @ model[4].weight.detach().t() + model[4].bias.detach() if skip_last else model[4](y)
                head.square().sum().backward()
            avg()
            got = [p.grad.clone() for p in model.parameters()]
            error = max(float((g - w).abs().max()) for g, w in zip(got, want))
            rows.append((i, name, avg.overlapped, error, len(avg.buckets)))
    # a step abandoned after part of its backward (an exception there): its launched bucket is waited for, nothing is
    # counted, and the next step of its key is whole
    partial = []
    for key_step in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(500 + key_step + rank))
        want = _reference(model, x, 1)
        model.zero_grad(set_to_none=True)
        averager.begin("c")
        if key_step == 1:
            model[4](torch.randn(5, 30)).square().sum().backward()  # the head only: bucket 0
            partial.append(len(averager._open["launched"]))
            averager.abandon()
            partial.append(averager._open is None)  # a backward from here on is not counted
            model.zero_grad(set_to_none=True)
            averager.begin("c")
        model(x).square().sum().backward()
        averager()
        partial.append(max(float((p.grad - w).abs().max()) for p, w in zip(model.parameters(), want)))
    rows.append(("abandoned", partial))
    weight = model[0].weight
    before = len(weight._post_accumulate_grad_hooks or {})
    del averager
    gc.collect()
    rows.append(("hooks", before, len(weight._post_accumulate_grad_hooks or {})))
    auto = GradientAverager(list(model.parameters()))  # the default exchange, resolved without a collective
    copy_missing = gradient_averaging.symmetric_zeros  # "auto" never reaches for symmetric memory on gloo
    gradient_averaging.symmetric_zeros = None
    try:
        auto = auto.exchange, GradientAverager(list(model.parameters()), exchange="auto").exchange
    finally:
        gradient_averaging.symmetric_zeros = copy_missing
    try:  # the copy engines' exchange is for GPUs: refused on CPU parameters, naming the argument
        GradientAverager(list(model.parameters()), exchange="copy")
        rows.append(("copy on the CPU", None))
    except ValueError as exc:
        rows.append(("copy on the CPU", str(exc)))
    rows.append(("auto on the CPU",) + auto)
    torch.save(rows, f"{out}.{rank}")
    torch.save(_compressed_rows(model, rank, host), f"{out}.{rank}.compressed")
    torch.save(_deferred_rows(model, rank, host), f"{out}.{rank}.deferred")
    torch.save(_sparse_rows(rank, host, torch.device("cpu"), ("nccl",)), f"{out}.{rank}.sparse")


def _deferred_rows(model, rank, host):
    """(compress, step, parameters deferred, last bucket's count, those .grad None before finish, the others' set,
    error against the exact average or the hook's) of ``averager(defer_last=True)`` steps; step 2 is not finished:
    the next step's ``begin`` joins it."""
    rows = []
    for compress in (None, torch.bfloat16):
        averager = GradientAverager(list(model.parameters()), compress=compress, bucket_mb=2**-12,
                                    agree=lambda flag: not host.all(not flag))
        for i in range(4):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1000 + i + 10 * rank))
            want = _reference(model, x, 1) if compress is None else _compressed_reference(model, x, compress)
            averager.begin("d")
            model(x).square().sum().backward()
            late = {id(p) for p in averager(defer_last=True)}
            waiting = all(p.grad is None for p in model.parameters() if id(p) in late)
            ready = all(p.grad is not None for p in model.parameters() if id(p) not in late)
            if i == 2:
                averager.begin("d")
                averager.abandon()
            else:
                averager.finish()
            rows.append((str(compress), i, averager.deferred, len(late), len(averager.buckets[-1].members), waiting,
                         ready, max(float((p.grad - w).abs().max()) for p, w in zip(model.parameters(), want))))
            model.zero_grad(set_to_none=True)
    return rows


def _compressed_reference(model, x, dtype):
    """What DDP's compression hook gives: each rank's gradient cast to `dtype` and divided by the world size there,
    summed in `dtype` in rank order, cast back."""
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    out = []
    for p in model.parameters():
        every = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(every, p.grad.contiguous())
        total = every[0].to(dtype).div_(len(every))
        for g in every[1:]:
            total = total + g.to(dtype).div_(len(every))
        out.append(total.to(p.dtype))
    model.zero_grad(set_to_none=True)
    return out


def _compressed_rows(model, rank, host):
    """(dtype, overlap, step, buckets overlapped less those expected: all from the key's second step on with the
    overlap, error against the hook's result, difference from the exact average) of averagers that compress,
    three steps of one key each."""
    rows = []
    half = _model(0).to(torch.bfloat16)  # already in the hook's dtype: divided in place, no 16-bit copy
    for net, dtype in ((model, torch.bfloat16), (model, torch.float16), (half, torch.bfloat16)):
        for overlap in (False, True):
            averager = GradientAverager(list(net.parameters()), overlap=overlap, compress=dtype, bucket_mb=2**-12,
                                        agree=lambda flag: not host.all(not flag))
            for i in range(3):
                x = torch.randn(5, 6, generator=torch.Generator().manual_seed(900 + i + 10 * rank))
                x = x.to(next(net.parameters()).dtype)
                exact = _reference(net, x, 1)
                want = _compressed_reference(net, x, dtype)
                averager.begin("z")
                net(x).square().sum().backward()
                averager()
                got = [p.grad.clone() for p in net.parameters()]
                net.zero_grad(set_to_none=True)
                if net is half:
                    assert all(b.wire is None for b in averager.buckets)
                expected = len(averager.buckets) if overlap and i else 0
                rows.append((str(dtype), overlap, i, averager.overlapped - expected,
                             max(float((g - w).abs().max()) for g, w in zip(got, want)),
                             max(float((g - e).abs().max()) for g, e in zip(got, exact))))
            del averager
            gc.collect()
    return rows


@pytest.fixture(scope="module")
def spawned_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("averager")
    spawn(_worker, str(tmp / "out"), tmp_path=tmp, world=2)
    return tmp / "out"


@pytest.fixture(scope="module")
def spawned(spawned_files):
    return [torch.load(f"{spawned_files}.{r}", weights_only=False) for r in range(2)]


def test_every_step_averages_the_complete_gradients(spawned):
    for rank, rows in enumerate(spawned):
        for step, name, _, error, buckets in rows[:-4]:
            assert buckets == (3 if name == "overlap" else 1)
            assert error < 1e-6, (rank, step, name, error)


def test_buckets_are_reduced_during_the_backward_once_the_key_is_known(spawned):
    """Step 0 and step 2 are the first of their keys (after the backward); steps 1 and 3 reduce every bucket while
    the backward runs; without overlap none."""
    for rows in spawned:
        overlapped = {step: n for step, name, n, _, _ in rows[:-4] if name == "overlap"}
        buckets = rows[0][4]
        assert overlapped[0] == 0 and overlapped[2] == 0
        assert overlapped[1] == buckets and overlapped[3] == buckets
        assert all(n == 0 for _, name, n, _, _ in rows[:-4] if name == "plain")


def test_a_backward_that_differs_from_its_keys_first_is_redone_on_every_rank(spawned):
    """Step 4: rank 1 runs two backwards where key "a"'s first step ran one; both ranks redo the average (nothing
    counted as overlapped), and both get the average of the complete gradients. Step 5: a layer unused on rank 0
    (zeros from it) gives its accumulations fewer than expected, so its buckets wait for the end of the backward."""
    for rows in spawned:
        overlapped = {step: n for step, name, n, _, _ in rows[:-4] if name == "overlap"}
        assert overlapped[4] == 0
        assert overlapped[5] < rows[0][4]


def test_the_hooks_go_with_the_averager(spawned):
    """The parameters outlive the averager; its hooks do not (the plain averager, overlap off, has none)."""
    for rows in spawned:
        name, before, after = rows[-3]
        assert name == "hooks" and before == 1 and after == 0


def test_an_abandoned_step_leaves_the_next_whole(spawned):
    """Key "c": a whole step (counted), then a backward of the head only, abandoned after its bucket was launched,
    then whole steps: each the average of its complete gradients."""
    for rows in spawned:
        name, (first, launched, closed, second, third) = rows[-4]
        assert name == "abandoned" and launched == 1 and closed
        assert max(first, second, third) < 1e-6


def test_compressed_buckets_average_as_the_compression_hooks(spawned_files):
    """compress=bf16 / fp16: each step equals what DDP's bf16_compress_hook / fp16_compress_hook give (each rank's
    share cast and divided by the world size in 16 bits, summed in 16 bits), not the exact average, with and without
    the overlap (every bucket reduced during the backward from the key's second step on); and for a bf16 model, whose
    buckets are already 16-bit, the same without a copy."""
    for rank in range(2):
        rows = torch.load(f"{spawned_files}.{rank}.compressed", weights_only=False)
        assert len(rows) == 18
        for k, (dtype, overlap, step, overlapped, error, off_exact) in enumerate(rows):
            assert error == 0, (rank, dtype, overlap, step, error)
            assert off_exact > 0 or k >= 12, (rank, dtype, overlap, step)  # a bf16 model: both sums in bf16
            assert overlapped == 0, (rank, dtype, overlap, step, overlapped)  # all buckets, or none, as expected
    with pytest.raises(ValueError, match="compress: expected None, torch.bfloat16 or torch.float16"):
        GradientAverager([], compress=torch.float64)


def test_the_last_bucket_can_be_joined_after_the_others(spawned_files):
    """``averager(defer_last=True)``: the other buckets' ``.grad`` set at once (their collectives waited for), the
    last bucket's parameters returned with ``.grad`` None, and after ``finish()`` (or the next ``begin``) the same
    average as without: exact in fp32, the hook's in bf16 (whose cast back waits for ``finish`` too)."""
    for rank in range(2):
        rows = torch.load(f"{spawned_files}.{rank}.deferred", weights_only=False)
        assert len(rows) == 8
        for compress, step, deferred, late, last, waiting, ready, error in rows:
            assert deferred == late == last > 0 and waiting and ready, (rank, compress, step)
            assert error < 1e-6 if compress == "None" else error == 0, (rank, compress, step, error)


def test_a_row_sparse_table_is_a_bucket_of_its_own_and_averaged(spawned_files):
    """``sparse_rows`` on the CPU (gloo): the vocabulary table is a bucket of its own (the other three parameters,
    in 256-byte buckets, make one), averaged like any other (its rows are exchanged only between GPUs), with the
    overlap; and in a step where rank 0 does not use it, so that rank 1 reduces its bucket during its backward and
    rank 0 after agreeing, the ranks' collectives still pair (the agreement has a gloo group of its own)."""
    for rank in range(2):
        rows = torch.load(f"{spawned_files}.{rank}.sparse", weights_only=False)
        assert len(rows) == 4
        for _, what, step, name, by_rows, buckets, members, off_exact, _ in rows:
            assert by_rows == 0 and members == 1 and buckets == 2, (rank, step)
            assert off_exact < 1e-6, (rank, step, off_exact)


def test_sparse_rows_are_checked_and_embedding_tables_named():
    with pytest.raises(ValueError, match="sparse_rows: expected 2-D parameters among params"):
        GradientAverager([], sparse_rows=[torch.nn.Parameter(torch.zeros(3, 2))])
    net = _Tokens(0, vocabulary=5000)
    assert gradient_averaging.embedding_tables(net) == [net.words.weight]  # not the 8-row position table
    assert gradient_averaging.embedding_tables(net, min_rows=8) == [net.words.weight, net.positions.weight]
    net.head.weight = net.positions.weight  # a table another module uses has dense gradients: not named
    assert gradient_averaging.embedding_tables(net, min_rows=8) == [net.words.weight]


def test_the_copy_exchange_is_refused_on_cpu_parameters_and_names_are_checked(spawned):
    for rows in spawned:
        name, message = rows[-2]
        assert name == "copy on the CPU" and message is not None and message.startswith("exchange='copy': expected "
                                                                                          "parameters on CUDA devices")
    with pytest.raises(ValueError, match="exchange: expected one of"):
        GradientAverager([], exchange="nvlink")


def test_the_default_exchange_is_nccl_where_the_copy_engines_cannot_serve(spawned):
    """exchange="auto" (the default) on CPU parameters over gloo is "nccl", decided without symmetric memory."""
    for rows in spawned:
        assert rows[-1] == ("auto on the CPU", "nccl", "nccl")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 93, 1230, 280])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_ranks_spans_tile_a_bucket(n, world):
    spans = _spans(n, world)
    assert len(spans) == world and spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(0 <= end - start <= -(-n // world) for start, end in spans)


# ----------------------------------------------------------------------------- 2 GPUs: the copy engines' exchange

def _copy_worker(rank, out):
    """Per step: the copy exchange's gradients against NCCL's all-reduce of the same model and batch, and against
    the exact average; eager (with and without overlap, fp32 and bf16-compressed) and replayed as a CUDA graph."""
    device = torch.device("cuda", rank)
    host = Lockstep()
    agree = lambda flag: not host.all(not flag)  # noqa: E731
    rows = []
    for compress in (None, torch.bfloat16):
        for overlap in (False, True):
            nets = {name: _model(0).to(device) for name in ("nccl", "copy")}
            averagers = {name: GradientAverager(list(net.parameters()), overlap=overlap, compress=compress,
                                                bucket_mb=2**-12, agree=agree, exchange=name)
                         for name, net in nets.items()}
            for i in range(4):  # step 3: rank 1 runs two backwards where the key's first ran one (redone)
                passes = 2 if i == 3 and rank == 1 else 1
                x = torch.randn(5, 6, generator=torch.Generator().manual_seed(700 + i + 10 * rank)).to(device)
                exact = _reference(nets["copy"], x, passes)
                got = {}
                for name, net in nets.items():
                    net.zero_grad(set_to_none=True)
                    averagers[name].begin("k")
                    for _ in range(passes):
                        net(x).square().sum().backward()
                    averagers[name]()
                    got[name] = [p.grad.clone() for p in net.parameters()]
                rows.append(("eager", str(compress), overlap, i, averagers["copy"].overlapped,
                             len(averagers["copy"].buckets),
                             max(float((c - n).abs().max()) for c, n in zip(got["copy"], got["nccl"])),
                             max(float((c - e).abs().max()) for c, e in zip(got["copy"], exact))))
            del averagers
            gc.collect()
    net, ref = _model(0).to(device), _model(0).to(device)
    averager = GradientAverager(list(net.parameters()), bucket_mb=2**-12, agree=agree, exchange="copy")
    plain = GradientAverager(list(ref.parameters()), overlap=False, bucket_mb=2**-12, exchange="nccl")
    static = torch.zeros(5, 6, device=device)
    graph = _captured_step(net, averager, static)
    captured_overlapped = averager.overlapped
    for i in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(800 + i + 10 * rank)).to(device)
        static.copy_(x)
        graph.replay()
        ref.zero_grad(set_to_none=True)
        plain.begin()
        ref(x).square().sum().backward()
        plain()
        rows.append(("captured", i, captured_overlapped, len(averager.buckets),
                     max(float((p.grad - q.grad).abs().max()) for p, q in zip(net.parameters(), ref.parameters()))))
    torch.cuda.synchronize()
    del graph
    # defer_last: the other buckets' .grad at once, the last bucket's None until finish(), then the same averages
    deferring = GradientAverager(list(ref.parameters()), bucket_mb=2**-12, agree=agree, exchange="copy")
    for i in range(2):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(850 + i + 10 * rank)).to(device)
        exact = _reference(ref, x, 1)
        ref.zero_grad(set_to_none=True)
        deferring.begin("d")
        ref(x).square().sum().backward()
        late = {id(p) for p in deferring(defer_last=True)}
        waiting = [p.grad is None for p in ref.parameters() if id(p) in late]
        ready = [p.grad is not None for p in ref.parameters() if id(p) not in late]
        deferring.finish()
        rows.append(("deferred", i, deferring.deferred, len(late), len(deferring.buckets[-1].members), all(waiting),
                     all(ready), max(float((p.grad - e).abs().max()) for p, e in zip(ref.parameters(), exact))))
    # the default ("auto") on 2 GPUs of one host is the copy exchange; where one rank cannot allocate symmetric
    # memory, every rank falls back to NCCL (with a warning) and still averages
    default = GradientAverager(list(net.parameters()), agree=agree).exchange
    saved = gradient_averaging.symmetric_zeros
    if rank == 1:
        gradient_averaging.symmetric_zeros = _refuse
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            fallen = GradientAverager(list(ref.parameters()), overlap=False, bucket_mb=2**-12)
    finally:
        gradient_averaging.symmetric_zeros = saved
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(900 + rank)).to(device)
    exact = _reference(ref, x, 1)
    fallen.begin()
    ref(x).square().sum().backward()
    fallen()
    rows.append(("auto", default, fallen.exchange, sum("could not be shared" in str(w.message) for w in caught),
                 max(float((p.grad - e).abs().max()) for p, e in zip(ref.parameters(), exact))))
    torch.save(rows, f"{out}.{rank}")
    torch.save(_sparse_rows(rank, host, device, ("nccl", "copy")), f"{out}.{rank}.sparse")


def _refuse(*args, **kwargs):
    raise RuntimeError("no symmetric memory on this rank")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_gpu_the_copy_exchange_equals_nccl_all_reduce(tmp_path):
    """exchange="copy" on 2 GPUs: every step's gradients equal NCCL's all-reduce of the same gradients to the bit
    (two shares, one sum), fp32 and bf16-compressed, with the overlap (every bucket reduced during the backward from
    the key's second step on) and without, eagerly and replayed as a CUDA graph; and they are the average (not this
    rank's own gradient), also in a step that one rank's extra backward makes every rank redo. The buckets (93, 1230
    and 280 elements) split into unequal spans. With ``defer_last`` the last bucket's ``.grad`` waits for
    ``finish()``, the others' do not, and the averages are the same. The default exchange there is "copy"; where one
    rank cannot make symmetric memory, both use "nccl", warned, and average. A vocabulary table passed as
    ``sparse_rows`` (about 24 of its 300 rows used per rank and step) is exchanged by its nonzero rows and equals
    NCCL's all-reduce of the whole table to the bit: eager (also where one rank does not use it), replayed as a
    CUDA graph, and deferred."""
    spawn(_copy_worker, str(tmp_path / "out"), tmp_path=tmp_path, world=2, backend="nccl")
    for rank in range(2):
        rows = torch.load(f"{tmp_path / 'out'}.{rank}", weights_only=False)
        eager = [r for r in rows if r[0] == "eager"]
        captured = [r for r in rows if r[0] == "captured"]
        assert len(eager) == 16 and len(captured) == 3
        for _, step, deferred, late, last, waiting, ready, off_exact in (r for r in rows if r[0] == "deferred"):
            assert deferred == late == last > 0 and waiting and ready and off_exact < 1e-6, (rank, step)
        _, default, fallen, warned, off_exact = rows[-1]
        assert default == "copy" and fallen == "nccl" and warned == 1 and off_exact < 1e-6, (rank, rows[-1])
        for _, dtype, overlap, step, overlapped, buckets, off_nccl, off_exact in eager:
            assert buckets == 3
            assert off_nccl == 0, (rank, dtype, overlap, step, off_nccl)
            expected = buckets if overlap and step in (1, 2) else 0  # step 3 redone after the backward
            assert overlapped == expected, (rank, dtype, overlap, step, overlapped)
            if dtype == "None":
                assert off_exact < 1e-6, (rank, overlap, step, off_exact)
        for _, step, overlapped, buckets, off_nccl in captured:
            assert overlapped == buckets == 3
            assert off_nccl == 0, (rank, step, off_nccl)
        # a vocabulary table as sparse_rows: exchanged by its nonzero rows (copy), equal to NCCL's all-reduce of the
        # whole table to the bit, eager (one step with the table unused on rank 0), replayed and deferred
        sparse = torch.load(f"{tmp_path / 'out'}.{rank}.sparse", weights_only=False)
        assert [r[1] for r in sparse] == ["eager"] * 8 + ["captured"] * 3 + ["deferred"] * 2
        for _, what, step, name, by_rows, buckets, members, off_exact, off_nccl in sparse:
            if what == "eager":
                assert by_rows == (name == "copy") and buckets == 2 and members == 1, (rank, step, name)
                assert off_exact < 1e-6 and off_nccl == 0, (rank, step, name, off_exact, off_nccl)
            elif what == "captured":
                assert by_rows == 1 and off_nccl == 0, (rank, step, off_nccl)
            else:  # deferred: (late parameters, the table's .grad None until finish)
                assert by_rows == 1 and buckets and off_nccl == 0, (rank, step, by_rows, off_nccl)


def test_the_environment_variable_sets_the_default_exchange(monkeypatch):
    """CAT_FAST_GRADIENT_EXCHANGE, read at import, is the default for a whole run; a value that is not an exchange
    is refused by name, naming the variable."""
    env = dict(os.environ, CAT_FAST_GRADIENT_EXCHANGE="nccl")
    out = subprocess.run([sys.executable, "-c", "from cat_fast import gradient_averaging as g; print(g.EXCHANGE)"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "nccl"
    monkeypatch.setenv("CAT_FAST_GRADIENT_EXCHANGE", "nvlink")
    monkeypatch.setattr(gradient_averaging, "EXCHANGE", "nvlink")
    with pytest.raises(ValueError, match="got 'nvlink' \\(from the environment variable CAT_FAST_GRADIENT_EXCHANGE\\)"):
        GradientAverager([])
