"""`cat_fast.graphs.GraphCache`, the CUDA-graph engine of `CapturedStep` and CAT's CAL loop: its keying, static
copies, warm-up, bound and failures on the CPU (a backend test double whose "graph" reruns the captured callable),
then real graphs on a GPU (replays equal to eager runs bit for bit, one memory pool, `CapturedStep` through it)."""
import contextlib
import gc
import warnings

import pytest
import torch

from cat_fast.graphs import GraphCache, copy_into, signature
from cat_fast.objectives import CAT, ERM
from cat_fast.step import CapturedStep
from tests.conftest import tiny_batch, tiny_model

GPU = torch.cuda.is_available()
LIMIT = "test: more than max_graphs={max_graphs} signatures"


class EagerGraph:
    """A CUDA graph's test double: a replay reruns the captured callable and writes its result into the output of
    the capture, as a replay rewrites the captured output's memory."""

    def __init__(self, body, output):
        self.body, self.output = body, output

    def replay(self):
        copy_into(self.output, self.body())


class EagerBackend:
    """`GraphCache`'s backend on the CPU; records the pools, captures, side-stream blocks and synchronisations."""

    def __init__(self):
        self.pools, self.captures, self.side_streams, self.synchronized = [], [], 0, 0

    def pool(self):
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, body, pool, generators):
        self.captures.append((pool, tuple(generators)))
        out = body()
        return EagerGraph(body, out), out

    def side_stream(self, device):
        self.side_streams += 1
        return contextlib.nullcontext()

    def synchronize(self, device):
        self.synchronized += 1


def _cache(max_graphs=8, backend=None):
    return GraphCache(max_graphs, limit_warning=LIMIT, backend=backend or EagerBackend())


def _affine(s):
    """The captured code of most tests: ``y = x * scale + shift`` from the static inputs, with a plain value."""
    return {"y": lambda: {"y": s["x"] * s["p"][0] + s["p"][1], "tag": s["tag"]}}


def _inputs(x, scale=2.0, shift=1.0, tag="a"):
    return {"x": x, "p": (torch.tensor(scale), torch.tensor(shift)), "tag": tag}


def test_signature_is_shapes_dtypes_devices_and_the_key_not_values():
    a = _inputs(torch.zeros(2, 3))
    assert signature(a) == signature(_inputs(torch.ones(2, 3), scale=5.0))  # values do not count
    for other in (_inputs(torch.zeros(2, 4)), _inputs(torch.zeros(2, 3, dtype=torch.float64)),
                  _inputs(torch.zeros(2, 3), tag="b"), {**a, "extra": None}):
        assert signature(other) != signature(a)
    cache = _cache()
    assert cache.signature(a, ("cat", 1)) != cache.signature(a, ("cat", 2))
    assert cache.signature(a, ("cat", 1)) == cache.signature(_inputs(torch.ones(2, 3)), ("cat", 1))


def test_replays_read_new_inputs_through_the_static_copies():
    cache = _cache()
    first = _inputs(torch.arange(6.0).view(2, 3))
    sig = cache.signature(first)
    assert cache.get(sig) is None and cache.admit(sig)
    entry = cache.capture(sig, first, _affine, device="cpu", failed=str)
    assert cache.get(sig) is entry and cache.num_graphs == 1
    torch.testing.assert_close(entry.outputs["y"]["y"], first["x"] * 2 + 1, rtol=0, atol=0)  # the capture's run
    assert entry.inputs["x"] is not first["x"] and entry.inputs["tag"] == "a"  # copies, plain values kept
    first["x"].add_(100)  # the caller's tensors are not the graph's
    for scale in (3.0, -1.0):
        new = _inputs(torch.randn(2, 3), scale=scale, shift=0.5)
        entry.load(new)
        entry.replay("y")
        torch.testing.assert_close(entry.outputs["y"]["y"], new["x"] * scale + 0.5, rtol=0, atol=0)
    assert entry.replays["y"] == 2


