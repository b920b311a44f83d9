"""The gradient average of a step that runs outside DDP's forward (`cat_fast.step_ddp`), overlapped with the backward.

`GradientAverager` keeps each dtype's gradients in one flat buffer made once, cut into buckets of about
``bucket_mb`` MiB in the reverse order of the parameters (the order a backward finishes them). Each bucket is scaled
by 1/world, as DDP scales its share, and all-reduced; each ``.grad`` is then its view of the result.

Overlap. A step is bracketed by ``begin(key)`` before its backward and ``averager()`` after it. Parameters carry
post-accumulate-grad hooks; while a step is open they count, per parameter, the accumulations into ``.grad``. How
many a step of a given ``key`` makes (one for most steps; more where an objective runs a backward inside the
backward, as low-memory first-order GS does; none for an unused parameter) is learned from the first step of that
key, which averages after its backward as without overlap. In later steps of the key, a bucket whose parameters
have all reached their counts is reduced at once, while the backward goes on: on a GPU on a stream of its own that
waits for the accumulations (inside a CUDA-graph capture that stream joins the capture, so the replayed graph
overlaps the same way), on the CPU as an asynchronous collective. Buckets are reduced strictly in index order, so
that every rank issues the same collectives in the same order whatever its backward's timing; ``averager()``
reduces the buckets left and joins the stream.

Compression (``compress=torch.bfloat16`` or ``torch.float16``): what DDP's ``bf16_compress_hook`` /
``fp16_compress_hook`` do to a bucket, done to each of these: the bucket cast to the 16-bit dtype and divided by
the world size there, all-reduced in 16 bits (half the bytes on the wire), and cast back into the bucket. Not exact:
each rank's share and the sum are rounded to 16 bits, as with the hook. `cat_fast.step_ddp` uses it where the DDP
module has one of those two hooks.

Exchange (``exchange="auto"``, the default, ``"nccl"`` or ``"copy"``). ``"nccl"`` all-reduces each bucket with NCCL,
whose kernels take multiprocessors from the backward they overlap. ``"copy"`` (GPUs of one host with peer access;
PyTorch's symmetric memory) moves the bytes with the GPUs' copy engines instead: each exchanged buffer is allocated in
symmetric memory, and each bucket, cut into one span per rank, is reduced in two pulls: rank r copies span r of
every other rank's bucket, sums the ranks' shares in rank order into its own span r (the only kernel: a sum over 1/N
of the bucket, each share times 1/N there rather than the whole bucket before: the same products), and then copies
every other rank's summed span back. Device-side barriers (one kernel each) order
the pulls: before the first, between the two, and once after a step's last bucket, so that no rank writes a buffer
that another is still reading. Every rank gets the same result, the ranks' shares summed in rank order. The bytes
sent are an NCCL ring's, 2(N-1)/N of the bucket per rank. ``"auto"`` is ``"copy"`` where every rank can use it
(an NCCL group whose ranks run on one host, every parameter on a GPU that reaches the host's other GPUs, PyTorch's
symmetric memory present and the buffers shared without error; the ranks agree in one small all-reduce) and
``"nccl"`` elsewhere; ``exchange`` names the one chosen. The environment variable ``CAT_FAST_GRADIENT_EXCHANGE``
(read at import) sets the default for a whole run, e.g. ``nccl`` where symmetric memory misbehaves.

Row-sparse tables (``sparse_rows``: an embedding table's weight, whose gradient is zero outside the rows of the
ids a batch holds). Each such parameter is a bucket of its own. With exchange="copy" between 2 GPUs, uncompressed,
it is not copied into its buffer and pulled whole: each rank flags the rows of its gradient that are not zero and
copies them into a staging table in symmetric memory (one kernel), a barrier, and then one kernel writes the
average into the bucket, reading the other rank's staged row only where that rank flagged it
(`cat_fast.kernels.triton.row_exchange`). The link carries the rows the batches touch, not the table (at BERT's
30,522 rows and 8 × 128 tokens, 2-3 % of it), and the result is the same bits as the all-reduce. The staging
table costs one more copy of the table per GPU. Elsewhere (NCCL, more ranks, compression, the CPU) the bucket is
reduced like any other. `ROW_SPARSE` = False turns it off for the averagers made from then on (comparisons).
`embedding_tables(module)` names the tables `cat_fast.step_ddp` passes.

The exposed tail. The last bucket (the embeddings, whose gradients the backward finishes last) is reduced after the
backward, and nothing else is left to hide it. ``averager(defer_last=True)`` therefore joins every bucket but that
one, returns its parameters (``.grad`` None meanwhile) and lets `finish()` join it: `cat_fast.step.CapturedStep`
steps the optimizer over the other parameters in between, then over those (`cat_fast.step`; for PyTorch's
per-parameter optimizers the two steps are the one step, bit for bit).

A parameter that accumulates again after its bucket was reduced (a step whose path differs from its key's first
step) would leave that bucket's average stale. Each rank notes it; the ranks agree on a host-side group (`agree`,
no GPU synchronisation) whether any rank saw it, and if one did, every rank reduces every bucket again after the
backward, so the result is always the average of the complete gradients.
"""
from __future__ import annotations

