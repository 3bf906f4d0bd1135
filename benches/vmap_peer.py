"""torch.func.vmap over uniop ops against vmap over torch's own, in the same run.

    .venv/bin/python benches/vmap_peer.py [--samples 64] [--rows 32] [--hidden 256] [--features 512] [--rounds 20]

`--samples` samples of `[rows, hidden]` float32, vmapped through softmax, rms_norm, linear (to `--features`), the
three in a row (rms_norm → linear → softmax, a squared sum), and `vmap(grad)` of that model and of rms_norm → linear
→ cross_entropy against per-sample targets, the same from token ids through an embedding (`--features` rows), and
with a Llama MLP's gate and up projections (linear_silu_mul to `--features`) before the last linear: per-sample
gradients of the norm weight and the projections (and the table); and attention written with matmul (4 heads,
`softmax(q kᵀ) v`, q, k and v projected by linear), then the same causal, by uniop's attention against torch's SDPA
(each sample's `[4, rows, hidden / 4]` heads: attention takes the batch as one more leading dim), and the same not
causal with a learned `[4, rows, rows]` bias added to the scores (T5's relative position bias, SDPA's float
`attn_mask`: its per-sample gradient too); and a learned prefix of `rows / 2` tokens joined by cat in front of each
sample before the linear (prefix tuning); and a rotary layer with per-sample positions (each sample's own offset, as
in a left-padded batch): rope tables built from the positions (uniop's rope_cos_sin, HF's formula in torch), a
projection by linear split into 4 heads and permuted to `[4, rows, hidden / 4]` (torch: a view), rotated by rope.
uniop's ops batch through the rules `uniop.torch` generates from
`Op::elementwise`, `Op::leading_batch_args` and `Op::core_dims` (one call over the batch); the backwards that sum a
parameter's gradient over rows (rms_norm_backward, linear_backward, linear_silu_mul_backward, embedding_backward,
attention_backward's bias and sinks gradients) and cross_entropy's mean keep one per sample through their
`batch_dims`. Best of `--rounds` calls, in milliseconds.
"""

import argparse
import warnings

import torch

