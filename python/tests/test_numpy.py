"""uniop with NumPy (no torch needed): values, views, bad input, the generated signatures and the
runtime objects."""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import uniop

ROOT = Path(__file__).resolve().parents[2]


def rms_ref(x, w, eps=1e-6):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_numpy_in_numpy_out():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 32), dtype=np.float32), rng.standard_normal(32, dtype=np.float32)
    y, rstd = uniop.rms_norm(x, w, eps=1e-5)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and rstd.shape == (5, 1)
    np.testing.assert_allclose(y, rms_ref(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    h = x.astype(np.float16)
    yh, _ = uniop.rms_norm(h, w)
    assert yh.dtype == np.float16
    np.testing.assert_allclose(yh.astype(np.float64), rms_ref(h, w), rtol=2e-3, atol=2e-3)


def test_strided_and_broadcast_views_are_read_in_place():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((8, 12), dtype=np.float32)
    a = base[::2, 1::2]  # both strides non-unit
    b = np.broadcast_to(rng.standard_normal(6, dtype=np.float32), (4, 6))  # stride 0
    np.testing.assert_allclose(uniop.add(a, b), a + b, rtol=1e-6)
    np.testing.assert_allclose(uniop.matmul(base.T, base), base.T @ base, rtol=1e-4, atol=1e-4)
    e = rng.standard_normal((0, 16), dtype=np.float32)
    assert uniop.softmax(e).shape == (0, 16)


class Producer:
    """Some other library's array: only the DLPack protocol."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_any_dlpack_producer():
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    y = uniop.silu(Producer(x))
    np.testing.assert_allclose(y, x / (1 + np.exp(-x)), rtol=1e-5, atol=1e-6)


def test_output_laid_out_unlike_the_plan_is_refused_not_miswritten(monkeypatch):
    """A cached plan rebinds outputs by address only when they are laid out as planned: an output
    the Python allocator makes another way (here column-major) is refused, not written row-major."""
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(uniop.silu(Producer(x)), x / (1 + np.exp(-x)), rtol=1e-5, atol=1e-6)
    empty = np.empty
    monkeypatch.setattr(np, "empty", lambda shape, dtype: np.asfortranarray(empty(shape, dtype)))
    with pytest.raises(uniop.UniopError, match="rebinding output 0: expected a tensor like the planned one"):
        uniop.silu(Producer(x))


NUMPY_DTYPES = [np.float32, np.float16, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_c_api_route_agrees_with_dlpack_for_every_dtype(dtype):
    # ndarrays are read and made through NumPy's C API; `Producer` forces the DLPack route.
    base = (np.arange(48).reshape(6, 8) % 7).astype(dtype)
    for x in (base, base[::2, 1::3], base.T, base[:0]):
        direct, via_dlpack = uniop.cast(x, "float64"), uniop.cast(Producer(x), "float64")
        np.testing.assert_array_equal(direct, x.astype(np.float64))
        np.testing.assert_array_equal(via_dlpack, direct)
    made = uniop.cast(np.array([0.0, 1.0, 3.0]), np.dtype(dtype).name)
    assert type(made) is np.ndarray and made.dtype == dtype and made.flags.c_contiguous and made.flags.writeable
    np.testing.assert_array_equal(made, np.array([0, 1, 3]).astype(dtype))


def test_numpy_arrays_the_c_api_route_leaves_to_dlpack():
    class Sub(np.ndarray):
        pass

    x = np.linspace(-2, 2, 8, dtype=np.float32)
    assert type(uniop.silu(x.view(Sub))) is np.ndarray, "subclasses are arrays; outputs are plain arrays"
    read_only = np.broadcast_to(x, (2, 8))
    np.testing.assert_allclose(uniop.silu(read_only)[1], x / (1 + np.exp(-x)), rtol=1e-6)
    swapped = x.astype(">f4")
    with pytest.raises(uniop.UniopError, match="silu: argument 'x'.*native byte order"):
        uniop.silu(swapped)
    unaligned = np.frombuffer(b"\0" * 17, dtype=np.float32, count=4, offset=1)
    with pytest.raises(uniop.UniopError, match="silu: argument 'x': expected data aligned"):
        uniop.silu(unaligned)


def test_in_place_op_updates_numpy_arrays():
    kc, vc = np.zeros((1, 2, 6, 4), np.float32), np.zeros((1, 2, 6, 4), np.float32)
    k, v = np.ones((1, 2, 2, 4), np.float32), np.full((1, 2, 2, 4), 2, np.float32)
    assert uniop.kv_cache_append(kc, vc, k, v, np.array([3])) is None
    assert kc[0, :, 3:5].min() == 1 and kc.sum() == 16 and vc[0, :, 3:5].max() == 2
    kc.flags.writeable = False
    with pytest.raises(uniop.UniopError, match="argument 'k_cache': expected a writable tensor"):
        uniop.kv_cache_append(kc, vc, k, v, np.array([0]))


def test_list_arguments_take_numpy_arrays_and_views():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    parts = [a, a[:1], a.T[:2].T]  # contiguous, a row, a strided column pair
    np.testing.assert_array_equal(uniop.cat(parts[:2], 0), np.concatenate(parts[:2], 0))
    np.testing.assert_array_equal(uniop.cat([a, parts[2]], dim=-1), np.concatenate([a, parts[2]], -1))
    assert isinstance(uniop.cat((a, a)), np.ndarray), "a tuple is a list argument too"


def test_a_list_return_is_a_list_of_numpy_arrays():
    """cat_backward returns one array per joined tensor (its `Tensor[]` return), a strided gradient
    read in place; `help` says so."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    parts = [a[:, :1], a[:, 1:]]
    grads = uniop.cat_backward(a.T.copy().T, parts, -1)  # a column-major gradient
    assert isinstance(grads, list) and len(grads) == 2
    for g, p in zip(grads, parts):
        assert isinstance(g, np.ndarray) and g.flags.c_contiguous
        np.testing.assert_array_equal(g, p)
    assert "Returns: dtensors, a list of tensors." in uniop.cat_backward.__doc__


def test_signatures_and_docstrings_come_from_the_schema():
    sig = inspect.signature(uniop.rms_norm)
    assert list(sig.parameters) == ["x", "weight", "eps", "stream"]
    assert sig.parameters["eps"].default == pytest.approx(1e-6)
    assert sig.parameters["stream"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(uniop.add).parameters["alpha"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "rms_norm(Tensor x, Tensor weight" in uniop.rms_norm.__doc__
    assert "Backward: uniop.rms_norm_backward" in uniop.rms_norm.__doc__
    assert uniop.op("attention").returns == ["out", "lse"]


def test_functions_bind_positional_and_keyword_arguments_like_the_op_object():
    # `uniop.<op>` takes CPython's vectorcall convention (arguments in an array, keyword names in a
    # tuple), `uniop.op(name)(...)` a tuple and a dict: both bind through the same schema rules.
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((3, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
    rms = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-3) * w
    calls = [
        lambda: uniop.rms_norm(x, w, 1e-3),
        lambda: uniop.rms_norm(x, w, eps=1e-3),
        lambda: uniop.rms_norm(weight=w, eps=1e-3, x=x),
        lambda: uniop.rms_norm(x, weight=w, eps=1e-3, stream=None),
        lambda: uniop.op("rms_norm")(x, weight=w, eps=1e-3),
    ]
    for call in calls:
        y, _ = call()
        np.testing.assert_allclose(y, rms, rtol=1e-5, atol=1e-6)
    assert uniop.rms_norm.__self__ is uniop.op("rms_norm")
    for call, message in [
        (lambda: uniop.rms_norm(x, w, eps=1e-3, x=x), "got multiple values for argument 'x'"),
        (lambda: uniop.rms_norm(), "argument 'x': expected a Tensor, got nothing"),
        (lambda: uniop.rms_norm(x, w, 1e-3, 4), "takes 3 positional arguments but 4 were given"),
        (lambda: uniop.op("rms_norm")(x, w, eps=1e-3, x=x), "got multiple values for argument 'x'"),
    ]:
        with pytest.raises(uniop.UniopError, match=message):
            call()


@pytest.mark.parametrize(
    "call, code_name, message",
    [
        (lambda: uniop.rms_norm(np.ones((2, 4), np.float32), np.ones(3, np.float32)), "shape", "argument 'weight'"),
        (lambda: uniop.softmax(np.ones((2, 4), np.int32)), "dtype", "softmax: argument 'x'"),
        (lambda: uniop.silu("not a tensor"), "param-invalid", "expected a tensor"),
        (lambda: uniop.silu(np.ones(4, np.float32)[::-1]), "shape", "non-negative strides"),
        (lambda: uniop.softmax(np.ones(3, np.complex64)), "dtype", "DLPack type code 5"),
        (lambda: uniop.softmax(np.ones(3, np.float32), dim="x"), "param-invalid", "'dim': expected an int, got str"),
        (lambda: uniop.softmax(np.ones(3, np.float32), bogus=1), "param-invalid", "unexpected keyword argument 'bogus'"),
        (lambda: uniop.rms_norm(np.ones(3, np.float32)), "param-nullptr", "'weight': expected a Tensor, got nothing"),
        (lambda: uniop.silu(np.ones(3, np.float32), np.ones(3)), "param-invalid", "takes 1 positional"),
        (lambda: uniop.cast(np.ones(3, np.float32), "bfloat16"), "dtype", "NumPy has no bfloat16"),
        (lambda: uniop.cast(np.ones(3, np.float32), "float128"), "dtype", "argument 'dtype'"),
        (lambda: uniop.silu(np.ones(3, np.float32), stream=5), "param-invalid", "argument 'stream'"),
        (lambda: uniop.op("nope"), "param-invalid", "unknown op 'nope'"),
        (lambda: uniop.cat(5), "param-invalid", "argument 'tensors': expected a list of tensors, got int"),
        (lambda: uniop.cat([]), "param-invalid", "needs at least one tensor"),
        (lambda: uniop.cat([np.ones((2, 3), np.float32), np.ones((2, 2), np.float32)]), "shape", "'tensors\\[1\\]'"),
        (lambda: uniop.load_library("/nonexistent/libx.so"), "param-invalid", "cannot be loaded"),
        # Tables of 2**62 float32 (2**64 bytes: a size that wraps) for one position.
        (
            lambda: uniop.rope_cos_sin(np.zeros(1, np.int64), 2**62),
            "shape",
            r"rope_cos_sin: argument 'dim': expected a rotary dim for which the tables \[1, dim\] have a size",
        ),
        # No positions: empty tables, but a frequency table (2**57 float32) that no memory holds.
        (
            lambda: uniop.rope_cos_sin(np.zeros(0, np.int64), 2**58),
            "runtime",
            r"rope_cos_sin: argument 'dim': expected a rotary dim whose 576460752303423488-byte frequency table",
        ),
        # A stride-0 view of one element whose output (2**62 bytes) NumPy cannot allocate.
        (
            lambda: uniop.silu(np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (2**60,), (0,))),
            "runtime",
            r"silu: NumPy could not create an output \(\[1152921504606846976\] float32, 4611686018427387904 bytes\): "
            r"Unable to allocate 4.00 EiB for an array",
        ),
    ],
)
def test_bad_input_raises_uniop_error(call, code_name, message):
    with pytest.raises(uniop.UniopError, match=message) as e:
        call()
    assert e.value.code_name == code_name
    assert isinstance(e.value.code, int)


def test_streams_events_and_memory_stats():
    s = uniop.Stream()
    x = np.random.default_rng(2).standard_normal((64, 256), dtype=np.float32)
    start, end = uniop.Event(), uniop.Event()
    start.record(s)
    y = uniop.softmax(x, stream=s)
    end.record(s)
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0
    np.testing.assert_allclose(y.sum(-1), 1, rtol=1e-5)
    uniop.Stream.default().wait_event(end)
    uniop.synchronize()
    stats = uniop.memory_stats()
    assert stats["alloc_count"] >= stats["free_count"] >= 0
    assert "allocated" in uniop.memory_summary().lower()
    with pytest.raises(uniop.UniopError, match="never recorded"):
        uniop.Event().query()


def test_calls_run_where_no_thread_can_be_started():
    """Under a thread limit (a container's pids.max, `ulimit -u`; here `ulimit -v`, which leaves no
    room for a thread's stack) uniop starts neither its compute workers nor a stream's worker:
    calls run on the calling thread, with a line on stderr saying so. Before, each call raised a
    PanicException (not even an Exception). In a subprocess: the cap is for the whole process."""
    code = """
import resource, threading, numpy as np, uniop
def address_space():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
x = np.random.default_rng(0).standard_normal((64, 1024), dtype=np.float32)
want = x / (1 + np.exp(-x))
# Room for a few outputs, not for a 2 MiB thread stack.
resource.setrlimit(resource.RLIMIT_AS, (address_space() + 3 * (1 << 19), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    threading.Thread(target=print).start()
except RuntimeError as e:
    print("no threads:", e)
y = uniop.silu(x)
print(np.allclose(y, want, rtol=1e-6, atol=1e-6))
s = uniop.Stream()
y = uniop.softmax(x, stream=s)
print(np.allclose(y.sum(-1), 1, rtol=1e-5))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["no threads: can't start new thread", "True", "True"], run.stdout
    assert "compute workers (" in run.stderr and "launches use fewer threads" in run.stderr, run.stderr
    assert "runs its tasks on the threads that enqueue them" in run.stderr, run.stderr


def test_a_child_forked_while_other_threads_run_ops_runs_its_own():
    """A PyTorch DataLoader or multiprocessing forks the process, with every thread but the forking
    one left behind. Here another thread keeps running ops on the default stream and on a stream of
    its own at each fork. Before, the child's first call waited forever for a stream worker that
    did not exist in it; now the child's calls give the right values, and `uniop.synchronize()`
    reports the tasks the other thread had queued (they never run in the child). In a subprocess,
    so a hang is a timeout, not a stuck test run."""
    code = """
import os, threading, time, numpy as np, uniop
rng = np.random.default_rng(0)
a = rng.standard_normal((512, 512), dtype=np.float32)
x = rng.standard_normal((1024, 4096), dtype=np.float32)
w = rng.standard_normal(4096, dtype=np.float32)
stop = False
def busy():
    s = uniop.Stream()
    while not stop:
        uniop.matmul(a, a)
        uniop.silu(x, stream=s)
        uniop.rms_norm(x, w)
worker = threading.Thread(target=busy, daemon=True)
worker.start()
time.sleep(0.3)
for _ in range(5):
    pid = os.fork()
    if pid == 0:
        try:
            ok = np.allclose(uniop.silu(x), x / (1 + np.exp(-x)), rtol=1e-5, atol=1e-6)
            ok &= np.allclose(uniop.matmul(a, a), a @ a, rtol=1e-3, atol=1e-3)
            rms = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w
            ok &= np.allclose(uniop.rms_norm(x, w)[0], rms, rtol=1e-4, atol=1e-4)
            try:
                uniop.synchronize()
            except uniop.UniopError as e:
                ok &= "enqueued before this process forked had not finished" in str(e)
            uniop.synchronize()
            os._exit(0 if ok else 1)
        except BaseException as e:
            print("child:", type(e).__name__, e, flush=True)
            os._exit(2)
    deadline = time.time() + 20
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.time() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise SystemExit("the child hung")
        time.sleep(0.01)
    print(os.waitstatus_to_exitcode(done[1]))
stop = True
worker.join()
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["0"] * 5, run.stdout + run.stderr


def test_profiler_records_each_launch(tmp_path):
    x = np.random.default_rng(3).standard_normal((4, 64), dtype=np.float32)
    w = np.ones(64, dtype=np.float32)
    s = uniop.Stream()
    idle = uniop.Profiler()
    with pytest.raises(uniop.UniopError, match="nothing recorded yet"):
        idle.summary()
    with uniop.Profiler() as prof:
        with pytest.raises(uniop.UniopError, match="already recording"):
            uniop.Profiler().start()
        for _ in range(3):
            uniop.rms_norm(x, w)
        uniop.silu(x[:, ::2], stream=s)
        s.synchronize()
    uniop.rms_norm(x, w)  # after the block: not recorded
    events = prof.events()
    norms = [e for e in events if e["op"] == "rms_norm"]
    assert len(norms) == 3
    assert all(e["tensors"] == "f32[4, 64], f32[64] -> f32[4, 64], f32[4, 1]" for e in norms)
    assert all(e["bytes"] == 4 * (256 + 64 + 256 + 4) and e["duration_us"] >= 0 for e in norms)
    silu = [e for e in events if e["op"] == "silu"]
    assert [e["stream"] for e in silu] == [s.id] and silu[0]["tensors"].startswith("f32[4, 32]")
    starts = [e["start_us"] for e in events]
    assert starts == sorted(starts)
    table = prof.summary(top=0)
    row = next(line for line in table.splitlines() if line.startswith("rms_norm "))
    assert row.split()[3] == "3", table
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    import json

    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"]]
    assert names.count("rms_norm") == 3 and names.count("silu") == 1
    with pytest.raises(OSError, match="cannot write"):
        prof.export_chrome_trace(str(tmp_path / "missing-dir" / "t.json"))


def _plugin_path():
    subprocess.run(["cargo", "build", "-q", "--release", "-p", "uniop-plugin-example"], cwd=ROOT, check=True)
    return ROOT / "target" / "release" / "libuniop_plugin_example.so"


def run_python_ok(code):
    """Runs `code` in a fresh interpreter, which must exit 0 and print "ok"; returns the result."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    return out


def test_plugin_ops_appear_as_functions_and_torch_ops():
    """In a fresh process: plugins stay loaded for the life of the process. The plugin's op names
    its backward op, so it trains through torch.ops.uniop like a built-in: gradcheck in f64, and
    the graph node is the C++ one where those kernels are built."""
    code = f"""
import numpy as np, torch, uniop, uniop.torch
names = uniop.load_library({str(_plugin_path())!r})
assert names == ["squared_relu", "squared_relu_backward"], names
x = np.array([-2.0, 0.5, 3.0], np.float32)
np.testing.assert_allclose(uniop.squared_relu(x), np.maximum(x, 0) ** 2)
t = torch.tensor([-1.0, 2.0])
assert torch.equal(torch.ops.uniop.squared_relu(t), torch.tensor([0.0, 4.0]))
leaf = torch.randn(3, 70, dtype=torch.float64).requires_grad_()
assert torch.autograd.gradcheck(torch.ops.uniop.squared_relu, (leaf,))
leaf = torch.randn(3, 70).requires_grad_()
y = torch.ops.uniop.squared_relu(leaf)
assert type(y.grad_fn).__name__ == ("CppFunction" if uniop.torch.cpp_kernels_loaded() else "FunctionBackward")
(y * torch.arange(70.0)).sum().backward()
torch.testing.assert_close(leaf.grad, 2 * leaf.detach().clamp_min(0) * torch.arange(70.0))
for dy, what in ((np.ones(4, np.float32), "shape"), (np.ones(3, np.float16), "dtype")):
    try:
        uniop.squared_relu_backward(dy, x)
        raise SystemExit("a mismatched dy must fail")
    except uniop.UniopError as e:
        assert "squared_relu_backward" in str(e) and "'dy'" in str(e), e
try:
    uniop.load_library({str(_plugin_path())!r})
    raise SystemExit("a second load must fail")
except uniop.UniopError as e:
    assert "already" in str(e), e
print("ok")
"""
    run_python_ok(code)


def test_numpy_only_without_torch():
    """`import uniop` must not need torch: run it where importing torch fails."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, uniop\n"
        "y = uniop.silu(np.zeros(3, np.float32)); assert (y == 0).all()\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    run_python_ok(code)


def test_data_errors_in_kernels_print_nothing():
    """An index or position the kernel refuses (embedding, cross_entropy, kv_cache_append) raises
    UniopError and writes nothing to stderr: it is the caller's error, not a panic."""
    code = (
        "import numpy as np, uniop\n"
        "table, new = np.ones((4, 3), np.float32), np.ones((1, 1, 1, 4), np.float32)\n"
        "kc, vc = np.zeros((1, 1, 2, 4), np.float32), np.zeros((1, 1, 2, 4), np.float32)\n"
        "calls = [lambda: uniop.embedding(table, np.array([1, 7])),\n"
        "         lambda: uniop.cross_entropy(table, np.array([0, 1, 2, 9]))[0],\n"
        "         lambda: uniop.kv_cache_append(kc, vc, new, new, np.array([5]))]\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "        raise SystemExit('accepted a bad index')\n"
        "    except uniop.UniopError as e:\n"
        "        assert e.code_name == 'runtime' and 'expected values in' in str(e), e\n"
        "        assert 'panicked' not in str(e), e\n"
        "print('ok')\n"
    )
    assert run_python_ok(code).stderr == ""


def test_gemm_kernels_name_what_the_cpu_has():
    """uniop.gemm_kernels() agrees with the kernel's flags in /proc/cpuinfo (Linux x86)."""
    kernels = uniop.gemm_kernels()
    assert set(kernels) == {"bfloat16", "float32"}
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or "flags" not in cpuinfo.read_text():
        pytest.skip("no /proc/cpuinfo flags here")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    avx2 = {"avx2", "fma"} <= flags
    avx512 = {"avx512f", "avx512bw"} <= flags

    def level(top):
        return "avx512" if top else "avx2" if avx2 else "scalar"

    bf16 = level(avx512 and "avx512_bf16" in flags)
    # AMX also needs Linux's grant of the tile state, which a kernel without AMX support refuses.
    amx = bf16 == "avx512" and {"amx_tile", "amx_bf16"} <= flags
    assert kernels["float32"] == level(avx512)
    assert kernels["bfloat16"] in (("amx", bf16) if amx else (bf16,))