import collections
import os
import socket
import warnings
import weakref
import zlib

import torch
import torch.distributed as dist

__all__ = ["GradientAverager", "BUCKET_MB", "EXCHANGE", "OVERLAP", "ROW_SPARSE", "SPARSE_MIN_ROWS",
           "checked_exchange", "embedding_tables", "share_symmetric", "symmetric_zeros"]

BUCKET_MB = 25.0  # DDP's default bucket_cap_mb
OVERLAP = True  # the averagers made from here on overlap (False: every bucket after the backward, for comparisons)
ROW_SPARSE = True  # the averagers made from here on exchange only the nonzero rows of `sparse_rows` (module docstring)
SPARSE_MIN_ROWS = 4096  # `embedding_tables`: the smallest table it names (a vocabulary, not positions or types)
# how the averagers made from here on reduce a bucket: "auto", "nccl" or "copy" (module docstring); the environment
# variable sets it for a whole run (the CLI and the Trainer under torchrun) without code
EXCHANGE_VARIABLE = "CAT_FAST_GRADIENT_EXCHANGE"
EXCHANGE = os.environ.get(EXCHANGE_VARIABLE, "auto")
EXCHANGES = ("auto", "nccl", "copy")


def checked_exchange(exchange: str | None = None) -> str:
    """`exchange`, or where None the default (`EXCHANGE`), checked: a ValueError names a value that is not one of
    `EXCHANGES`, and the environment variable where it came from there (checked by `cat_fast.distributed` before a
    run's process group is made)."""
    source = ""
    if exchange is None:
        exchange = EXCHANGE
        if exchange == os.environ.get(EXCHANGE_VARIABLE):
            source = f" (from the environment variable {EXCHANGE_VARIABLE})"
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}{source}")
    return exchange


class _Bucket:
    __slots__ = ("flat", "members", "views", "index", "wire", "peers", "sparse", "rows")

    def __init__(self, flat, members, views, index, wire, sparse=False):
        self.flat, self.members, self.views, self.index = flat, members, views, index
        self.wire = wire  # the 16-bit copy that is all-reduced (compression), or None: `flat` itself
        self.peers = None  # exchange="copy": the symmetric-memory handle of the buffer exchanged
        self.sparse = sparse  # one row-sparse table (``sparse_rows``)
        self.rows = None  # exchange="copy" of a row-sparse table: its `_Rows`


class _Rows:
    """A row-sparse table's staging (module docstring): this rank's staged rows and flags, in one buffer
    (`symmetric_zeros`), and once shared (`share`) its handle and the other rank's two, read in place."""
    __slots__ = ("buffer", "stage", "flags", "handle", "peer_stage", "peer_flags")

    def __init__(self, buffer, shape):
        V, H = shape
        self.buffer = buffer
        self.stage, self.flags = buffer[:V * H].view(V, H), buffer[V * H:]
        self.handle = self.peer_stage = self.peer_flags = None

    def share(self, group, rank):
        """The rendezvous (a collective call) and the other rank's views (2 ranks)."""
        V, H = self.stage.shape
        self.handle = share_symmetric(self.buffer, group)
        peer = self.handle.get_buffer(1 - rank, (V * H + V,), self.buffer.dtype, 0)
        self.peer_stage, self.peer_flags = peer[:V * H].view(V, H), peer[V * H:]