def test_one_set_of_static_copies_per_input_signature_and_one_memory_pool():
    backend = EagerBackend()
    cache = _cache(backend=backend)
    x = _inputs(torch.zeros(2, 3))
    entries = [cache.capture(cache.signature(x, key), x, _affine, device="cpu", failed=str) for key in (1, 2)]
    y = _inputs(torch.zeros(4, 3))
    entries.append(cache.capture(cache.signature(y, 1), y, _affine, device="cpu", failed=str))
    assert entries[0].inputs is entries[1].inputs  # two keys, one input signature: shared copies
    assert entries[2].inputs is not entries[0].inputs
    assert len(backend.pools) == 1 and [pool for pool, _ in backend.captures] == backend.pools * 3
    cache.clear()  # dropped: graphs, static copies, the pool
    assert cache.num_graphs == 0 and cache.pool is None and cache.get(cache.signature(x, 1)) is None
    again = cache.capture(cache.signature(x, 1), x, _affine, device="cpu", failed=str)
    assert again.inputs is not entries[0].inputs and len(backend.pools) == 2


def test_warm_up_runs_each_callable_on_a_side_stream_before_its_capture():
    backend = EagerBackend()
    cache = _cache(backend=backend)
    calls = []

    def build(s):
        return {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}

    gen = torch.Generator()
    cache.capture(cache.signature({}), {}, build, device="cpu", warmup=2, generators=(gen,), failed=str)
    assert calls == ["a", "b", "a", "b", "a", "b"] and backend.side_streams == 1
    assert backend.captures[0][1] == (gen,) and gc.isenabled()


