#!/usr/bin/env python3
"""uniop vs PyTorch on the same machine, in the same run.

For each op, runs `uniop bench --json` (uniop's kernels plus a STREAM and an FMA probe), then
times PyTorch eager and torch.compile (Inductor) on the same shapes and dtypes right after, with
warm tensors, best-of-N; repeats that `--rounds` times, keeps each figure's best, and prints one
markdown table of times and ratios. The peer implementations below are
what a PyTorch user writes today (HF LlamaRMSNorm semantics, F.silu, a + alpha*b).

Usage: python benches/torch_peer.py [--ops rms_norm,silu,add | --all] [--dtypes f32,bf16] [--iters 20]
                                   [--rounds 3] [--markdown bench.md] [--png bench.png]
`--markdown` also writes the table to a file, `--png` plots the speedups (matplotlib).
Needs torch: scripts/python-env.sh installs it into .venv. Not part of the test suite.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"f32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "f16": torch.float16, "float16": torch.float16, "i64": torch.int64, "int64": torch.int64,
          "i32": torch.int32, "int32": torch.int32}


def rms_norm(x, w, eps=1e-6):
    # HF LlamaRMSNorm: compute in f32, cast back, scale.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, cos, sin):
    # HF apply_rotary_pos_emb on [B, N, S, D] with [S, D] tables.
    return x * cos + rotate_half(x) * sin


def causal_softmax(x):
    sq, sk = x.shape[-2:]
    mask = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
    return x.masked_fill(mask, float("-inf")).softmax(-1)


def sample(logits, top_k=50, top_p=0.9):
    # HF TopK + TopP warpers, then multinomial (uniop's example uses the same settings).
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, idx = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    remove = (cum <= 1 - top_p).scatter(-1, idx, cum <= 1 - top_p)
    probs = logits.masked_fill(remove, float("-inf")).softmax(-1)
    return torch.multinomial(probs.float(), 1)


def add_rms_norm(x, r, w):
    h = x + r
    return rms_norm(h, w), h


def swiglu(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def geglu(x):
    """uniop's geglu example, aclnn's default: the second half gated (erf GELU)."""
    a, b = x.chunk(2, dim=-1)
    return a * F.gelu(b)


def clamped_swiglu(x, alpha=1.702, limit=7.0):
    """transformers' GptOssExperts._apply_gate: interleaved gate/up, both clamped."""
    gate, up = x[..., ::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def softcapped_swiglu(x, gate_softcap=4.0, up_softcap=25.0):
    """transformers' Inkling2SoftcappedSwiGLU on Inkling2Experts' halves, in float32, rounded once."""
    gate, up = (t.float() for t in x.chunk(2, dim=-1))
    capped_gate, capped_up = torch.tanh(gate / gate_softcap) * gate_softcap, torch.tanh(up / up_softcap) * up_softcap
    return (capped_gate * torch.sigmoid(gate) * capped_up).to(x.dtype)


def intermediate(hidden):
    """Llama's MLP width for a hidden size, as uniop's linear_silu_mul example takes it (8k/3
    rounded up to a multiple of 256: 384 -> 1024, 4096 -> 11008)."""
    width = -(-8 * hidden // 3)  # ceil(8k/3)
    return -(-width // 256) * 256


def gated_inputs(shape, dt):
    """uniop's linear_silu_mul example: x and two weights [n, k], n Llama's intermediate size."""
    weight = (intermediate(shape[-1]), shape[-1])
    return torch.randn(shape, dtype=dt), torch.randn(weight, dtype=dt), torch.randn(weight, dtype=dt)


def gated(act):
    """HF's gated MLP composite act_fn(gate_proj(x)) * up_proj(x) (LlamaMLP's with F.silu)."""
    return lambda x, wg, wu: act(F.linear(x, wg)) * F.linear(x, wu)


def gated_train(act):
    """The same, returning its products as linear_silu_mul_train does."""

    def composite(x, wg, wu):
        g, u = F.linear(x, wg), F.linear(x, wu)
        return act(g) * u, g, u

    return composite


def kv_cache_inputs(shape, dt):
    """uniop's example: a quarter of the cache length appended per sequence at random positions."""
    b, h, s_max, d = shape
    s_new = -(-s_max // 4)
    positions = [int(p) for p in torch.randint(0, s_max - s_new + 1, (b,))]
    return (torch.randn(shape, dtype=dt), torch.randn(shape, dtype=dt), torch.randn((b, h, s_new, d), dtype=dt),
            torch.randn((b, h, s_new, d), dtype=dt), positions)


def cat_inputs(shape, dt):
    """uniop's example: a KV-cache step, the past joined with half its length and one position
    along the second-to-last dim."""
    with_len = lambda n: torch.randn((*shape[:-2], n, shape[-1]), dtype=dt)  # noqa: E731
    return with_len(shape[-2]), with_len(-(-shape[-2] // 2)), with_len(1)


def permute_dims(rank):
    """uniop's example dims: [B, S, H, D] <-> [B, H, S, D] for rank 4, else the last two swapped
    (each its own inverse, so permute_backward's peer is the same permute)."""
    return [0, 2, 1, 3] if rank == 4 else [*range(rank - 2), rank - 1, rank - 2]


def rope_cos_sin(positions, dim=128, theta=10000.0):
    """transformers' default rope tables (LlamaRotaryEmbedding): f32 angles and tables, `half` layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def kv_cache_append(k_cache, v_cache, k, v, positions):
    s_new = k.shape[2]
    for b, p in enumerate(positions):
        k_cache[b, :, p:p + s_new] = k[b]
        v_cache[b, :, p:p + s_new] = v[b]


PEERS = {
    "rms_norm": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape[-1:], dtype=dt)), rms_norm),
    # layer_norm's example: x, weight and bias over the last dim.
    "layer_norm": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape[-1:], dtype=dt),
                                      torch.randn(shape[-1:], dtype=dt)),
                   lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b)),
    "silu": (lambda shape, dt: (torch.randn(shape, dtype=dt),), F.silu),
    "gelu": (lambda shape, dt: (torch.randn(shape, dtype=dt),), F.gelu),
    "add": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape, dtype=dt)), lambda a, b: a + b),
    "silu_mul": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape, dtype=dt)),
                 lambda g, u: F.silu(g) * u),
    # uniop's example: approximate='none', torch's default.
    "gelu_mul": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape, dtype=dt)),
                 lambda g, u: F.gelu(g) * u),
    "swiglu": (lambda shape, dt: (torch.randn(shape, dtype=dt),), swiglu),
    "geglu": (lambda shape, dt: (torch.randn(shape, dtype=dt),), geglu),
    # Deviation 4: a share of the values past the limit of 7, as uniop's example draws them.
    "clamped_swiglu": (lambda shape, dt: ((4 * torch.randn(shape)).to(dt),), clamped_swiglu),
    # Deviation 10: a share of the values past the gate's cap of 4, some near the up's of 25.
    "softcapped_swiglu": (lambda shape, dt: ((10 * torch.randn(shape)).to(dt),), softcapped_swiglu),
    "softmax": (lambda shape, dt: (torch.randn(shape, dtype=dt),), lambda x: torch.softmax(x, -1)),
    "log_softmax": (lambda shape, dt: (torch.randn(shape, dtype=dt),), lambda x: torch.log_softmax(x, -1)),
    "matmul": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn((shape[-1], shape[-1]), dtype=dt)),
               torch.matmul),
    "rope": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape[-2:], dtype=dt),
                                torch.randn(shape[-2:], dtype=dt)), rope),
    "causal_softmax": (lambda shape, dt: (torch.randn(shape, dtype=dt),), causal_softmax),
    "argmax": (lambda shape, dt: (torch.randn(shape, dtype=dt),), lambda x: torch.argmax(x, -1)),
    "sample": (lambda shape, dt: (torch.randn(shape, dtype=dt),), sample),
    # uniop's example casts f32 to bf16 and everything else to f32.
    "cast": (lambda shape, dt: (torch.randn(shape, dtype=dt),),
             lambda x: x.to(torch.bfloat16 if x.dtype == torch.float32 else torch.float32)),
    # Causal prefill, as uniop's example (MHA at the default shape).
    "attention": (lambda shape, dt: tuple(torch.randn(shape, dtype=dt) for _ in range(3)),
                  lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    "add_rms_norm": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape, dtype=dt),
                                        torch.randn(shape[-1:], dtype=dt)), add_rms_norm),
    # uniop's example: weight [2k, k] (an up projection) with bias.
    "linear": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn((2 * shape[-1], shape[-1]), dtype=dt),
                                  torch.randn((2 * shape[-1],), dtype=dt)), F.linear),
    # uniop's example: a square weight (an output projection) and the residual it joins.
    "linear_add": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn((shape[-1], shape[-1]), dtype=dt),
                                      torch.randn(shape, dtype=dt)), lambda x, w, r: r + F.linear(x, w)),
    # torch's HF LlamaMLP composite act_fn(gate_proj(x)) * up_proj(x).
    "linear_silu_mul": (gated_inputs, gated(F.silu)),
    # The same, also returning the products (what autograd of the composite keeps for its backward).
    "linear_silu_mul_train": (gated_inputs, gated_train(F.silu)),
    # GemmaMLP's (uniop's example: approximate='none').
    "linear_gelu_mul": (gated_inputs, gated(F.gelu)),
    "linear_gelu_mul_train": (gated_inputs, gated_train(F.gelu)),
    # The packed forms (uniop's weight packed once by pack_weight, outside the timing) against torch's
    # linear on the plain weight: torch eager has no packed CPU linear of its own (torch.compile's
    # weight prepacking needs `freezing`, which this peer leaves off).
    "linear_packed": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn((2 * shape[-1], shape[-1]), dtype=dt),
                                         torch.randn((2 * shape[-1],), dtype=dt)), F.linear),
    "linear_add_packed": (lambda shape, dt: (torch.randn(shape, dtype=dt),
                                             torch.randn((shape[-1], shape[-1]), dtype=dt), torch.randn(shape, dtype=dt)),
                          lambda x, w, r: r + F.linear(x, w)),
    "linear_silu_mul_packed": (gated_inputs, gated(F.silu)),
    "linear_gelu_mul_packed": (gated_inputs, gated(F.gelu)),
    # Main shape is the table [V, H]; 2048 token ids.
    "embedding": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randint(0, shape[0], (2048,))),
                  lambda w, ids: F.embedding(ids, w)),
    "cross_entropy": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randint(0, shape[-1], shape[:-1])),
                      F.cross_entropy),
    "kv_cache_append": (kv_cache_inputs, kv_cache_append),
    # add_backward's example: b broadcast along a's leading dims (a bias), alpha -0.5.
    "add_broadcast": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape[-1:], dtype=dt)),
                      lambda a, b: torch.add(a, b, alpha=-0.5)),
    # uniop's example: b broadcast along a's leading dims (a per-channel scale).
    "mul": (lambda shape, dt: (torch.randn(shape, dtype=dt), torch.randn(shape[-1:], dtype=dt)), torch.mul),
    "cat": (cat_inputs, lambda *ts: torch.cat(ts, dim=-2)),
    # A contiguous copy, as uniop's permute returns (and its backward: the inverse permutation).
    "permute": (lambda shape, dt: (torch.randn(shape, dtype=dt),),
                lambda x: x.permute(permute_dims(x.dim())).contiguous()),
    "permute_backward": (lambda shape, dt: (torch.randn(shape, dtype=dt),),
                         lambda dout: dout.permute(permute_dims(dout.dim())).contiguous()),
    # uniop's example: integer positions (`--dtypes i64` or i32), head dim 128, f32 tables.
    "rope_cos_sin": (lambda shape, dt: (torch.arange(shape[-1], dtype=dt).expand(shape).contiguous(),), rope_cos_sin),
}


# Backward ops: torch autograd of the forward peer (backward pass only; the forward runs once
# outside the timing). Entry: forward op, inputs that get gradients (what uniop's backward op
# returns). A backward op's reported shape (uniop's `example_shape`) is its forward's main shape.
BACKWARD = {
    "rms_norm_backward": ("rms_norm", (0, 1)),
    "add_rms_norm_backward": ("add_rms_norm", (0, 1, 2)),
    "layer_norm_backward": ("layer_norm", (0, 1, 2)),
    "silu_mul_backward": ("silu_mul", (0, 1)),
    "gelu_mul_backward": ("gelu_mul", (0, 1)),
    "swiglu_backward": ("swiglu", (0,)),
    "geglu_backward": ("geglu", (0,)),
    "clamped_swiglu_backward": ("clamped_swiglu", (0,)),
    "softcapped_swiglu_backward": ("softcapped_swiglu", (0,)),
    "softmax_backward": ("softmax", (0,)),
    "gelu_backward": ("gelu", (0,)),
    "log_softmax_backward": ("log_softmax", (0,)),
    "rope_backward": ("rope", (0,)),
    "attention_backward": ("attention", (0, 1, 2)),
    "matmul_backward": ("matmul", (0, 1)),
    "linear_backward": ("linear", (0, 1, 2)),
    "linear_add_backward": ("linear_add", (0, 1, 2)),
    "linear_silu_mul_backward": ("linear_silu_mul", (0, 1, 2)),
    "linear_gelu_mul_backward": ("linear_gelu_mul", (0, 1, 2)),
    "cross_entropy_backward": ("cross_entropy", (0,)),
    "embedding_backward": ("embedding", (0,)),
    "silu_backward": ("silu", (0,)),
    "add_backward": ("add_broadcast", (0, 1)),
    "mul_backward": ("mul", (0, 1)),
    "cast_backward": ("cast", (0,)),
    # torch's gradient of cat is views of dout (narrow); uniop's outputs never alias an input, so
    # its gradients are copies.
    "cat_backward": ("cat", (0, 1, 2)),
}


def autograd_peer(name):
    """(make, fn) timing only the backward of the forward peer; `fn` may be torch.compile'd."""
    fwd_name, wrt = BACKWARD[name]
    make_fwd, fwd = PEERS[fwd_name]

    def make(shape, dt):
        inputs = make_fwd(shape, dt)
        for i in wrt:
            inputs[i].requires_grad_(True)
        return inputs

    def run(forward):
        def backward(*inputs):
            if not hasattr(backward, "out"):
                out = forward(*inputs)
                backward.out = out if isinstance(out, tuple) else (out,)
                backward.dout = tuple(torch.randn_like(o) for o in backward.out)
            return torch.autograd.grad(backward.out, [inputs[i] for i in wrt], backward.dout, retain_graph=True)
        return backward

    return make, fwd, run


WARM_UP_S = 0.2


def best_ms(fn, args, iters):
    """Best of `iters` calls after a warm-up as long as `uniop bench`'s (BENCH_WARM_UP in
    crates/uniop/src/verify.rs): the first call compiles, and the pool's second thread comes back
    from idle slow for the first tens of milliseconds on these cloud machines."""
    fn(*args)
    warming = time.perf_counter()
    while time.perf_counter() - warming < WARM_UP_S:
        fn(*args)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def gflop(op, shape):
    """Work of the compute-bound ops (for % of the FMA probe), else None."""
    if op in ("matmul", "matmul_backward"):
        m, k = shape[-2:]
        return (2 if op == "matmul" else 4) * m * k * k * (math.prod(shape[:-2]) or 1) / 1e9
    if op in ("linear", "linear_packed", "linear_backward"):
        k = shape[-1]
        rows = math.prod(shape[:-1])
        return (4 if op == "linear_backward" else 2) * rows * k * 2 * k / 1e9
    if op in ("linear_add", "linear_add_packed", "linear_add_backward"):
        k = shape[-1]
        return (4 if op == "linear_add_backward" else 2) * math.prod(shape[:-1]) * k * k / 1e9
    if op.startswith(("linear_silu_mul", "linear_gelu_mul")):
        # Two products forward; four in the backward (its example takes the saved products).
        k = shape[-1]
        return (8 if op.endswith("_backward") else 4) * math.prod(shape[:-1]) * k * intermediate(k) / 1e9
    if op in ("attention", "attention_backward"):
        b, h, s, d = shape
        # Forward: QKᵀ and PV. Backward: QKᵀ recomputed, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q, dS·K (the fused route of
        # attention_backward.rs; its split route for few (batch, kv head) pairs recomputes two more).
        matmuls = 2 if op == "attention" else 5
        return matmuls * 2 * b * h * s * s * d / 2 / 1e9  # causal: half the tiles
    return None


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['op']} {r['dtype']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rows)), 5))
    ax.bar([i - 0.2 for i in x], [r["vs_eager"] for r in rows], 0.4, label="vs torch eager")
    ax.bar([i + 0.2 for i in x], [r["vs_compile"] for r in rows], 0.4, label="vs torch.compile")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speedup (higher is better)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=70, ha="right", fontsize=8)
    ax.legend()
    ax.set_title("uniop vs PyTorch, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def uniop_bench(args, op):
    """`uniop bench` for one op (every dtype asked for), with its own bandwidth and FMA probes."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        shape = ["--shape", args.shape] if args.shape else []
        subprocess.run([args.uniop, "bench", "--ops", op, "--dtypes", args.dtypes, "--iters", str(args.iters),
                        *shape, "--json", f.name], check=True, stdout=sys.stderr)
        return json.load(open(f.name))


class PeerRow:
    """One uniop result row and its torch peers, each kept at its best over the rounds.

    The peers (and the compiled graph) are built once; every round times uniop, eager and compiled
    again, so a slow phase of this shared machine lands in one round of each, not in one side."""

    def __init__(self, r):
        if r["op"] in BACKWARD:
            make, fn, wrap = autograd_peer(r["op"])
        else:
            (make, fn), wrap = PEERS[r["op"]], lambda f: f
        self.r = dict(r)
        self.inputs = make(tuple(r["shape"]), DTYPES[r["dtype"]])
        self.eager_fn, self.compiled_fn = wrap(fn), wrap(torch.compile(fn, dynamic=False))
        self.eager = self.compiled = float("inf")

    def time_round(self, r, iters):
        if r["ms"] < self.r["ms"]:
            self.r = dict(r)
        self.eager = min(self.eager, best_ms(self.eager_fn, self.inputs, iters))
        self.compiled = min(self.compiled, best_ms(self.compiled_fn, self.inputs, iters))

    def line(self, probe):
        """The markdown line (against `probe`: the op's best probe figures over the rounds) and the speedups."""
        r, eager, comp = self.r, self.eager, self.compiled
        shape = "x".join(map(str, r["shape"]))
        work = gflop(r["op"], r["shape"])
        # bf16 products run on AMX tiles where the CPU has them: 16 times the FMA pipes' multiply-adds.
        peak = probe["amx_gflops"] if r["dtype"] == "bfloat16" and probe["amx_gflops"] else probe["fma_gflops"]
        flops = f"{work / r['ms'] * 1e3:.0f} | {100 * work / r['ms'] * 1e3 / peak:.0f}%" if work else "— | —"
        line = (f"| {r['op']} | {r['dtype']} | {shape} | {r['ms']:.3f} | {eager:.3f} | {comp:.3f} | "
                f"{eager / r['ms']:.2f}x | {comp / r['ms']:.2f}x | {r['gbs']:.1f} | "
                f"{100 * r['gbs'] / probe['stream_scale_gbs']:.0f}% | "
                f"{100 * r['gbs'] / probe['stream_scale_nt_gbs']:.0f}% | {flops} |")
        return line, {"op": r["op"], "dtype": r["dtype"], "vs_eager": eager / r["ms"], "vs_compile": comp / r["ms"]}


def best_probe(rounds):
    """Each probe figure at its best over the rounds, so the % columns never flatter uniop."""
    keys = ("stream_scale_gbs", "stream_scale_nt_gbs", "stream_triad_gbs", "fma_gflops", "amx_gflops")
    return {k: max((b[k] for b in rounds if b.get(k) is not None), default=None) for k in keys}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="rms_norm")
    p.add_argument("--all", action="store_true", help="every op that has a torch peer")
    p.add_argument("--markdown")
    p.add_argument("--png")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shape", help="main input shape of every op, as `uniop bench --shape` (e.g. 1x32x2048x128: "
                   "rms_norm over 128-wide heads, QK-norm); default: each op's representative shape")
    p.add_argument("--rounds", type=int, default=3, help="alternations of uniop and torch per op; best kept")
    p.add_argument("--uniop", default=os.path.join(ROOT, "target", "release", "uniop"))
    args = p.parse_args()
    if args.all:
        # PEERS also holds forward peers that only back a backward op's autograd (add_broadcast).
        listed = subprocess.run([args.uniop, "list"], check=True, capture_output=True, text=True).stdout
        registered = {line.split()[0] for line in listed.splitlines()[1:] if line.strip()}
        args.ops = ",".join(op for op in [*PEERS, *BACKWARD] if op in registered)
    unknown = [op for op in args.ops.split(",") if op not in PEERS and op not in BACKWARD]
    if unknown:
        p.error(f"--ops: no torch peer for {', '.join(unknown)}; ops with one: {', '.join([*PEERS, *BACKWARD])}")

    # One op at a time: each round runs its `uniop bench` call (kernels and probes) and then the torch
    # peers straight after, and every figure is the best over the rounds. On a shared machine, phases
    # minutes apart see very different memory bandwidth; a single round lets one phase decide a ratio.
    torch.set_num_threads(os.cpu_count())
    head = ("| op | dtype | shape | uniop ms | torch eager ms | torch.compile ms | vs eager | vs compile | uniop GB/s "
            "| % of scale | % of scale NT | GFLOP/s | % of compute probe |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(head, flush=True)
    rows, probes, plotted = [], [], []
    for op in args.ops.split(","):
        rounds, peers = [], []
        for _ in range(args.rounds):
            ours = uniop_bench(args, op)
            rounds.append(ours)
            if not peers:
                peers = [PeerRow(r) for r in ours["results"]]
            for peer, r in zip(peers, ours["results"]):
                peer.time_round(r, args.iters)
        probe = best_probe(rounds)
        probes.append(probe)
        for peer in peers:
            line, speedups = peer.line(probe)
            print(line, flush=True)
            rows.append(line)
            plotted.append(speedups)

    def span(key):
        values = [p[key] for p in probes if p[key] is not None]
        return f"{min(values):.1f}–{max(values):.1f}" if values else "none"

    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.rounds} rounds per op "
             f"(uniop, eager, compiled alternating); each op's best probes (min–max over the ops): STREAM scale {span('stream_scale_gbs')} GB/s, scale non-temporal "
             f"{span('stream_scale_nt_gbs')} GB/s, triad {span('stream_triad_gbs')} GB/s; FMA probe "
             f"{span('fma_gflops')} GFLOP/s, AMX probe {span('amx_gflops')} GFLOP/s (the % of compute probe column: bf16 "
             f"against the AMX probe where there is one, else the FMA probe)\n", head, *rows]
    print(lines[0])
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.png:
        plot(plotted, args.png)


if __name__ == "__main__":
    main()
