"""`cat_fast.gradient_averaging.GradientAverager` on 2 processes (gloo): the average of the complete gradients in
every step, its buckets reduced during the backward once a step's key has been seen, and the ranks' agreement when a
step's backward accumulates where its key's first step did not."""
import gc

import pytest
import torch
import torch.distributed as dist

from cat_fast.gradient_averaging import GradientAverager
from cat_fast.step_ddp import Lockstep
from tests.ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 30), torch.nn.Tanh(),
                               torch.nn.Linear(30, 3))


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
    torch.save(rows, f"{out}.{rank}")
    torch.save(_compressed_rows(model, rank, host), f"{out}.{rank}.compressed")


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
        for step, name, _, error, buckets in rows[:-2]:
            assert buckets == (3 if name == "overlap" else 1)
            assert error < 1e-6, (rank, step, name, error)


def test_buckets_are_reduced_during_the_backward_once_the_key_is_known(spawned):
    """Step 0 and step 2 are the first of their keys (after the backward); steps 1 and 3 reduce every bucket while
    the backward runs; without overlap none."""
    for rows in spawned:
        overlapped = {step: n for step, name, n, _, _ in rows[:-2] if name == "overlap"}
        buckets = rows[0][4]
        assert overlapped[0] == 0 and overlapped[2] == 0
        assert overlapped[1] == buckets and overlapped[3] == buckets
        assert all(n == 0 for _, name, n, _, _ in rows[:-2] if name == "plain")


def test_a_backward_that_differs_from_its_keys_first_is_redone_on_every_rank(spawned):
    """Step 4: rank 1 runs two backwards where key "a"'s first step ran one; both ranks redo the average (nothing
    counted as overlapped), and both get the average of the complete gradients. Step 5: a layer unused on rank 0
    (zeros from it) gives its accumulations fewer than expected, so its buckets wait for the end of the backward."""
    for rows in spawned:
        overlapped = {step: n for step, name, n, _, _ in rows[:-2] if name == "overlap"}
        assert overlapped[4] == 0
        assert overlapped[5] < rows[0][4]


def test_the_hooks_go_with_the_averager(spawned):
    """The parameters outlive the averager; its hooks do not (the plain averager, overlap off, has none)."""
    for rows in spawned:
        name, before, after = rows[-1]
        assert name == "hooks" and before == 1 and after == 0


def test_an_abandoned_step_leaves_the_next_whole(spawned):
    """Key "c": a whole step (counted), then a backward of the head only, abandoned after its bucket was launched,
    then whole steps: each the average of its complete gradients."""
    for rows in spawned:
        name, (first, launched, closed, second, third) = rows[-2]
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