def test_admit_after_the_warm_up_calls_and_up_to_max_graphs():
    cache = _cache(max_graphs=2)
    sigs = [cache.signature(_inputs(torch.zeros(n))) for n in (1, 2, 3)]
    assert [cache.admit(sigs[0], warmup=2) for _ in range(3)] == [False, False, True]
    cache.capture(sigs[0], _inputs(torch.zeros(1)), _affine, device="cpu", failed=str)
    assert not cache.admit(sigs[0])  # captured already
    assert cache.admit(sigs[1])
    cache.capture(sigs[1], _inputs(torch.zeros(2)), _affine, device="cpu", failed=str)
    with pytest.warns(RuntimeWarning, match="more than max_graphs=2 signatures"):
        assert not cache.admit(sigs[2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cache.admit(sigs[2])  # one warning only; nothing evicted
    assert cache.num_graphs == 2
    cache.max_graphs = 3
    assert cache.admit(sigs[2])
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="max_graphs: expected an integer >= 0"):
            _cache(max_graphs=bad)


def test_a_failed_capture_warns_once_and_its_signature_runs_eagerly():
    backend = EagerBackend()
    cache = _cache(max_graphs=2, backend=backend)

    def build(s):
        def body():
            raise ValueError("boom\nsecond line")
        return {"y": body}

    sigs = [cache.signature(_inputs(torch.zeros(n))) for n in (1, 2, 3)]
    with pytest.warns(RuntimeWarning, match=r"^capture failed \(ValueError: boom\)$"):
        assert cache.capture(sigs[0], _inputs(torch.zeros(1)), build, device="cpu",
                             failed=lambda reason: f"capture failed ({reason})") is None
    assert backend.synchronized == 1 and gc.isenabled()
    assert cache.get(sigs[0]) is None and not cache.admit(sigs[0]) and cache.num_graphs == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same error type again: no second warning
        assert cache.capture(sigs[1], _inputs(torch.zeros(2)), build, device="cpu", failed=str) is None
    with pytest.warns(RuntimeWarning, match="max_graphs=2"):
        assert not cache.admit(sigs[2])  # failed captures count toward the bound


# ----------------------------------------------------------------------------- GPU

def _mlp(s):
    return {"y": lambda: torch.tanh(s["x"] @ s["w"]).sum(1)}


@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_gpu_replays_equal_eager_runs_bit_for_bit():
    cache = GraphCache(limit_warning=LIMIT)
    torch.manual_seed(0)
    w = torch.randn(64, 64, device="cuda")
    xs = [{"x": torch.randn(32, 64, device="cuda"), "w": w} for _ in range(4)]
    sig = cache.signature(xs[0])
    entry = cache.capture(sig, xs[0], _mlp, device=torch.device("cuda"), warmup=1, failed=str)
    assert entry is not None and cache.num_graphs == 1
    for x in xs:
        entry.load(x)
        entry.replay("y")
        torch.testing.assert_close(entry.outputs["y"], torch.tanh(x["x"] @ w).sum(1), rtol=0, atol=0)
    assert entry.replays["y"] == len(xs)


@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_gpu_graphs_share_one_memory_pool():
    """Each capture frees a 64 MiB temporary: in one pool the later captures reuse its blocks, so four graphs
    reserve about what one does (four pools would reserve four temporaries)."""
    cache = GraphCache(limit_warning=LIMIT)
    temp = 64 << 20

    def build(s):
        return {"y": lambda: (s["x"].expand(4096, 4096) * 2).sum()}  # a [4096, 4096] float32 temporary

    x = {"x": torch.ones(4096, device="cuda")}
    device = torch.device("cuda")
    assert cache.capture(cache.signature(x, 0), x, build, device=device, failed=str) is not None
    pool = cache.pool
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for key in (1, 2, 3):
        assert cache.capture(cache.signature(x, key), x, build, device=device, failed=str) is not None
        assert cache.pool is pool
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - reserved < temp, "each capture took memory of its own"
    for entry in cache.entries.values():
        entry.replay("y")
        assert entry.outputs["y"].item() == 2 * 4096 * 4096


def _batches(n, length=9):
    return [{k: v.cuda() for k, v in tiny_batch("bert", batch=4, length=length, seed=i).items()} for i in range(n)]


def _run(make, batches, captured, warmup_steps=1):
    """Losses and parameters after one step per batch: the objective's own eager loop (captured None) or
    `CapturedStep` (the same loss, backward, clipping and capturable AdamW)."""
    torch.manual_seed(0)
    model = tiny_model("bert", seed=1, attn="sdpa").cuda().train()
    objective = make(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), capturable=True)
    step = None if captured is None else CapturedStep(objective, opt, max_grad_norm=1.0, warmup_steps=warmup_steps)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture fails the test
        for batch in batches:
            if step is None:
                loss, _ = objective(batch)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                loss, _ = step(batch)
            losses.append(loss.detach())
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}, step


@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("name", ["erm", "cat"])
def test_gpu_captured_step_replays_equal_the_eager_loop_bit_for_bit(name):
    """Six steps with dropout through `CapturedStep` (ERM: one signature; CAT: warm-up ERM and two mixing layers):
    the eager loop's losses and parameters bit for bit, every step after a signature's warm-up a replay."""
    make = {"erm": lambda m: ERM(m),  # CAT's own loop without its CAL graphs: the eager step throughout
            "cat": lambda m: CAT(m, layers=[1, 2], warmup_steps=1, generator=torch.Generator().manual_seed(3),
                                 cuda_graph=False)}[name]
    batches = _batches(6)
    want_losses, want, _ = _run(make, batches, None)
    got_losses, got, step = _run(make, batches, True)
    torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=0)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)
    entries = [e for e in step.cache.entries.values() if e is not None]
    assert len(entries) == step.num_graphs == len(step.cache.entries) >= 1  # no capture failed
    signatures = len(step.cache._seen)  # each signature's first step ran eagerly (warmup_steps=1)
    assert sum(e.replays["step"] for e in entries) == len(batches) - signatures
    if name == "cat":  # the plans' tensors (partners, λ) share one set of static copies across mixing layers
        assert len({id(e.inputs) for e in entries}) == 1