import uniop.torch  # noqa: F401  (registers torch.ops.uniop)
from masked_attention import best_ms


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="There is a performance drop")  # the per-sample fallback's
    torch.manual_seed(0)
    x = torch.randn(args.samples, args.rows, args.hidden)
    targets = torch.randint(0, args.features, (args.samples, args.rows))
    tokens, table = torch.randint(0, args.features, (args.samples, args.rows)), torch.randn(args.features, args.hidden)
    params = (torch.rand(args.hidden) + 0.5, torch.randn(args.features, args.hidden))
    # gate and up [features, hidden], then a linear [features, features] to the classes.
    mlp = [torch.randn(args.features, args.hidden) / 16 for _ in range(2)] + [torch.randn(args.features, args.features)]
    ops = torch.ops.uniop
    uniop_ops = {
        "softmax": lambda a: ops.softmax(a, -1),
        "norm": lambda a, w: ops.rms_norm(a, w)[0],
        "linear": ops.linear,
        "silu_mul_proj": ops.linear_silu_mul,
        "matmul": ops.matmul,
        "cross_entropy": lambda a, t: ops.cross_entropy(a, t)[0],
        "embedding": ops.embedding,
        "attention": lambda q, k, v: ops.attention(q, k, v, None, True)[0],
        "biased_attention": lambda q, k, v, bias: ops.attention(q, k, v, None, False, None, bias)[0],
        "cat": ops.cat,
        "rope_tables": lambda pos: ops.rope_cos_sin(pos, args.hidden // 4),
        "permute": ops.permute,
        "rope": ops.rope,
    }

    def rope_tables(pos):
        """HF's default rope tables (LlamaRotaryEmbedding), in torch."""
        dim = args.hidden // 4
        inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        angles = pos[..., None].float() * inv_freq
        return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope_half(a, cos, sin):
        """HF's apply_rotary_pos_emb of one tensor."""
        rotated = torch.cat([-a[..., a.shape[-1] // 2 :], a[..., : a.shape[-1] // 2]], -1)
        return a * cos + rotated * sin

    torch_ops = {
        "softmax": lambda a: torch.softmax(a, -1),
        "norm": lambda a, w: torch.nn.functional.rms_norm(a, (args.hidden,), w, 1e-6),
        "linear": torch.nn.functional.linear,
        "silu_mul_proj": lambda a, g, u: torch.nn.functional.silu(a @ g.T) * (a @ u.T),
        "matmul": torch.matmul,
        "cross_entropy": torch.nn.functional.cross_entropy,
        "embedding": lambda w, i: torch.nn.functional.embedding(i, w),
        "attention": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        "biased_attention": lambda q, k, v, bias: torch.nn.functional.scaled_dot_product_attention(q, k, v, bias),
        "cat": torch.cat,
        "rope_tables": rope_tables,
        "permute": torch.permute,
        "rope": rope_half,
    }

    def model(o, p, xb):
        return o["softmax"](o["linear"](o["norm"](xb, p[0]), p[1])).pow(2).sum()

    def training_loss(o, p, xb, tb):
        return o["cross_entropy"](o["linear"](o["norm"](xb, p[0]), p[1]), tb)

    def mlp_loss(o, p, xb, tb):
        return o["cross_entropy"](o["linear"](o["silu_mul_proj"](o["norm"](xb, p[0]), p[1], p[2]), p[3]), tb)

    def attention_loss(o, p, xb):
        q, k, v = (o["linear"](xb, w).unflatten(-1, (4, -1)).transpose(-3, -2) for w in p)  # [4, rows, hidden / 4]
        return o["matmul"](o["softmax"](o["matmul"](q, k.transpose(-1, -2))), v).pow(2).sum()

    def flash_loss(o, p, xb):
        q, k, v = (o["linear"](xb, w).unflatten(-1, (4, -1)).transpose(-3, -2) for w in p)
        return o["attention"](q, k, v).pow(2).sum()

    def biased_loss(o, p, xb):
        q, k, v = (o["linear"](xb, w).unflatten(-1, (4, -1)).transpose(-3, -2) for w in p[:3])
        return o["biased_attention"](q, k, v, p[3]).pow(2).sum()

    def prefix_loss(o, p, xb):
        return o["linear"](o["cat"]([p[0], xb], -2), p[1]).pow(2).sum()

    def rotary_loss(o, p, xb, pos):
        cos, sin = o["rope_tables"](pos)  # [rows, hidden / 4], per sample
        heads = o["permute"](o["linear"](xb, p).unflatten(-1, (4, -1)), [1, 0, 2])  # [4, rows, hidden / 4]
        return o["rope"](heads, cos, sin).pow(2).sum()

    # Each sample's positions start at its own offset (a left-padded batch).
    positions = torch.randint(0, 64, (args.samples, 1)) + torch.arange(args.rows)
    projections = [torch.randn(args.hidden, args.hidden) / args.hidden**0.5 for _ in range(3)]
    prefix = (torch.randn(args.rows // 2, args.hidden), params[1])
    cases = {
        "softmax": lambda o: torch.func.vmap(o["softmax"])(x),
        "rms_norm": lambda o: torch.func.vmap(lambda s: o["norm"](s, params[0]))(x),
        "linear": lambda o: torch.func.vmap(lambda s: o["linear"](s, params[1]))(x),
        "rms_norm → linear → softmax": lambda o: torch.func.vmap(lambda s: model(o, params, s))(x),
        "vmap(grad) of it": lambda o: torch.func.vmap(torch.func.grad(lambda p, s: model(o, p, s)), (None, 0))(
            params, x
        ),
        "vmap(grad) of rms_norm → linear → cross_entropy": lambda o: torch.func.vmap(
            torch.func.grad(lambda p, s, t: training_loss(o, p, s, t)), (None, 0, 0)
        )(params, x, targets),
        "vmap(grad) of embedding → rms_norm → linear → cross_entropy": lambda o: torch.func.vmap(
            torch.func.grad(lambda p, i, t: training_loss(o, p[:2], o["embedding"](p[2], i), t)), (None, 0, 0)
        )((*params, table), tokens, targets),
        "vmap(grad) of rms_norm → linear_silu_mul → linear → cross_entropy": lambda o: torch.func.vmap(
            torch.func.grad(lambda p, s, t: mlp_loss(o, p, s, t)), (None, 0, 0)
        )((params[0], *mlp), x, targets),
        "vmap(grad) of matmul attention": lambda o: torch.func.vmap(
            torch.func.grad(lambda p, s: attention_loss(o, p, s)), (None, 0)
        )(projections, x),
        "vmap(grad) of causal attention (uniop attention, torch SDPA)": lambda o: torch.func.vmap(
            torch.func.grad(lambda p, s: flash_loss(o, p, s)), (None, 0)
        )(projections, x),
        "vmap(grad) of attention with a learned bias (uniop attention, torch SDPA)": lambda o: torch.func.vmap(
            torch.func.grad(lambda p, s: biased_loss(o, p, s)), (None, 0)
        )((*projections, torch.randn(4, args.rows, args.rows)), x),
        "vmap(grad) of cat (a learned prefix) → linear": lambda o: torch.func.vmap(
            torch.func.grad(lambda p, s: prefix_loss(o, p, s)), (None, 0)
        )(prefix, x),
        "vmap(grad) of linear → permute → rope, per-sample positions": lambda o: torch.func.vmap(
            torch.func.grad(lambda p, s, pos: rotary_loss(o, p, s, pos)), (None, 0, 0)
        )(projections[0], x, positions),
    }
    print(f"{args.samples} samples of [{args.rows}, {args.hidden}] float32, {torch.get_num_threads()} threads, "
          f"best of {args.rounds}\n")
    print("| vmap of | uniop ms | torch ms | uniop vs torch |")
    print("|---|---|---|---|")
    for name, case in cases.items():
        ours, theirs = (best_ms(lambda o=o: case(o), 1, rounds=args.rounds) for o in (uniop_ops, torch_ops))
        print(f"| {name} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x |")


if __name__ == "__main__":
    main()
