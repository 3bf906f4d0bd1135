"""Tensors past 2^31 elements and 2^32 bytes, at the sizes LLM work reaches: a 128k vocabulary's
logits for 16k tokens, a Llama 3 embedding table in float32, a batch's KV cache.

Why: a kernel that keeps an index or a byte offset in 32 bits works on every small test and writes
out of bounds (or reads the wrong rows) only here. Each test checks values at the start and past the
2^31 mark against torch, so an offset that wrapped shows as a wrong value, not a crash later.

Each test holds up to ~12 GiB; they skip when the machine has less than 14 GiB free.
"""

import pytest
import torch

import uniop
import uniop.torch  # noqa: F401  (torch.ops.uniop, for the backward)

BIG = 2**31


def _available_gib():
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        return 0.0


pytestmark = pytest.mark.skipif(
    _available_gib() < 14, reason=f"needs 14 GiB of free memory, {_available_gib():.1f} GiB available"
)


@pytest.fixture(autouse=True)
def _return_cached_blocks():
    """The outputs' blocks stay in uniop's cache after a test (up to twice the most bytes ever live,
    GiBs here): give them back, so the rest of the suite runs with the memory it had."""
    yield
    uniop.empty_cache()


def _ends_and_middle(n):
    return [0, n // 2, n - 1]


def test_silu_past_two_to_the_32_bytes():
    n = BIG + 40  # bf16: the last elements sit past byte 2^32
    x = torch.full((n,), 0.5, dtype=torch.bfloat16)
    x[BIG - 64 :] = torch.randn(104).bfloat16()
    y = uniop.silu(x)
    assert y.shape == (n,)
    for lo, hi in [(0, 64), (BIG - 64, n)]:
        ref = torch.nn.functional.silu(x[lo:hi].float())
        torch.testing.assert_close(y[lo:hi].float(), ref, rtol=2**-8, atol=1e-3)


def test_rms_norm_rows_past_two_to_the_31_elements():
    rows, width = BIG // 16384 + 28, 16384
    x = torch.ones(rows, width, dtype=torch.bfloat16)
    w = torch.randn(width).bfloat16()
    for r in _ends_and_middle(rows):
        x[r] = torch.randn(width).bfloat16()
    y, rstd = uniop.rms_norm(x, w)
    for r in _ends_and_middle(rows):
        ref = torch.nn.functional.rms_norm(x[r].float(), (width,), w.float(), 1e-6)
        torch.testing.assert_close(y[r].float(), ref, rtol=2**-7, atol=1e-2)
        torch.testing.assert_close(rstd[r, 0], x[r].float().pow(2).mean().add(1e-6).rsqrt(), rtol=1e-5, atol=0)


def test_cross_entropy_and_its_gradient_over_a_128k_vocabulary():
    tokens, vocab = 16800, 128256  # 2.15e9 logits
    logits = torch.zeros(tokens, vocab, dtype=torch.bfloat16)
    picked = _ends_and_middle(tokens)
    logits[picked] = torch.randn(len(picked), vocab).bfloat16()
    target = torch.randint(0, vocab, (tokens,))
    logits.requires_grad_()
    loss, lse = torch.ops.uniop.cross_entropy(logits, target)
    loss.backward()
    rows = logits.detach()[picked].float().requires_grad_()
    torch.testing.assert_close(lse[picked], torch.logsumexp(rows, -1), rtol=1e-5, atol=1e-5)
    torch.nn.functional.cross_entropy(rows, target[picked], reduction="sum").backward()
    # The mean over all tokens divides each row's gradient by their count.
    torch.testing.assert_close(logits.grad[picked].float() * tokens, rows.grad, rtol=2**-7, atol=2e-3)


def test_embedding_from_a_table_past_two_to_the_31_bytes():
    vocab, hidden = 128256, 4200  # float32: 2.15 GB
    weight = torch.empty(vocab, hidden)
    weight[:] = torch.arange(hidden, dtype=torch.float32)
    weight[-5:] = torch.randn(5, hidden)
    indices = torch.tensor([[vocab - 1, vocab - 3, 0, vocab // 2, vocab - 5]])
    torch.testing.assert_close(uniop.embedding(weight, indices), torch.nn.functional.embedding(indices, weight))


def test_linear_writing_past_two_to_the_31_elements():
    tokens, k, vocab = 16800, 64, 128256  # the logits: 2.15e9 elements
    x, w = torch.randn(tokens, k).bfloat16(), torch.randn(vocab, k).bfloat16()
    y = uniop.linear(x, w)
    assert y.numel() > BIG
    for r in _ends_and_middle(tokens):
        ref = x[r].float() @ w.float().T
        torch.testing.assert_close(y[r].float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def test_kv_cache_append_and_decode_over_a_cache_past_two_to_the_31_elements():
    batch, heads, slots, dim = 32, 8, 65536 + 64, 128
    k_cache = torch.zeros(batch, heads, slots, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    assert k_cache.numel() > BIG
    k, v = torch.randn(batch, heads, 1, dim).bfloat16(), torch.randn(batch, heads, 1, dim).bfloat16()
    uniop.kv_cache_append(k_cache, v_cache, k, v, torch.full((batch,), slots - 1))
    assert torch.equal(k_cache[:, :, -1:], k) and torch.equal(v_cache[:, :, -1:], v)
    assert not k_cache[:, :, :-1].any()
    # The last sequence reads the whole cache, ending in 40 random keys; the first reads 8 slots.
    k_cache[-1, :, -40:-1], v_cache[-1, :, -40:-1] = torch.randn(2, heads, 39, dim).bfloat16()
    lens = torch.full((batch,), 8, dtype=torch.int32)
    lens[-1] = slots
    q = torch.randn(batch, heads, 1, dim).bfloat16()
    out = uniop.attention(q, k_cache, v_cache, lens)[0]
    for b, n in [(0, 8), (batch - 1, slots)]:
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b].float(), k_cache[b, :, :n].float(), v_cache[b, :, :n].float()
        )
        torch.testing.assert_close(out[b].float(), ref, rtol=2**-7, atol=1e-2)