class GradientAverager:
    """``begin(key)``, the backward, then ``averager()``: the gradients of `params` averaged over the ranks of
    `group` in place of DDP's reducer (module docstring). ``overlap=False`` reduces every bucket after the backward
    (None: `OVERLAP`). `agree` (``callable(bool) -> bool``, true where true on any rank; host-side) is needed for
    the overlap. ``compress`` (None, ``torch.bfloat16`` or ``torch.float16``): the dtype the buckets are all-reduced
    in (module docstring). ``exchange`` ("auto", "nccl" or "copy"; None: `EXCHANGE`): how a bucket is reduced
    (module docstring; ``self.exchange`` is the one used). ``sparse_rows``: parameters of `params` (2-D) whose
    gradients are mostly zero rows, each a bucket of its own, exchanged by their nonzero rows where it can (module
    docstring; ``sparse_exchanged`` counts them). ``overlapped``: the buckets of the last step reduced while its
    backward ran."""

    def __init__(self, params, group=None, *, overlap: bool | None = None, bucket_mb: float = BUCKET_MB, agree=None,
                 compress: torch.dtype | None = None, exchange: str | None = None, sparse_rows=()):
        if compress not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"compress: expected None, torch.bfloat16 or torch.float16, got {compress!r}")
        exchange = checked_exchange(exchange)
        self._auto = exchange == "auto"
        params = list(params)
        sparse_rows = list(sparse_rows)
        sparse = {id(p) for p in sparse_rows}
        outside = len(sparse - {id(p) for p in params})
        if outside or any(p.dim() != 2 for p in sparse_rows):
            got = f"{outside} not among them" if outside else f"shapes {[tuple(p.shape) for p in sparse_rows]}"
            raise ValueError(f"sparse_rows: expected 2-D parameters among params (embedding tables), got {got}")
        self.compress = compress
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.world > 1 and exchange == "auto":
            exchange = "copy" if _copy_possible(params, group) else "nccl"
        self.exchange = exchange if self.world > 1 else "nccl"
        refusal = _copy_refusal(params) if self.exchange == "copy" else None
        if refusal is not None:
            raise ValueError(refusal)
        self._unshared = None  # exchange="auto": why this rank could not make a buffer symmetric
        allocate = self._symmetric_zeros if self.exchange == "copy" else _zeros
        self.overlap = bool(OVERLAP if overlap is None else overlap) and agree is not None
        self.agree = agree
        kinds = {}
        for p in params:
            kinds.setdefault((p.dtype, p.device), []).append(p)
        self.buckets = []  # none on one process (nothing to average)
        self._bucket_of = {}  # id(param) -> its bucket
        for (dtype, device), members in kinds.items() if self.world > 1 else ():
            members = members[::-1]  # the backward's order
            n = sum(p.numel() for p in members)
            wired = compress is not None and dtype.is_floating_point and dtype != compress
            flat = (_zeros if wired else allocate)(n, dtype, device)  # the buffer exchanged is the shared one
            wire = allocate(n, compress, device) if wired else None
            cap = max(1, int(bucket_mb * 2**20) // flat.element_size())
            offset, start, group_members = 0, 0, []
            for i, p in enumerate(members):
                if id(p) in sparse and group_members:  # a row-sparse table is a bucket of its own
                    self._add_bucket(flat, start, offset, group_members, wire)
                    start, group_members = offset, []
                group_members.append(p)
                offset += p.numel()
                if offset - start >= cap or i == len(members) - 1 or id(p) in sparse:
                    self._add_bucket(flat, start, offset, group_members, wire, sparse=id(p) in sparse)
                    start, group_members = offset, []
        self._scratch = {}  # exchange="copy": (dtype, device) -> the spans pulled from the other ranks
        if self.exchange == "copy" and self.world == 2 and ROW_SPARSE and compress is None and _kernels_present():
            for bucket in self.buckets:
                if bucket.sparse and bucket.members[0].dtype.is_floating_point:
                    table = bucket.members[0]
                    bucket.rows = _Rows(allocate(table.shape[0] * (table.shape[1] + 1), table.dtype, table.device),
                                        table.shape)
        if self.exchange == "copy":
            self._share()
        self.overlapped = 0  # buckets of the last step reduced while its backward ran
        self.sparse_exchanged = sum(b.rows is not None for b in self.buckets)  # tables exchanged by their rows
        self.deferred = 0  # parameters of the last step whose average was joined after the others (`defer_last`)
        self._counts = {}  # key -> accumulations per parameter in a step of that key
        self._open = None  # the open step's state (`begin`)
        self._deferred = None  # the last bucket's own gradients, between `__call__(defer_last)` and `finish`
        self._streams = {}
        self._handles = []
        if self.overlap and self.buckets:
            ref = weakref.ref(self)

            def hook(p, ref=ref):
                averager = ref()
                if averager is not None and averager._open is not None:
                    averager._accumulated(p)

            self._handles = [p.register_post_accumulate_grad_hook(hook) for b in self.buckets for p in b.members
                             if p.requires_grad]
            weakref.finalize(self, _remove, self._handles)  # the parameters outlive the averager: no idle hooks

    def _add_bucket(self, flat, start, end, members, wire, sparse=False):
        views, offset = [], start
        for p in members:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        bucket = _Bucket(flat[start:end], list(members), views, len(self.buckets),
                         None if wire is None else wire[start:end], sparse)
        for p in members:
            self._bucket_of[id(p)] = bucket
        self.buckets.append(bucket)

    def _share(self):
        """exchange="copy": each exchanged buffer made symmetric over the group (a collective call, in the same
        order on every rank), and the scratch its pulls land in. With exchange="auto", where any rank fails to
        allocate or share them, every rank uses "nccl" instead, with a warning."""
        failed = self._unshared
        if self._auto and self._anyone(failed is not None):  # before the rendezvous, which every rank must enter
            return self._fall_back(failed)
        try:
            self._rendezvous_buckets()
        except Exception as exc:  # noqa: BLE001 (with "auto", agreed on below)
            if not self._auto:
                raise
            failed = exc
        if self._auto and self._anyone(failed is not None):
            self._fall_back(failed)

    def _anyone(self, flag) -> bool:
        device = self.buckets[0].flat.device if self.buckets else torch.device("cuda", torch.cuda.current_device())
        votes = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group)
        return bool(votes.item())

    def _fall_back(self, failed):
        self.exchange = "nccl"
        self._scratch = {}
        for bucket in self.buckets:
            bucket.peers = bucket.rows = None
        where = f"this rank: {failed}" if failed is not None else "on another rank"
        warnings.warn(f"GradientAverager(exchange='auto'): the gradient buffers could not be shared through "
                      f"PyTorch's symmetric memory ({where}); every rank averages with exchange='nccl'",
                      RuntimeWarning, stacklevel=3)

    def _symmetric_zeros(self, n, dtype, device):
        """A buffer in symmetric memory; with exchange="auto", where this rank cannot make one, an ordinary one
        (noted: every rank then falls back to "nccl", `_share`)."""
        if self._unshared is None:
            try:
                return symmetric_zeros(n, dtype, device)
            except Exception as exc:  # noqa: BLE001
                if not self._auto:
                    raise
                self._unshared = exc
        return _zeros(n, dtype, device)

    def _rendezvous_buckets(self):
        handles = {}
        for bucket in self.buckets:
            shared = bucket.flat if bucket.wire is None else bucket.wire
            root = _root(shared)
            if id(root) not in handles:
                handles[id(root)] = share_symmetric(root, self.group)
            bucket.peers = handles[id(root)]
            if bucket.rows is not None:  # no spans pulled: no scratch
                bucket.rows.share(self.group, self.rank)
                continue
            key = (shared.dtype, shared.device)
            span = -(-shared.numel() // self.world)
            if key not in self._scratch or self._scratch[key].shape[1] < span:
                self._scratch[key] = torch.empty(self.world, span, dtype=shared.dtype, device=shared.device)

    def _pull_reduce(self, bucket):
        """exchange="copy": `bucket`'s buffer (already scaled, or encoded) summed over the ranks in place, by the
        copy engines (module docstring); on the averager's stream."""
        shared = self._encoded(bucket)
        peers, world, rank = bucket.peers, self.world, self.rank
        base = shared.storage_offset() - _root(shared).storage_offset()  # where the bucket starts in its buffer
        spans = _spans(shared.numel(), world)
        scratch = self._scratch[shared.dtype, shared.device]
        start, end = spans[rank]
        own = shared[start:end]
        peers.barrier()  # every rank's bucket is filled
        if end > start:
            shares = []
            for r in range(world):
                if r == rank:
                    shares.append(own)
                else:
                    shares.append(scratch[r, :end - start])
                    shares[-1].copy_(peers.get_buffer(r, (end - start,), shared.dtype, base + start))
            scale = self._scaled_at_sum(bucket)  # unscaled shares: each one times 1/N here
            if world == 2 and scale:  # x/2 + y/2, both halves exact: DDP's sum of scaled shares, bit for bit
                own.mul_(0.5).add_(shares[1 - rank], alpha=0.5)
            elif world == 2:  # one sum: the same on both ranks in either order
                own.add_(shares[1 - rank])
            else:  # in rank order, as every rank sums its span
                if scale:
                    torch._foreach_mul_(shares, 1.0 / world)
                total = scratch[rank, :end - start]
                torch.add(shares[0], shares[1], out=total)
                for share in shares[2:]:
                    total.add_(share)
                own.copy_(total)
        peers.barrier()  # every rank's span is summed
        for step in range(1, world):
            r = (rank + step) % world
            start, end = spans[r]
            if end > start:
                shared[start:end].copy_(peers.get_buffer(r, (end - start,), shared.dtype, base + start))
        return shared

    # ------------------------------------------------------------------ one step
    def begin(self, key=None):
        """Opens a step of `key` (what decides its backward's path: the objective's plan key)."""
        if not self.buckets:
            return
        self.finish()  # a step left deferred is joined before the next one fills its buffers
        expected = self._counts.get(key) if self.overlap else None
        self._open = {"key": key, "seen": {}, "expected": expected, "left": None, "next": 0, "launched": set(),
                      "stale": False, "works": [], "decode": [], "stream": None, "early": None}
        if expected is not None:
            self._open["left"] = [sum(expected.get(id(p), 0) for p in b.members) for b in self.buckets]

    def abandon(self):
        """Closes a step whose backward did not complete (an exception): nothing more is counted or reduced."""
        if self._deferred is not None:
            return self.finish()
        if self._open is not None:
            try:
                self._join()
            finally:
                self._open = None

    def _accumulated(self, p):
        step = self._open
        seen = step["seen"]
        seen[id(p)] = seen.get(id(p), 0) + 1
        bucket = self._bucket_of.get(id(p))
        if step["expected"] is None or bucket is None:
            return
        if bucket.index in step["launched"] or seen[id(p)] > step["expected"].get(id(p), 0):
            step["stale"] = True  # an accumulation its key's first step did not make
            return
        step["left"][bucket.index] -= 1
        while step["next"] < len(self.buckets) and step["left"][step["next"]] == 0:
            self._launch(self.buckets[step["next"]])
            step["next"] += 1

    def _launch(self, bucket):
        """Copies `bucket`'s gradients into its buffer (zeros for a parameter without one), scales and all-reduces
        it (through its 16-bit copy where compressing; a row-sparse table by its rows, `_row_reduce`): on a GPU on
        the averager's stream, after the work queued so far on the current stream."""
        step = self._open
        step["launched"].add(bucket.index)
        cuda = bucket.flat.is_cuda
        if cuda:
            device = bucket.flat.device
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            step["stream"] = stream
            with torch.cuda.stream(stream):
                reader = None if _capturing(bucket.flat) else stream
                if bucket.rows is not None:
                    self._row_reduce(bucket, reader)
                elif bucket.peers is not None:
                    self._fill(bucket, reader)
                    self._pull_reduce(bucket)
                else:
                    self._fill(bucket, reader)
                    dist.all_reduce(self._encoded(bucket), group=self.group)
                if bucket.wire is not None:  # after the all-reduce on this stream
                    bucket.flat.copy_(bucket.wire)
                if bucket.index == len(self.buckets) - 2:  # every bucket but the last reduced (`defer_last`)
                    step["early"] = torch.cuda.Event()
                    step["early"].record(stream)
        else:
            self._fill(bucket, None)
            step["works"].append(dist.all_reduce(self._encoded(bucket), group=self.group, async_op=True))
            if bucket.wire is not None:
                step["decode"].append(bucket)  # cast back once the collective is waited for (`_join`)

    def _row_reduce(self, bucket, stream):
        """exchange="copy", a row-sparse table between 2 ranks (module docstring): its average written into its
        buffer, reading the other rank's rows where they are not zero; on the averager's stream."""
        from .ops.fused import fused_kernels

        row_exchange = fused_kernels("row_exchange")
        (table,), (view,), rows = bucket.members, bucket.views, bucket.rows
        grad = table.grad
        if grad is None:  # unused on this rank: zeros from it
            grad = view.zero_()
        elif grad is not view:
            if stream is not None:  # read on another stream than the one that made it
                grad.record_stream(stream)
            if grad.stride(1) != 1:
                grad = grad.contiguous()
        row_exchange.mark(grad, rows.stage, rows.flags)
        rows.handle.barrier()  # every rank's rows are staged
        row_exchange.combine(grad, rows.peer_stage, rows.peer_flags, view, 1.0 / self.world)

    def _fill(self, bucket, stream):
        grads = [(v, p.grad) for p, v in zip(bucket.members, bucket.views) if p.grad is not None and p.grad is not v]
        if grads:
            if stream is not None:  # read on another stream than the one that made them
                for _, g in grads:
                    g.record_stream(stream)
            torch._foreach_copy_([v for v, _ in grads], [g for _, g in grads])
        unused = [v for p, v in zip(bucket.members, bucket.views) if p.grad is None]
        if unused:  # zeros from this rank, so that every rank reduces the same buffer
            torch._foreach_zero_(unused)
        if self.compress is not None and bucket.wire is None:  # already 16-bit: the hook's division, in place
            bucket.flat.div_(self.world)
        elif bucket.wire is None and not self._scaled_at_sum(bucket):
            bucket.flat.mul_(1.0 / self.world)  # as DDP: each rank's share scaled before the sum

    def _scaled_at_sum(self, bucket) -> bool:
        """exchange="copy", uncompressed: the shares are scaled where they are summed (`_pull_reduce`, 1/N of the
        bucket), not by `_fill` (the whole bucket)."""
        return bucket.peers is not None and bucket.wire is None and self.compress is None

    def _encoded(self, bucket):
        """The tensor to all-reduce: `bucket`'s buffer, or its 16-bit copy divided by the world size (as the
        compression hooks make it)."""
        if bucket.wire is None:
            return bucket.flat
        bucket.wire.copy_(bucket.flat)
        return bucket.wire.div_(self.world)

    def __call__(self, *, defer_last: bool = False):
        """Closes the step (the backward is done): reduces the buckets left, joins, sets each ``.grad``. Returns the
        parameters whose average is not yet joined: none, or with ``defer_last`` (more than one bucket) the last
        bucket's. Then the current stream waits only for the buckets before it (on the CPU, their collectives), the
        last bucket's parameters have ``.grad`` None, and `finish()` joins the rest: work queued in between (an
        update of the other parameters) overlaps the last bucket's exchange, the step's exposed tail. That work must
        not write the averaged gradients. ``deferred``: how many parameters the last step so left."""
        if not self.buckets:
            return []
        self.finish()  # a step left deferred is joined first
        if self._open is None:
            self.begin(None)
        step = self._open
        try:
            stale = step["stale"]
            if self.overlap and _capturing(self.buckets[0].flat):
                if stale:  # fails the capture on this rank: the ranks then run this step eagerly, and agree there
                    raise RuntimeError("a parameter accumulated a gradient after its bucket was averaged (this step's "
                                       "backward differs from the first of its kind)")
            elif self.overlap:
                stale = self.agree(stale)  # every rank redoes where one must (the same collectives on every rank)
            self.overlapped = 0 if stale else len(step["launched"])
            if stale:
                self._join(settle=True)  # the first reduces are done before their buffers are filled again
            for bucket in self.buckets:
                if bucket.index not in step["launched"] or stale:
                    self._launch(bucket)
            if self.overlap and step["seen"] != step["expected"]:
                self._counts[step["key"]] = dict(step["seen"])
            self.deferred = 0
            last = self.buckets[-1]
            gpu = last.flat.is_cuda and step["early"] is not None
            if defer_last and len(self.buckets) > 1 and (gpu or step["stream"] is None):
                if gpu:  # the stream as it was after the bucket before the last
                    torch.cuda.current_stream(step["stream"].device).wait_event(step["early"])
                else:  # CPU: the last bucket's collective is the last one issued
                    for work in step["works"][:-1]:
                        work.wait()
                    step["works"] = step["works"][-1:]
                    for bucket in step["decode"]:
                        if bucket is not last:
                            bucket.flat.copy_(bucket.wire)
                    step["decode"] = [bucket for bucket in step["decode"] if bucket is last]
                self.deferred = len(last.members)
                # the backward's own gradients stay referenced until `finish`: the averager's stream still reads them
                self._deferred = [p.grad for p in last.members]
                for bucket in self.buckets[:-1]:
                    for p, v in zip(bucket.members, bucket.views):
                        p.grad = v
                for p in last.members:
                    p.grad = None
                return list(last.members)
            self._join(settle=True)
        finally:
            if self._deferred is None:
                self._open = None
        self._set_grads()
        return []

    def finish(self):
        """Joins the last bucket that ``averager(defer_last=True)`` left in flight and sets its ``.grad``; nothing
        when none was."""
        if self._deferred is None:
            return
        try:
            self._join(settle=True)
        finally:
            self._deferred = None
            self._open = None
        self._set_grads()

    def _set_grads(self):
        for bucket in self.buckets:
            for p, v in zip(bucket.members, bucket.views):
                p.grad = v

    def _join(self, settle=False):
        """The current stream waits for the averager's (GPU); the asynchronous collectives are waited for (CPU).
        ``settle`` (every rank together), with exchange="copy": first a barrier, so that no rank writes a buffer
        (the next step's backward, a redone average) that another is still pulling."""
        step = self._open
        if settle and self.exchange == "copy" and step["stream"] is not None:
            with torch.cuda.stream(step["stream"]):
                self.buckets[-1].peers.barrier()
        for work in step["works"]:
            work.wait()
        step["works"] = []
        for bucket in step["decode"]:
            bucket.flat.copy_(bucket.wire)
        step["decode"] = []
        if step["stream"] is not None:
            torch.cuda.current_stream(step["stream"].device).wait_stream(step["stream"])

    def any(self, flag):
        """`flag` (a 0-d tensor, nonzero = true) made true on every rank where it is on one (an all-reduce of its
        max)."""
        flag = flag.to(torch.float32).reshape(1)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag[0]


def embedding_tables(module, min_rows: int | None = None) -> list:
    """The weights of `module`'s plain ``nn.Embedding`` tables (dense gradients: not ``sparse``) of at least
    `min_rows` rows (None: `SPARSE_MIN_ROWS`, vocabularies rather than position or type tables) that no other
    module uses (a table tied to an output layer has dense gradients): what `GradientAverager`'s ``sparse_rows``
    takes."""
    min_rows = SPARSE_MIN_ROWS if min_rows is None else min_rows
    tables, elsewhere = [], set()
    for m in module.modules():
        if type(m) is torch.nn.Embedding and not m.sparse:
            if m.num_embeddings >= min_rows:
                tables.append(m.weight)
        else:
            elsewhere.update(id(p) for p in m.parameters(recurse=False))
    uses = collections.Counter(id(p) for p in tables)  # two tables sharing one weight: not a table of its own
    return [p for p in tables if id(p) not in elsewhere and uses[id(p)] == 1]


def _kernels_present() -> bool:
    """Whether the row-sparse exchange's kernels (`kernels.triton.row_exchange`) can be imported (Triton)."""
    from .ops.fused import fused_kernels

    return fused_kernels("row_exchange") is not None


def _root(view):
    """The buffer a bucket is a view of (the tensor made symmetric by `GradientAverager._share`)."""
    return view._base if view._base is not None else view


def _spans(n, world):
    """[start, end) of each rank's span of a bucket of `n` elements (the last ones shorter, or empty)."""
    size = -(-n // world)
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(world)]


def _zeros(n, dtype, device):
    return torch.zeros(n, dtype=dtype, device=device)


def symmetric_zeros(n, dtype, device):
    """`n` zeros in PyTorch's symmetric memory (a buffer other GPUs of the host can read; `share_symmetric`)."""
    from torch.distributed import _symmetric_memory as symmetric

    return symmetric.empty(n, dtype=dtype, device=device).zero_()


def share_symmetric(tensor, group=None):
    """The handle through which the ranks of `group` (None: the world) read each other's copy of `tensor`, a
    `symmetric_zeros` buffer (``get_buffer(rank, shape, dtype, offset)``, ``barrier()``); a collective call. Where
    this PyTorch wants the group enabled first (older releases), it is enabled and tried again (the failure is
    local, before any exchange: every rank takes the same path)."""
    from torch.distributed import _symmetric_memory as symmetric

    group = group if group is not None else dist.group.WORLD
    try:
        return symmetric.rendezvous(tensor, group.group_name)
    except RuntimeError as first:
        enable = getattr(symmetric, "enable_symm_mem_for_group", None)
        try:
            if enable is None:
                raise
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # deprecated where no longer needed
                enable(group.group_name)
            return symmetric.rendezvous(tensor, group.group_name)
        except RuntimeError as exc:
            raise RuntimeError(f"exchange='copy': the gradient buffers could not be shared between the ranks' GPUs "
                               f"through PyTorch's symmetric memory ({exc}); exchange='nccl' averages without it"
                               ) from first


def _copy_refusal(params) -> str | None:
    """Why this rank's `params` cannot use the copy exchange (None: they can)."""
    devices = {p.device for p in params}
    if any(d.type != "cuda" for d in devices):
        return (f"exchange='copy': expected parameters on CUDA devices (the copy engines of GPUs of one host), got "
                f"{sorted(str(d) for d in devices)}; exchange='nccl' averages anywhere")
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as exc:
        return (f"exchange='copy' needs PyTorch's symmetric memory (torch.distributed._symmetric_memory), which "
                f"this PyTorch lacks ({exc}); exchange='nccl' averages without it")
    return None


def _copy_possible(params, group) -> bool:
    """exchange="auto": whether every rank of `group` can use the copy exchange (module docstring). A collective
    call where the group's backend is NCCL (the same on every rank); none elsewhere."""
    if dist.get_backend(group) != "nccl" or not torch.cuda.is_available():
        return False
    devices = {p.device for p in params}
    ok = _copy_refusal(params) is None and len(devices) <= 1
    local = next(iter(devices)).index if ok and devices else torch.cuda.current_device()
    ok = ok and all(torch.cuda.can_device_access_peer(local, other)
                    for other in range(torch.cuda.device_count()) if other != local)
    host = zlib.crc32(socket.gethostname().encode())
    # one all-reduce (min): every rank able to, and the smallest and largest host equal (one host)
    votes = torch.tensor([int(ok), host, -host], dtype=torch.int64, device=torch.device("cuda", local))
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    return bool(votes[0].item()) and int(votes[1]) == -int(votes[2])


def _capturing(tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _remove(handles):
    for handle in handles:
        handle.remove()
    handles.clear()
