/* The C API end to end: runtime, descriptors (tensors, tensor lists, scalars, int arrays),
 * aclnn-style two-phase calls for rms_norm, swiglu and geglu, matmul (transposed operand), rope, attention,
 * kv_cache_append (in place), cat, add and permute, the kernel direct call, events, the profiler,
 * fork() with work in flight, and the bad-input contract. Every result is checked against a reference computed here in double precision. Exit status 0 means all checks passed.
 *
 *   gcc -std=c11 -Wall -Wextra -Werror -I include examples/c/two_phase.c -L target/release -luniop_capi -lm
 *   ./a.out [--bench] [--no-fork]
 *
 * --no-fork leaves out the fork test, for valgrind: a forked child loses the parent's other
 * threads, and with their stacks the only references to what they held, which memcheck reports
 * as leaked in the child.
 */
#define _POSIX_C_SOURCE 199309L
#include "check.h"

#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

/* Deterministic values in [-1, 1). */
static void fill(float *x, size_t n, unsigned seed) {
  unsigned s = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    x[i] = (float)((s >> 8) & 0xffff) / 32768.0f - 1.0f;
  }
}

static uniopTensor *tensor(const int64_t *dims, uint64_t rank, const int64_t *strides, float *data,
                           int64_t storage) {
  uniopTensor *t = uniopCreateTensor(dims, rank, UNIOP_FLOAT, strides, 0, UNIOP_FORMAT_ND, &storage, 1, data);
  if (!t) {
    fprintf(stderr, "uniopCreateTensor: %s\n", uniopGetRecentErrMsg());
    exit(1);
  }
  return t;
}

static int64_t numel(const int64_t *dims, int rank) {
  int64_t n = 1;
  for (int i = 0; i < rank; i++) n *= dims[i];
  return n;
}

/* A contiguous f32 tensor over `data`. */
static uniopTensor *dense(const int64_t *dims, uint64_t rank, float *data) {
  return tensor(dims, rank, NULL, data, numel(dims, (int)rank));
}

/* Phase 1 + workspace + phase 2 on `stream`, then synchronize. */
static void run(const char *op, uniopTensor **in, uint64_t n_in, const char *attrs, uniopTensor **out,
                uint64_t n_out, uniopStream stream) {
  uint64_t ws_size = 0;
  uniopExecutor *exec = NULL;
  OK(uniopOpGetWorkspaceSize(op, (const uniopTensor *const *)in, n_in, attrs, (const uniopTensor *const *)out,
                             n_out, &ws_size, &exec));
  void *ws = NULL;
  if (ws_size > 0) OK(uniopMalloc(&ws, ws_size, UNIOP_MEM_MALLOC_HUGE_FIRST));
  OK(uniopOpRun(ws, ws_size, exec, stream));
  OK(uniopSynchronizeStream(stream));
  if (ws) OK(uniopFree(ws));
}

/* Workspace + a typed phase 2 (e.g. uniopRmsNorm) on `stream`, then synchronize. */
typedef uniopStatus (*Phase2)(void *, uint64_t, uniopExecutor *, uniopStream);

static void launch(Phase2 phase2, uint64_t ws_size, uniopExecutor *exec, uniopStream stream) {
  void *ws = NULL;
  if (ws_size > 0) OK(uniopMalloc(&ws, ws_size, UNIOP_MEM_MALLOC_HUGE_FIRST));
  OK(phase2(ws, ws_size, exec, stream));
  OK(uniopSynchronizeStream(stream));
  if (ws) OK(uniopFree(ws));
}

static void expect_close(const char *what, const float *got, const double *want, size_t n, double tol) {
  double worst = 0;
  for (size_t i = 0; i < n; i++) {
    double err = fabs(got[i] - want[i]) / (1.0 + fabs(want[i]));
    if (err > worst) worst = err;
  }
  CHECK(worst <= tol, "%s: max relative error %.3g > %.3g", what, worst, tol);
  printf("%-28s max rel err %.2e  %s\n", what, worst, worst <= tol ? "PASS" : "FAIL");
}

static void test_rms_norm(uniopStream stream) {
  enum { R = 5, H = 96 };
  float x[R * H], w[H], y[R * H], rstd[R];
  fill(x, R * H, 1);
  fill(w, H, 2);
  int64_t xd[] = {R, H}, wd[] = {H}, rd[] = {R, 1};
  uniopTensor *in[] = {dense(xd, 2, x), dense(wd, 1, w)};
  uniopTensor *out[] = {dense(xd, 2, y), dense(rd, 2, rstd)};
  uint64_t ws = 0;
  uniopExecutor *exec = NULL;
  OK(uniopRmsNormGetWorkspaceSize(in[0], in[1], 1e-5, out[0], out[1], &ws, &exec));
  launch(uniopRmsNorm, ws, exec, stream);
  double want[R * H];
  for (int r = 0; r < R; r++) {
    double ss = 0;
    for (int j = 0; j < H; j++) ss += (double)x[r * H + j] * x[r * H + j];
    double inv = 1.0 / sqrt(ss / H + 1e-5);
    for (int j = 0; j < H; j++) want[r * H + j] = x[r * H + j] * inv * w[j];
  }
  expect_close("rms_norm", y, want, R * H, 1e-5);
  for (int i = 0; i < 2; i++) OK(uniopDestroyTensor(in[i]));
  for (int i = 0; i < 2; i++) OK(uniopDestroyTensor(out[i]));
}

/* swiglu gates the first half of x (silu); geglu, with aclnn's default, the second (gelu, its tanh form here). */
static void test_glus(uniopStream stream) {
  enum { R = 3, H = 40 };
  float x[R * 2 * H], swiglu[R * H], geglu[R * H];
  fill(x, R * 2 * H, 3);
  int64_t xd[] = {R, 2 * H}, yd[] = {R, H};
  uniopTensor *in = dense(xd, 2, x);
  uniopTensor *out[] = {dense(yd, 2, swiglu), dense(yd, 2, geglu)};
  uint64_t ws = 0;
  uniopExecutor *exec = NULL;
  OK(uniopSwigluGetWorkspaceSize(in, -1, out[0], &ws, &exec));
  launch(uniopSwiglu, ws, exec, stream);
  OK(uniopGegluGetWorkspaceSize(in, -1, "tanh", false, out[1], &ws, &exec));
  launch(uniopGeglu, ws, exec, stream);
  double want_swiglu[R * H], want_geglu[R * H];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < H; j++) {
      double a = x[r * 2 * H + j], b = x[r * 2 * H + H + j];
      want_swiglu[r * H + j] = a / (1.0 + exp(-a)) * b;
      want_geglu[r * H + j] = a * 0.5 * b * (1.0 + tanh(sqrt(2.0 / acos(-1.0)) * (b + 0.044715 * b * b * b)));
    }
  expect_close("swiglu", swiglu, want_swiglu, R * H, 1e-5);
  expect_close("geglu", geglu, want_geglu, R * H, 1e-5);
  OK(uniopDestroyTensor(in));
  for (int i = 0; i < 2; i++) OK(uniopDestroyTensor(out[i]));
}

/* a [M, K] times b given as its transpose bt [N, K] viewed with swapped strides. */
static void test_matmul(uniopStream stream) {
  enum { M = 7, K = 33, N = 12 };
  float a[M * K], bt[N * K], c[M * N];
  fill(a, M * K, 4);
  fill(bt, N * K, 5);
  int64_t ad[] = {M, K}, bd[] = {K, N}, bs[] = {1, K}, cd[] = {M, N};
  uniopTensor *in[] = {dense(ad, 2, a), tensor(bd, 2, bs, bt, N * K)};
  uniopTensor *out[] = {dense(cd, 2, c)};
  uint64_t ws = 0;
  uniopExecutor *exec = NULL;
  OK(uniopMatmulGetWorkspaceSize(in[0], in[1], out[0], &ws, &exec));
  launch(uniopMatmul, ws, exec, stream);
  double want[M * N];
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      double s = 0;
      for (int p = 0; p < K; p++) s += (double)a[i * K + p] * bt[j * K + p];
      want[i * N + j] = s;
    }
  expect_close("matmul (transposed b)", c, want, M * N, 1e-5);
  for (int i = 0; i < 2; i++) OK(uniopDestroyTensor(in[i]));
  OK(uniopDestroyTensor(out[0]));
}

/* A weight [N, K] packed once (pack_weight: f32 gives [ceil(N/32), K, 32, 1]) and two products
   against it (linear_packed, with a bias), then a packed shape that does not match out_features. */
static void test_packed_weight(uniopStream stream) {
  enum { M = 20, K = 9, N = 40, PANELS = (N + 31) / 32 };
  float x[M * K], w[N * K], b[N], packed[PANELS * K * 32], y[M * N];
  fill(x, M * K, 11);
  fill(w, N * K, 12);
  fill(b, N, 13);
  int64_t xd[] = {M, K}, wd[] = {N, K}, bd[] = {N}, pd[] = {PANELS, K, 32, 1}, yd[] = {M, N};
  uniopTensor *tw = dense(wd, 2, w), *tp = dense(pd, 4, packed);
  uint64_t ws = 0;
  uniopExecutor *exec = NULL;
  OK(uniopPackWeightGetWorkspaceSize(tw, NULL, tp, &ws, &exec));
  launch(uniopPackWeight, ws, exec, stream);
  uniopTensor *tx = dense(xd, 2, x), *tb = dense(bd, 1, b), *ty = dense(yd, 2, y);
  double want[M * N];
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      double s = b[j];
      for (int p = 0; p < K; p++) s += (double)x[i * K + p] * w[j * K + p];
      want[i * N + j] = s;
    }
  /* The packed weight serves any number of products: two here, each its own two phases. */
  for (int call = 0; call < 2; call++) {
    memset(y, 0, sizeof y);
    OK(uniopLinearPackedGetWorkspaceSize(tx, tp, N, tb, ty, &ws, &exec));
    launch(uniopLinearPacked, ws, exec, stream);
    expect_close(call ? "linear_packed (again)" : "linear_packed", y, want, M * N, 1e-5);
  }
  expect_error("linear_packed: out_features", uniopLinearPackedGetWorkspaceSize(tx, tp, N + 32, tb, ty, &ws, &exec),
               UNIOP_ERROR_SHAPE, "argument 'packed_weight': expected shape [3, 9, 32, 1]");
  uniopTensor *all[] = {tw, tp, tx, tb, ty};
  for (int i = 0; i < 5; i++) OK(uniopDestroyTensor(all[i]));
}

/* HF's rotate-half RoPE on x [1, H, S, D] with cos/sin [S, D]. */
static void test_rope(uniopStream stream) {
  enum { H = 2, S = 5, D = 8 };
  float x[H * S * D], cs[S * D], sn[S * D], y[H * S * D];
  fill(x, H * S * D, 6);
  for (int s = 0; s < S; s++)
    for (int j = 0; j < D; j++) {
      double angle = s * pow(10000.0, -2.0 * (j % (D / 2)) / D);
      cs[s * D + j] = (float)cos(angle);
      sn[s * D + j] = (float)sin(angle);
    }
  int64_t xd[] = {1, H, S, D}, td[] = {S, D};
  uniopTensor *in[] = {dense(xd, 4, x), dense(td, 2, cs), dense(td, 2, sn)};
  uniopTensor *out[] = {dense(xd, 4, y)};
  uint64_t ws = 0;
  uniopExecutor *exec = NULL;
  OK(uniopRopeGetWorkspaceSize(in[0], in[1], in[2], "half", false, out[0], &ws, &exec));
  launch(uniopRope, ws, exec, stream);
  double want[H * S * D];
  for (int h = 0; h < H; h++)
    for (int s = 0; s < S; s++)
      for (int j = 0; j < D; j++) {
        const float *row = x + (h * S + s) * D;
        double rot = j < D / 2 ? -row[j + D / 2] : row[j - D / 2];
        want[(h * S + s) * D + j] = row[j] * cs[s * D + j] + rot * sn[s * D + j];
      }
  expect_close("rope (half)", y, want, H * S * D, 1e-5);
  /* The same rotation from tables of one value per pair (the first half of each row above:
   * flash-attn's and GPT-OSS's form), [S, D/2] with per_pair. */
  float pair_cs[S * D / 2], pair_sn[S * D / 2];
  for (int s = 0; s < S; s++)
    for (int j = 0; j < D / 2; j++) {
      pair_cs[s * D / 2 + j] = cs[s * D + j];
      pair_sn[s * D / 2 + j] = sn[s * D + j];
    }
  int64_t pd[] = {S, D / 2};
  uniopTensor *pairs[] = {dense(pd, 2, pair_cs), dense(pd, 2, pair_sn)};
  memset(y, 0, sizeof y);
  OK(uniopRopeGetWorkspaceSize(in[0], pairs[0], pairs[1], "half", true, out[0], &ws, &exec));
  launch(uniopRope, ws, exec, stream);
  expect_close("rope (half, per-pair tables)", y, want, H * S * D, 1e-5);
  for (int i = 0; i < 3; i++) OK(uniopDestroyTensor(in[i]));
  for (int i = 0; i < 2; i++) OK(uniopDestroyTensor(pairs[i]));
  OK(uniopDestroyTensor(out[0]));
}

/* Causal attention of [1, H, S, D] q, k, v in double into `want`, the scaled scores soft-capped to
 * softcap * tanh(score / softcap) when `softcap` > 0, then `bias` (S x S, or NULL for none) added:
 * where it is -INFINITY, query i does not see key j either (every query keeps at least one key).
 * `sinks` (H, or NULL for none) add one logit per head to each softmax, of a key with value 0. */
static void attention_reference(const float *q, const float *k, const float *v, int H, int S, int D,
                                const float *bias, double softcap, const float *sinks, double *want) {
  double scale = 1.0 / sqrt((double)D);
  for (int h = 0; h < H; h++)
    for (int i = 0; i < S; i++) {
      double p[S], m = sinks ? sinks[h] : -INFINITY, sum = 0;
      for (int j = 0; j <= i; j++) {
        double s = 0;
        for (int d = 0; d < D; d++) s += (double)q[(h * S + i) * D + d] * k[(h * S + j) * D + d];
        s *= scale;
        p[j] = (softcap > 0 ? softcap * tanh(s / softcap) : s) + (bias ? bias[i * S + j] : 0.0);
        if (p[j] > m) m = p[j];
      }
      for (int j = 0; j <= i; j++) sum += (p[j] = exp(p[j] - m));
      if (sinks) sum += exp(sinks[h] - m);
      for (int d = 0; d < D; d++) {
        double acc = 0;
        for (int j = 0; j <= i; j++) acc += p[j] / sum * v[(h * S + j) * D + d];
        want[(h * S + i) * D + d] = acc;
      }
    }
}

/* The gradient of a float [S, S] mask broadcast over H heads (causal): the score gradient
 * P * (dout . v - delta) of every head, summed, in double precision. */
static void dmask_reference(const float *q, const float *k, const float *v, const float *dout, int H, int S,
                            int D, const float *bias, double *want) {
  double scale = 1.0 / sqrt((double)D);
  for (int x = 0; x < S * S; x++) want[x] = 0.0;
  for (int h = 0; h < H; h++)
    for (int i = 0; i < S; i++) {
      double p[S], dp[S], m = -INFINITY, sum = 0, delta = 0;
      for (int j = 0; j <= i; j++) {
        double s = 0;
        for (int d = 0; d < D; d++) s += (double)q[(h * S + i) * D + d] * k[(h * S + j) * D + d];
        p[j] = s * scale + bias[i * S + j];
        if (p[j] > m) m = p[j];
      }
      for (int j = 0; j <= i; j++) sum += (p[j] = exp(p[j] - m));
      for (int j = 0; j <= i; j++) {
        p[j] /= sum;
        dp[j] = 0;
        for (int d = 0; d < D; d++) dp[j] += (double)dout[(h * S + i) * D + d] * v[(h * S + j) * D + d];
        delta += p[j] * dp[j];
      }
      for (int j = 0; j <= i; j++) want[i * S + j] += p[j] * (dp[j] - delta);
    }
}

/* Causal attention [1, H, S, D], with a boolean and a float mask broadcast over the heads too, soft-capped
 * under the boolean one (and the float mask's gradient from attention_backward); then decode: append one token with kv_cache_append (in place) and attend with kv_lens. */
static void test_attention_and_kv_cache(uniopStream stream) {
  enum { H = 2, S = 6, D = 8, SMAX = 8 };
  float q[H * S * D], k[H * S * D], v[H * S * D], o[H * S * D], lse[H * S];
  fill(q, H * S * D, 7);
  fill(k, H * S * D, 8);
  fill(v, H * S * D, 9);
  int64_t qd[] = {1, H, S, D}, ld[] = {1, H, S};
  uniopTensor *in[] = {dense(qd, 4, q), dense(qd, 4, k), dense(qd, 4, v)};
  uniopTensor *out[] = {dense(qd, 4, o), dense(ld, 3, lse)};
  uint64_t ws = 0;
  uniopExecutor *exec = NULL;
  OK(uniopAttentionGetWorkspaceSize(in[0], in[1], in[2], NULL, true, NULL, NULL, NULL, NULL, out[0], out[1], &ws,
                                    &exec));
  launch(uniopAttention, ws, exec, stream);
  double want[H * S * D];
  attention_reference(q, k, v, H, S, D, NULL, 0.0, NULL, want);
  expect_close("attention (causal)", o, want, H * S * D, 1e-5);

  /* Keys 0 and 1 hidden from queries 2 and later (as a padded prefix would be), [1, 1, S, S]: as a
   * boolean mask, then as a float one that also adds an ALiBi-like -(i - j) / 4 to what it keeps. */
  bool keep[S * S];
  float hidden[S * S], alibi[S * S];
  for (int i = 0; i < S; i++)
    for (int j = 0; j < S; j++) {
      keep[i * S + j] = !(i >= 2 && j < 2);
      hidden[i * S + j] = keep[i * S + j] ? 0.0f : -INFINITY;
      alibi[i * S + j] = keep[i * S + j] ? -0.25f * (float)(i - j) : -INFINITY;
    }
  int64_t md[] = {1, 1, S, S}, m_storage = S * S;
  uniopTensor *masks[] = {
      uniopCreateTensor(md, 4, UNIOP_BOOL, NULL, 0, UNIOP_FORMAT_ND, &m_storage, 1, keep),
      uniopCreateTensor(md, 4, UNIOP_FLOAT, NULL, 0, UNIOP_FORMAT_ND, &m_storage, 1, alibi),
  };
  const float *biases[] = {hidden, alibi};
  const char *names[] = {"attention (causal, boolean mask)", "attention (causal, float mask)"};
  /* Gemma 2's soft-capping (a cap of 0.5 bends these scores, of magnitude up to ~1) under the boolean
   * mask, with GPT-OSS's attention sinks (one logit per head); first, as the float mask's run below
   * leaves o and lse for the backward. */
  const double softcap = 0.5;
  float sinks[H] = {-0.5f, 1.0f};
  int64_t sd[] = {H};
  uniopTensor *sinks_t = dense(sd, 1, sinks);
  CHECK(masks[0], "mask descriptor: %s", uniopGetRecentErrMsg());
  OK(uniopAttentionGetWorkspaceSize(in[0], in[1], in[2], NULL, true, NULL, masks[0], &softcap, sinks_t, out[0],
                                    out[1], &ws, &exec));
  launch(uniopAttention, ws, exec, stream);
  double want_capped[H * S * D];
  attention_reference(q, k, v, H, S, D, hidden, softcap, sinks, want_capped);
  expect_close("attention (causal, boolean mask, softcap, sinks)", o, want_capped, H * S * D, 1e-5);
  OK(uniopDestroyTensor(sinks_t));
  for (int m = 0; m < 2; m++) {
    CHECK(masks[m], "mask descriptor: %s", uniopGetRecentErrMsg());
    OK(uniopAttentionGetWorkspaceSize(in[0], in[1], in[2], NULL, true, NULL, masks[m], NULL, NULL, out[0], out[1],
                                      &ws, &exec));
    launch(uniopAttention, ws, exec, stream);
    double want_masked[H * S * D];
    attention_reference(q, k, v, H, S, D, biases[m], 0.0, NULL, want_masked);
    expect_close(names[m], o, want_masked, H * S * D, 1e-5);
    OK(uniopDestroyTensor(masks[m]));
  }

  /* o and lse are the float mask's forward: its gradient (needs_dmask), beside dq, dk and dv; no sinks,
   * so their gradient is an empty tensor. */
  float dout[H * S * D], dq[H * S * D], dk[H * S * D], dv[H * S * D], dmask[S * S], no_dsinks[1];
  fill(dout, H * S * D, 10);
  uniopTensor *bias_t = uniopCreateTensor(md, 4, UNIOP_FLOAT, NULL, 0, UNIOP_FORMAT_ND, &m_storage, 1, alibi);
  int64_t empty[] = {0};
  uniopTensor *grads[] = {dense(qd, 4, dout), dense(qd, 4, dq), dense(qd, 4, dk),
                          dense(qd, 4, dv),   dense(md, 4, dmask), dense(empty, 1, no_dsinks)};
  CHECK(bias_t, "mask descriptor: %s", uniopGetRecentErrMsg());
  OK(uniopAttentionBackwardGetWorkspaceSize(grads[0], in[0], in[1], in[2], out[0], out[1], NULL, true, NULL, bias_t,
                                            true, NULL, NULL, 0, grads[1], grads[2], grads[3], grads[4], grads[5],
                                            &ws, &exec));
  launch(uniopAttentionBackward, ws, exec, stream);
  double want_dmask[S * S];
  dmask_reference(q, k, v, dout, H, S, D, alibi, want_dmask);
  expect_close("attention_backward dmask", dmask, want_dmask, S * S, 1e-5);
  OK(uniopDestroyTensor(bias_t));
  for (int g = 0; g < 6; g++) OK(uniopDestroyTensor(grads[g]));

  /* Caches hold tokens 0..S-2; append token S-1 at position S-1, in place. */
  float kc[H * SMAX * D], vc[H * SMAX * D];
  memset(kc, 0, sizeof kc);
  memset(vc, 0, sizeof vc);
  for (int h = 0; h < H; h++)
    for (int s = 0; s < S - 1; s++) {
      memcpy(kc + (h * SMAX + s) * D, k + (h * S + s) * D, D * sizeof(float));
      memcpy(vc + (h * SMAX + s) * D, v + (h * S + s) * D, D * sizeof(float));
    }
  int64_t cd[] = {1, H, SMAX, D}, nd[] = {1, H, 1, D}, ns[] = {H * S * D, S * D, D, 1};
  int64_t pos[] = {S - 1}, pd[] = {1}, one = 1;
  uniopTensor *pos_t = uniopCreateTensor(pd, 1, UNIOP_INT64, NULL, 0, UNIOP_FORMAT_ND, &one, 1, pos);
  /* The new token's k/v are row S-1 of k/v: views with an offset into the same storage. */
  int64_t storage = H * S * D;
  uniopTensor *k_new = uniopCreateTensor(nd, 4, UNIOP_FLOAT, ns, (S - 1) * D, UNIOP_FORMAT_ND, &storage, 1, k);
  uniopTensor *v_new = uniopCreateTensor(nd, 4, UNIOP_FLOAT, ns, (S - 1) * D, UNIOP_FORMAT_ND, &storage, 1, v);
  CHECK(pos_t && k_new && v_new, "descriptors: %s", uniopGetRecentErrMsg());
  uniopTensor *caches[] = {dense(cd, 4, kc), dense(cd, 4, vc)};
  OK(uniopKvCacheAppendGetWorkspaceSize(caches[0], caches[1], k_new, v_new, pos_t, &ws, &exec));
  launch(uniopKvCacheAppend, ws, exec, stream);

  float q_last[H * D], o_last[H * D], lse_last[H];
  for (int h = 0; h < H; h++) memcpy(q_last + h * D, q + (h * S + S - 1) * D, D * sizeof(float));
  int64_t lens[] = {S}, qld[] = {1, H, 1, D}, lld[] = {1, H, 1};
  uniopTensor *lens_t = uniopCreateTensor(pd, 1, UNIOP_INT64, NULL, 0, UNIOP_FORMAT_ND, &one, 1, lens);
  uniopTensor *dec_in[] = {dense(qld, 4, q_last), caches[0], caches[1], lens_t};
  uniopTensor *dec_out[] = {dense(qld, 4, o_last), dense(lld, 3, lse_last)};
  /* The same op through the generic by-name pair, attributes as text. */
  run("attention", dec_in, 4, "causal=True", dec_out, 2, stream);
  double want_last[H * D];
  for (int h = 0; h < H; h++)
    for (int d = 0; d < D; d++) want_last[h * D + d] = want[(h * S + S - 1) * D + d];
  expect_close("kv_cache_append + decode", o_last, want_last, H * D, 1e-5);

  uniopTensor *all[] = {in[0], in[1], in[2], out[0], out[1], pos_t, k_new, v_new, caches[0], caches[1],
                        lens_t, dec_in[0], dec_out[0], dec_out[1]};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) OK(uniopDestroyTensor(all[i]));
}

/* Kernel direct call: each block fills its share of an array. */
typedef struct {
  int *data;
  int n;
} FillArgs;

static void fill_kernel(uint32_t block_idx, uint32_t block_num, void *p) {
  FillArgs *a = (FillArgs *)p;
  int per = (a->n + (int)block_num - 1) / (int)block_num;
  for (int i = (int)block_idx * per; i < a->n && i < ((int)block_idx + 1) * per; i++) a->data[i] = i * 3;
}

static void test_direct_call_and_events(uniopStream stream) {
  int data[1000];
  FillArgs args = {data, 1000};
  uniopEvent start, end;
  OK(uniopCreateEvent(&start));
  OK(uniopCreateEvent(&end));
  OK(uniopRecordEvent(start, stream));
  OK(uniopLaunchKernel(fill_kernel, 8, &args, stream));
  OK(uniopRecordEvent(end, stream));
  OK(uniopSynchronizeEvent(end));
  int done = 0;
  OK(uniopQueryEvent(end, &done));
  float ms = -1;
  OK(uniopEventElapsedTime(&ms, start, end));
  int good = done == 1 && ms >= 0;
  for (int i = 0; i < 1000; i++) good &= data[i] == i * 3;
  CHECK(good, "direct call: done %d, elapsed %.3f ms", done, ms);
  printf("%-28s %s (%.3f ms between events)\n", "kernel direct call", good ? "PASS" : "FAIL", ms);
  OK(uniopDestroyEvent(start));
  OK(uniopDestroyEvent(end));
}

static void sleep_kernel(uint32_t block_idx, uint32_t block_num, void *args) {
  (void)block_idx, (void)block_num, (void)args;
  struct timespec t = {0, 200 * 1000 * 1000};
  nanosleep(&t, NULL);
}

/* fork() while `stream` still runs a kernel, as a DataLoader or multiprocessing does to a process:
 * the child runs its own work on the default stream and on `stream`, whose first synchronize
 * reports the work the child lost; waiting for an event recorded behind that work is an error, not
 * a hang. The parent's work is untouched. */
static void test_fork(uniopStream stream) {
  uniopEvent behind;
  OK(uniopCreateEvent(&behind));
  OK(uniopLaunchKernel(sleep_kernel, 1, NULL, stream));
  OK(uniopRecordEvent(behind, stream));
  fflush(stdout); /* or the child would print the parent's buffered lines again */
  pid_t pid = fork();
  CHECK(pid >= 0, "fork failed");
  if (pid == 0) {
    test_rms_norm(NULL);
    expect_error("fork: child's lost work", uniopSynchronizeStream(stream), UNIOP_ERROR_RUNTIME,
                 "2 tasks enqueued before this process forked");
    test_rms_norm(stream);
    expect_error("fork: pre-fork event", uniopSynchronizeEvent(behind), UNIOP_ERROR_RUNTIME,
                 "enqueued before this process forked");
    fflush(stdout);
    _exit(failures == 0 ? 0 : 1);
  }
  int status = 0;
  for (int waited_ms = 0; pid > 0 && waitpid(pid, &status, WNOHANG) == 0; waited_ms += 10) {
    if (waited_ms > 120000) { /* generous: the child may run under valgrind */
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      CHECK(0, "fork: the child hung");
      break;
    }
    struct timespec t = {0, 10 * 1000 * 1000};
    nanosleep(&t, NULL);
  }
  int good = pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  CHECK(good, "fork: the child failed (wait status %d)", status);
  OK(uniopSynchronizeEvent(behind));
  printf("%-28s %s\n", "fork with work in flight", good ? "PASS" : "FAIL");
  OK(uniopDestroyEvent(behind));
}

/* Every allocator counter by number: the six of uniopMemStats agree with it, and a refused
 * allocation moves the retry and out-of-memory counters by one each (the OS refuses, the cache is
 * returned, the OS refuses again). */
static void test_mem_stat_counters(void) {
  uint64_t c[UNIOP_MEM_STAT_OOMS + 1];
  for (int k = 0; k <= UNIOP_MEM_STAT_OOMS; k++) OK(uniopGetMemStat(k, &c[k]));
  uniopMemStats st;
  OK(uniopGetMemStats(&st));
  int good = c[UNIOP_MEM_STAT_ALLOCATED] == st.allocated && c[UNIOP_MEM_STAT_RESERVED] == st.reserved &&
             c[UNIOP_MEM_STAT_PEAK_ALLOCATED] == st.peakAllocated && c[UNIOP_MEM_STAT_ALLOC_COUNT] == st.allocCount &&
             c[UNIOP_MEM_STAT_FREE_COUNT] == st.freeCount && c[UNIOP_MEM_STAT_LIVE_BUFFERS] == st.liveBuffers &&
             c[UNIOP_MEM_STAT_REQUESTED] <= c[UNIOP_MEM_STAT_ALLOCATED] &&
             c[UNIOP_MEM_STAT_CACHE_HITS] + c[UNIOP_MEM_STAT_OS_ALLOCS] <= c[UNIOP_MEM_STAT_ALLOC_COUNT];
  void *huge = NULL;
  expect_error("malloc 1 PiB", uniopMalloc(&huge, (size_t)1 << 50, UNIOP_MEM_MALLOC_NORMAL_ONLY), UNIOP_ERROR_RUNTIME,
               "out of memory");
  uint64_t retries = 0, ooms = 0;
  OK(uniopGetMemStat(UNIOP_MEM_STAT_ALLOC_RETRIES, &retries));
  OK(uniopGetMemStat(UNIOP_MEM_STAT_OOMS, &ooms));
  good &= retries == c[UNIOP_MEM_STAT_ALLOC_RETRIES] + 1 && ooms == c[UNIOP_MEM_STAT_OOMS] + 1;
  CHECK(good, "mem stat counters: retries %llu -> %llu, ooms %llu -> %llu",
        (unsigned long long)c[UNIOP_MEM_STAT_ALLOC_RETRIES], (unsigned long long)retries,
        (unsigned long long)c[UNIOP_MEM_STAT_OOMS], (unsigned long long)ooms);
  printf("%-28s %s\n", "mem stat counters", good ? "PASS" : "FAIL");
}

/* A descriptor call that must fail: NULL and a message naming the argument. */
static void expect_no_handle(const char *what, const void *handle, const char *fragment) {
  const char *msg = uniopGetRecentErrMsg();
  int good = handle == NULL && strstr(msg, fragment) != NULL;
  CHECK(good, "%s: got %p (%s), want NULL with \"%s\"", what, handle, msg, fragment);
  printf("%-28s NULL  %s\n", what, good ? "PASS" : "FAIL");
}

/* cat through a tensor list (aclnn's aclTensorList): a KV block joined along the sequence dim, the
 * list owning its tensors; then the list's own bad inputs. */
static void test_cat_tensor_list(uniopStream stream) {
  enum { H = 2, S0 = 3, S1 = 1, D = 4 };
  float past[H * S0 * D], step[H * S1 * D], joined[H * (S0 + S1) * D];
  fill(past, H * S0 * D, 40);
  fill(step, H * S1 * D, 41);
  int64_t pd[] = {H, S0, D}, sd[] = {H, S1, D}, jd[] = {H, S0 + S1, D};
  const uniopTensor *items[] = {dense(pd, 3, past), dense(sd, 3, step)};
  uniopTensorList *list = uniopCreateTensorList(items, 2);
  CHECK(list != NULL, "uniopCreateTensorList: %s", uniopGetRecentErrMsg());
  uniopTensor *out = dense(jd, 3, joined);
  uint64_t ws = 0;
  uniopExecutor *exec = NULL;
  OK(uniopCatGetWorkspaceSize(list, -2, out, &ws, &exec));
  launch(uniopCat, ws, exec, stream);
  double want[H * (S0 + S1) * D];
  for (int h = 0; h < H; h++)
    for (int s = 0; s < S0 + S1; s++)
      for (int d = 0; d < D; d++)
        want[(h * (S0 + S1) + s) * D + d] = s < S0 ? past[(h * S0 + s) * D + d] : step[(h * S1 + s - S0) * D + d];
  expect_close("cat (tensor list)", joined, want, H * (S0 + S1) * D, 0);

  /* cat's gradient into a list of outputs: the joined tensor as dout, split back into its parts. */
  float dpast[H * S0 * D], dstep[H * S1 * D];
  const uniopTensor *grad_items[] = {dense(pd, 3, dpast), dense(sd, 3, dstep)};
  uniopTensorList *grads = uniopCreateTensorList(grad_items, 2);
  CHECK(grads != NULL, "uniopCreateTensorList: %s", uniopGetRecentErrMsg());
  OK(uniopCatBackwardGetWorkspaceSize(out, list, -2, grads, &ws, &exec));
  launch(uniopCatBackward, ws, exec, stream);
  double want_past[H * S0 * D], want_step[H * S1 * D];
  for (int i = 0; i < H * S0 * D; i++) want_past[i] = past[i];
  for (int i = 0; i < H * S1 * D; i++) want_step[i] = step[i];
  expect_close("cat_backward (list out) 0", dpast, want_past, H * S0 * D, 0);
  expect_close("cat_backward (list out) 1", dstep, want_step, H * S1 * D, 0);
  expect_error("cat_backward: NULL outputs", uniopCatBackwardGetWorkspaceSize(out, list, -2, NULL, &ws, &exec),
               UNIOP_ERROR_PARAM_NULLPTR, "'dtensors'");
  expect_error("cat_backward: dout unlike the join",
               uniopCatBackwardGetWorkspaceSize(grad_items[0], list, -2, grads, &ws, &exec), UNIOP_ERROR_SHAPE, "'dout'");
  OK(uniopDestroyTensorList(grads));

  expect_error("cat: NULL list", uniopCatGetWorkspaceSize(NULL, 0, out, &ws, &exec), UNIOP_ERROR_PARAM_NULLPTR,
               "'tensors'");
  expect_error("cat: dim out of range", uniopCatGetWorkspaceSize(list, 3, out, &ws, &exec),
               UNIOP_ERROR_PARAM_INVALID, "'dim'");
  expect_no_handle("tensor list: NULL items", uniopCreateTensorList(NULL, 2), "'value'");
  const uniopTensor *foreign[] = {items[0], (const uniopTensor *)past};
  expect_no_handle("tensor list: foreign item", uniopCreateTensorList(foreign, 2), "'value[1]'");
  OK(uniopDestroyTensorList(list)); /* destroys both tensors */
  expect_error("tensor list: destroyed", uniopDestroyTensorList(list), UNIOP_ERROR_PARAM_INVALID, "'list'");
  expect_error("tensor list: items gone", uniopDestroyTensor(items[0]), UNIOP_ERROR_PARAM_INVALID, "'tensor'");
  OK(uniopDestroyTensor(out));
}

/* Attribute descriptors: add with a uniopScalar alpha (an int64 beyond double's 53 bits stays
 * exact; a float alpha on float tensors) and permute with a uniopIntArray; then their bad inputs. */
static void test_scalar_and_int_array(uniopStream stream) {
  int64_t one = 1, zero = 0, sum = 0, big = (1LL << 53) + 1;
  int64_t n1[] = {1};
  uniopTensor *ta = uniopCreateTensor(n1, 1, UNIOP_INT64, NULL, 0, UNIOP_FORMAT_ND, n1, 1, &zero);
  uniopTensor *tb = uniopCreateTensor(n1, 1, UNIOP_INT64, NULL, 0, UNIOP_FORMAT_ND, n1, 1, &one);
  uniopTensor *ts = uniopCreateTensor(n1, 1, UNIOP_INT64, NULL, 0, UNIOP_FORMAT_ND, n1, 1, &sum);
  uniopScalar *alpha = uniopCreateScalar(&big, UNIOP_INT64);
  uint64_t ws = 0;
  uniopExecutor *exec = NULL;
  OK(uniopAddGetWorkspaceSize(ta, tb, alpha, ts, &ws, &exec));
  launch(uniopAdd, ws, exec, stream);
  CHECK(sum == big, "add with an int64 alpha: %lld, want %lld", (long long)sum, (long long)big);
  printf("%-28s %s\n", "add (int64 uniopScalar)", sum == big ? "PASS" : "FAIL");

  float x[6], y[6], out[6];
  fill(x, 6, 50);
  fill(y, 6, 51);
  int64_t d6[] = {6};
  uniopTensor *tx = dense(d6, 1, x), *ty = dense(d6, 1, y), *to = dense(d6, 1, out);
  float half_ = 0.5f;
  uniopScalar *half_alpha = uniopCreateScalar(&half_, UNIOP_FLOAT);
  OK(uniopAddGetWorkspaceSize(tx, ty, half_alpha, to, &ws, &exec));
  launch(uniopAdd, ws, exec, stream);
  double want[6];
  for (int i = 0; i < 6; i++) want[i] = (double)x[i] + 0.5 * y[i];
  expect_close("add (float uniopScalar)", out, want, 6, 1e-6);
  expect_error("add: alpha 0.5 on int64", uniopAddGetWorkspaceSize(ta, tb, half_alpha, ts, &ws, &exec),
               UNIOP_ERROR_PARAM_INVALID, "'alpha'");
  expect_error("add: NULL alpha", uniopAddGetWorkspaceSize(tx, ty, NULL, to, &ws, &exec), UNIOP_ERROR_PARAM_NULLPTR,
               "'alpha'");

  /* [2, 3, 4] -> [4, 2, 3] */
  float p[24], q[24];
  fill(p, 24, 52);
  int64_t pd[] = {2, 3, 4}, qd[] = {4, 2, 3}, order[] = {-1, 0, 1};
  uniopTensor *tp = dense(pd, 3, p), *tq = dense(qd, 3, q);
  uniopIntArray *dims = uniopCreateIntArray(order, 3);
  OK(uniopPermuteGetWorkspaceSize(tp, dims, 0, tq, &ws, &exec));
  launch(uniopPermute, ws, exec, stream);
  double wantq[24];
  for (int k = 0; k < 4; k++)
    for (int i = 0; i < 2; i++)
      for (int j = 0; j < 3; j++) wantq[(k * 2 + i) * 3 + j] = p[(i * 3 + j) * 4 + k];
  expect_close("permute (uniopIntArray)", q, wantq, 24, 0);
  /* batch_dims 1: the first dim stays, the last two swap ([2, 3, 4] -> [2, 4, 3]) */
  float r[24];
  int64_t rd[] = {2, 4, 3}, swap[] = {-1, 0};
  uniopTensor *tr = dense(rd, 3, r);
  uniopIntArray *swap_dims = uniopCreateIntArray(swap, 2);
  OK(uniopPermuteGetWorkspaceSize(tp, swap_dims, 1, tr, &ws, &exec));
  launch(uniopPermute, ws, exec, stream);
  for (int b = 0; b < 2; b++)
    for (int k = 0; k < 4; k++)
      for (int j = 0; j < 3; j++) wantq[(b * 4 + k) * 3 + j] = p[(b * 3 + j) * 4 + k];
  expect_close("permute (batch_dims 1)", r, wantq, 24, 0);
  expect_error("permute: batch_dims past the rank", uniopPermuteGetWorkspaceSize(tp, swap_dims, 4, tr, &ws, &exec),
               UNIOP_ERROR_PARAM_INVALID, "'batch_dims'");
  expect_error("permute: dims of all 3 dims with batch_dims 1",
               uniopPermuteGetWorkspaceSize(tp, dims, 1, tr, &ws, &exec), UNIOP_ERROR_PARAM_INVALID,
               "after its 1 batch dims");
  OK(uniopDestroyIntArray(swap_dims));
  OK(uniopDestroyTensor(tr));
  int64_t repeated[] = {0, 0, 1};
  uniopIntArray *bad_dims = uniopCreateIntArray(repeated, 3);
  expect_error("permute: dims repeat", uniopPermuteGetWorkspaceSize(tp, bad_dims, 0, tq, &ws, &exec),
               UNIOP_ERROR_PARAM_INVALID, "permutation");

  expect_no_handle("scalar: NULL value", uniopCreateScalar(NULL, UNIOP_FLOAT), "'value'");
  expect_no_handle("scalar: bad dtype", uniopCreateScalar(&half_, 42), "got 42");
  expect_no_handle("int array: NULL values", uniopCreateIntArray(NULL, 2), "'value'");
  OK(uniopDestroyIntArray(bad_dims));
  expect_error("int array: destroyed", uniopPermuteGetWorkspaceSize(tp, bad_dims, 0, tq, &ws, &exec),
               UNIOP_ERROR_PARAM_INVALID, "'dims'");
  expect_error("scalar: wrong handle type", uniopDestroyScalar((const uniopScalar *)dims), UNIOP_ERROR_PARAM_INVALID,
               "'scalar'");
  OK(uniopDestroyIntArray(dims));
  OK(uniopDestroyScalar(alpha));
  OK(uniopDestroyScalar(half_alpha));
  uniopTensor *all[] = {ta, tb, ts, tx, ty, to, tp, tq};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) OK(uniopDestroyTensor(all[i]));
}

static void test_bad_inputs(uniopStream stream) {
  float x[8], w[4], y[8], rstd[2];
  int32_t xi[8];
  int64_t xd[] = {2, 4}, wd[] = {4}, w3[] = {3}, rd[] = {2, 1}, eight = 8;
  uniopTensor *tx = dense(xd, 2, x), *tw = dense(wd, 1, w), *tw3 = dense(w3, 1, w), *ty = dense(xd, 2, y),
              *tr = dense(rd, 2, rstd);
  uniopTensor *ti = uniopCreateTensor(xd, 2, UNIOP_INT32, NULL, 0, UNIOP_FORMAT_ND, &eight, 1, xi);
  uniopTensor *outs[] = {ty, tr};
  uint64_t ws = 0;
  uniopExecutor *ex = NULL;

  uniopTensor *null_x[] = {NULL, tw};
  expect_error("null required tensor", uniopOpGetWorkspaceSize("rms_norm", (const uniopTensor *const *)null_x, 2, NULL,
                                                             (const uniopTensor *const *)outs, 2, &ws, &ex),
               UNIOP_ERROR_PARAM_NULLPTR, "'x'");
  uniopTensor *ok_in[] = {tx, tw};
  expect_error("null workspaceSize", uniopOpGetWorkspaceSize("rms_norm", (const uniopTensor *const *)ok_in, 2, NULL,
                                                           (const uniopTensor *const *)outs, 2, NULL, &ex),
               UNIOP_ERROR_PARAM_NULLPTR, "workspaceSize");
  uniopTensor *int_in[] = {ti, tw};
  expect_error("wrong dtype", uniopOpGetWorkspaceSize("rms_norm", (const uniopTensor *const *)int_in, 2, NULL,
                                                    (const uniopTensor *const *)outs, 2, &ws, &ex),
               UNIOP_ERROR_DTYPE, "int32");
  uniopTensor *bad_w[] = {tx, tw3};
  expect_error("shape mismatch", uniopOpGetWorkspaceSize("rms_norm", (const uniopTensor *const *)bad_w, 2, NULL,
                                                       (const uniopTensor *const *)outs, 2, &ws, &ex),
               UNIOP_ERROR_SHAPE, "'weight'");
  expect_error("unknown op", uniopOpGetWorkspaceSize("rms_nrom", (const uniopTensor *const *)ok_in, 2, NULL,
                                                   (const uniopTensor *const *)outs, 2, &ws, &ex),
               UNIOP_ERROR_PARAM_INVALID, "rms_nrom");
  expect_error("unknown attribute", uniopOpGetWorkspaceSize("rms_norm", (const uniopTensor *const *)ok_in, 2, "epz=1",
                                                          (const uniopTensor *const *)outs, 2, &ws, &ex),
               UNIOP_ERROR_PARAM_INVALID, "epz");
  /* An output must own its memory: not the input's (aclnn's out-of-place calls), and no element shared. */
  int64_t rows_shared[] = {0, 1};
  uniopTensor *y_over_x = dense(xd, 2, x), *y_broadcast = tensor(xd, 2, rows_shared, y, 4);
  uniopTensor *over_x[] = {y_over_x, tr}, *broadcast_out[] = {y_broadcast, tr};
  expect_error("output over an input", uniopOpGetWorkspaceSize("rms_norm", (const uniopTensor *const *)ok_in, 2, NULL,
                                                             (const uniopTensor *const *)over_x, 2, &ws, &ex),
               UNIOP_ERROR_PARAM_INVALID, "argument 'y': expected memory of its own, got memory shared with 'x'");
  expect_error("broadcast output", uniopOpGetWorkspaceSize("rms_norm", (const uniopTensor *const *)ok_in, 2, NULL,
                                                         (const uniopTensor *const *)broadcast_out, 2, &ws, &ex),
               UNIOP_ERROR_PARAM_INVALID, "no two elements share memory");
  OK(uniopDestroyTensor(y_over_x));
  OK(uniopDestroyTensor(y_broadcast));

  int64_t neg[] = {4, -1};
  expect_no_handle("negative stride", uniopCreateTensor(xd, 2, UNIOP_FLOAT, neg, 0, UNIOP_FORMAT_ND, &eight, 1, x),
                   "'stride'");
  expect_no_handle("offset beyond storage", uniopCreateTensor(xd, 2, UNIOP_FLOAT, NULL, 1, UNIOP_FORMAT_ND, &eight, 1, x),
                   "storage of at least 9 elements");
  expect_no_handle("unknown dtype code", uniopCreateTensor(xd, 2, 99, NULL, 0, UNIOP_FORMAT_ND, &eight, 1, x), "got 99");
  expect_no_handle("null dims", uniopCreateTensor(NULL, 2, UNIOP_FLOAT, NULL, 0, UNIOP_FORMAT_ND, &eight, 1, x),
                   "'viewDims'");

  /* attention plans a workspace; hand it too little. */
  float q[2 * 300 * 8];
  float ao[2 * 300 * 8], al[2 * 300];
  int64_t qd[] = {1, 2, 300, 8}, ld[] = {1, 2, 300};
  uniopTensor *tq = dense(qd, 4, q), *to = dense(qd, 4, ao), *tl = dense(ld, 3, al);
  uniopTensor *a_in[] = {tq, tq, tq, NULL}, *a_out[] = {to, tl};
  OK(uniopOpGetWorkspaceSize("attention", (const uniopTensor *const *)a_in, 4, NULL, (const uniopTensor *const *)a_out,
                             2, &ws, &ex));
  CHECK(ws > 0, "attention asks for a workspace");
  void *small = NULL;
  OK(uniopMalloc(&small, 64, UNIOP_MEM_MALLOC_NORMAL_ONLY));
  expect_error("workspace too small", uniopOpRun(small, 64, ex, stream), UNIOP_ERROR_WORKSPACE_TOO_SMALL,
               "smaller than");
  OK(uniopDestroyExecutor(ex));
  OK(uniopFree(small));

  /* A single-use executor is consumed by its launch; a destroyed handle is not dereferenced. */
  OK(uniopOpGetWorkspaceSize("rms_norm", (const uniopTensor *const *)ok_in, 2, NULL, (const uniopTensor *const *)outs, 2,
                             &ws, &ex));
  OK(uniopOpRun(NULL, 0, ex, stream));
  expect_error("single-use executor reused", uniopOpRun(NULL, 0, ex, stream), UNIOP_ERROR_PARAM_INVALID,
               "not one (destroyed already");
  OK(uniopSynchronizeStream(stream));
  uniopTensor *gone = dense(wd, 1, w);
  OK(uniopDestroyTensor(gone));
  expect_error("destroyed tensor", uniopDestroyTensor(gone), UNIOP_ERROR_PARAM_INVALID, "uniopTensor");
  uniopTensor *gone_in[] = {tx, gone};
  expect_error("destroyed tensor as input", uniopOpGetWorkspaceSize("rms_norm", (const uniopTensor *const *)gone_in, 2,
                                                                  NULL, (const uniopTensor *const *)outs, 2, &ws, &ex),
               UNIOP_ERROR_PARAM_INVALID, "argument 'inputs[1]'");
  expect_error("null stream out-param", uniopCreateStream(NULL), UNIOP_ERROR_PARAM_NULLPTR, "stream");
  expect_error("free foreign pointer", uniopFree(x), UNIOP_ERROR_PARAM_INVALID, "not yet freed");
  expect_error("bad memcpy kind", uniopMemcpy(y, sizeof y, x, sizeof x, 7), UNIOP_ERROR_PARAM_INVALID, "kind");
  expect_error("memcpy past destMax", uniopMemcpy(y, 4, x, sizeof x, UNIOP_MEMCPY_HOST_TO_HOST),
               UNIOP_ERROR_PARAM_INVALID, "destMax");
  expect_error("no such device", uniopSetDevice(3), UNIOP_ERROR_PARAM_INVALID, "deviceId");
  expect_error("typed: null str attribute", uniopRopeGetWorkspaceSize(tx, tw, tw, NULL, false, ty, &ws, &ex),
               UNIOP_ERROR_PARAM_NULLPTR, "uniopRopeGetWorkspaceSize: argument 'mode'");
  expect_error("typed: bad dtype attribute", uniopCastGetWorkspaceSize(tx, 99, ty, &ws, &ex), UNIOP_ERROR_DTYPE,
               "'dtype'");
  expect_error("typed: null output", uniopRmsNormGetWorkspaceSize(tx, tw, 1e-6, NULL, tr, &ws, &ex),
               UNIOP_ERROR_PARAM_NULLPTR, "'y'");

  uniopTensor *all[] = {tx, tw, tw3, ty, tr, ti, tq, to, tl};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) OK(uniopDestroyTensor(all[i]));
}

/* The rest of the runtime: host memory, async copies ordered by events across streams, memory
 * summary, input rebinding, and each call's bad inputs. */
static void test_runtime_calls(uniopStream stream) {
  float *src = NULL, *dst = NULL;
  OK(uniopMallocHost((void **)&src, 256 * sizeof(float)));
  OK(uniopMalloc((void **)&dst, 256 * sizeof(float), UNIOP_MEM_MALLOC_NORMAL_ONLY));
  for (int i = 0; i < 256; i++) src[i] = (float)i;
  uniopStream other;
  uniopEvent copied;
  OK(uniopCreateStream(&other));
  OK(uniopCreateEvent(&copied));
  OK(uniopMemcpyAsync(dst, 256 * sizeof(float), src, 256 * sizeof(float), UNIOP_MEMCPY_HOST_TO_DEVICE, stream));
  OK(uniopRecordEvent(copied, stream));
  OK(uniopStreamWaitEvent(other, copied));
  float back[256];
  OK(uniopMemcpyAsync(back, sizeof back, dst, sizeof back, UNIOP_MEMCPY_DEVICE_TO_HOST, other));
  OK(uniopSynchronizeStream(other));
  int good = 1;
  for (int i = 0; i < 256; i++) good &= back[i] == (float)i;
  CHECK(good, "async copies ordered by an event");
  printf("%-28s %s\n", "async copies + stream wait", good ? "PASS" : "FAIL");

  test_mem_stat_counters();

  size_t needed = 0;
  OK(uniopMemorySummary(NULL, 0, &needed));
  char *summary = malloc(needed);
  OK(uniopMemorySummary(summary, needed, NULL));
  CHECK(strlen(summary) + 1 == needed && strstr(summary, "allocated") != NULL, "memory summary: %s", summary);
  free(summary);

  /* A repeatable executor re-pointed at another input. */
  float x2[16], w2[16], y2[16], r2[1];
  for (int i = 0; i < 16; i++) x2[i] = 1.0f, w2[i] = 2.0f;
  int64_t xd[] = {1, 16}, wd[] = {16}, rd[] = {1, 1};
  uniopTensor *tx = dense(xd, 2, x2), *tw = dense(wd, 1, w2), *ty = dense(xd, 2, y2), *tr = dense(rd, 2, r2);
  uint64_t ws = 0;
  uniopExecutor *ex = NULL;
  OK(uniopRmsNormGetWorkspaceSize(tx, tw, 0.0, ty, tr, &ws, &ex));
  OK(uniopSetExecutorRepeatable(ex));
  OK(uniopRmsNorm(NULL, 0, ex, stream));
  float w3[16];
  for (int i = 0; i < 16; i++) w3[i] = 3.0f;
  OK(uniopSetInputTensorAddr(ex, 1, w3));
  OK(uniopRmsNorm(NULL, 0, ex, stream));
  OK(uniopSynchronizeStream(stream));
  CHECK(fabsf(y2[0] - 3.0f) < 1e-6f, "rebound weight: y = %f", y2[0]);
  printf("%-28s %s\n", "rebound input", fabsf(y2[0] - 3.0f) < 1e-6f ? "PASS" : "FAIL");

  expect_error("rebind: index past inputs", uniopSetInputTensorAddr(ex, 2, w3), UNIOP_ERROR_PARAM_INVALID, "'index'");
  expect_error("rebind: NULL address", uniopSetOutputTensorAddr(ex, 0, NULL), UNIOP_ERROR_PARAM_NULLPTR, "'addr'");
  OK(uniopDestroyExecutor(ex));
  expect_error("free host with uniopFree", uniopFree(src), UNIOP_ERROR_PARAM_INVALID, "uniopMallocHost");
  expect_error("async memcpy bad kind", uniopMemcpyAsync(dst, 4, src, 4, -1, stream), UNIOP_ERROR_PARAM_INVALID, "kind");
  expect_error("malloc size 0", uniopMalloc((void **)&dst, 0, UNIOP_MEM_MALLOC_HUGE_FIRST), UNIOP_ERROR_PARAM_INVALID,
               "'size'");
  expect_error("malloc bad policy", uniopMalloc((void **)&dst, 8, 9), UNIOP_ERROR_PARAM_INVALID, "'policy'");
  uniopEvent never;
  OK(uniopCreateEvent(&never));
  expect_error("wait on unrecorded event", uniopStreamWaitEvent(other, never), UNIOP_ERROR_PARAM_INVALID, "record");
  expect_error("query: NULL out-param", uniopQueryEvent(copied, NULL), UNIOP_ERROR_PARAM_NULLPTR, "'done'");
  expect_error("elapsed: NULL out-param", uniopEventElapsedTime(NULL, copied, copied), UNIOP_ERROR_PARAM_NULLPTR,
               "'ms'");
  expect_error("stats: NULL out-param", uniopGetMemStats(NULL), UNIOP_ERROR_PARAM_NULLPTR, "'stats'");
  uint64_t counter = 0;
  expect_error("stat: NULL out-param", uniopGetMemStat(UNIOP_MEM_STAT_OOMS, NULL), UNIOP_ERROR_PARAM_NULLPTR,
               "'value'");
  expect_error("stat: unknown counter", uniopGetMemStat(UNIOP_MEM_STAT_OOMS + 1, &counter),
               UNIOP_ERROR_PARAM_INVALID, "expected a UNIOP_MEM_STAT_* counter (0 to 10), got 11");
  expect_error("stat: negative counter", uniopGetMemStat(-1, &counter), UNIOP_ERROR_PARAM_INVALID, "got -1");
  expect_error("summary: NULL buffer", uniopMemorySummary(NULL, 16, NULL), UNIOP_ERROR_PARAM_NULLPTR, "'buf'");
  expect_error("launch: NULL kernel", uniopLaunchKernel(NULL, 1, NULL, stream), UNIOP_ERROR_PARAM_NULLPTR, "'kernel'");
  expect_error("launch: blockDim 0", uniopLaunchKernel(fill_kernel, 0, NULL, stream), UNIOP_ERROR_PARAM_INVALID,
               "'blockDim'");
  expect_error("mem info: NULL out-param", uniopGetMemInfo(NULL, NULL), UNIOP_ERROR_PARAM_NULLPTR, "'free'");
  OK(uniopDestroyEvent(never));
  OK(uniopDestroyEvent(copied));
  OK(uniopDestroyStream(other));
  OK(uniopFreeHost(src));
  OK(uniopFree(dst));
  uniopTensor *all[] = {tx, tw, ty, tr};
  for (size_t i = 0; i < 4; i++) OK(uniopDestroyTensor(all[i]));
}

/* The profiler: every launch between start and stop, as an op summary and a Chrome trace. */
static void test_profiler(uniopStream stream) {
  expect_error("profiler: stop unstarted", uniopProfilerStop(), UNIOP_ERROR_PARAM_INVALID, "no profiler is recording");
  expect_error("profiler: no profile yet", uniopProfilerSummary(0, NULL, 0, NULL), UNIOP_ERROR_PARAM_INVALID,
               "no profile yet");
  OK(uniopProfilerStart());
  expect_error("profiler: started twice", uniopProfilerStart(), UNIOP_ERROR_PARAM_INVALID, "already recording");
  float x[3 * 64], w[64], y[3 * 64], rstd[3];
  fill(x, 3 * 64, 7);
  fill(w, 64, 8);
  int64_t xd[] = {3, 64}, wd[] = {64}, rd[] = {3, 1};
  uniopTensor *tx = dense(xd, 2, x), *tw = dense(wd, 1, w), *ty = dense(xd, 2, y), *tr = dense(rd, 2, rstd);
  for (int i = 0; i < 2; i++) {
    uint64_t ws = 0;
    uniopExecutor *exec = NULL;
    OK(uniopRmsNormGetWorkspaceSize(tx, tw, 1e-6, ty, tr, &ws, &exec));
    launch(uniopRmsNorm, ws, exec, stream);
  }
  int data[64];
  FillArgs args = {data, 64};
  OK(uniopLaunchKernel(fill_kernel, 2, &args, stream));
  OK(uniopSynchronizeStream(stream));
  OK(uniopProfilerStop());

  size_t needed = 0;
  OK(uniopProfilerSummary(0, NULL, 0, &needed));
  char *summary = malloc(needed);
  OK(uniopProfilerSummary(0, summary, needed, NULL));
  /* The rms_norm row counts both launches; the direct call has its own row. */
  const char *row = strstr(summary, "\nrms_norm ");
  int good = strlen(summary) + 1 == needed && row != NULL && strstr(row, " op ") != NULL &&
             strstr(summary, "f32[3, 64], f32[64] -> f32[3, 64], f32[3, 1]") != NULL &&
             strstr(summary, "\nkernel ") != NULL;
  long calls = 0;
  if (row) sscanf(row + 1, "%*s %*s %*s %ld", &calls);
  good &= calls == 2;
  CHECK(good, "profiler summary (%ld rms_norm calls):\n%s", calls, summary);
  printf("%-28s %s\n", "profiler summary", good ? "PASS" : "FAIL");
  free(summary);

  char path[64];
  snprintf(path, sizeof path, "/tmp/uniop-c-trace-%ld.json", (long)getpid());
  OK(uniopProfilerWriteTrace(path));
  FILE *f = fopen(path, "r");
  char head[64] = {0};
  size_t got = f ? fread(head, 1, sizeof head - 1, f) : 0;
  if (f) fclose(f);
  remove(path);
  CHECK(got > 0 && strncmp(head, "{\"", 2) == 0 && strstr(head, "traceEvents") != NULL, "trace file: %s", head);
  printf("%-28s %s\n", "profiler trace", got > 0 ? "PASS" : "FAIL");
  expect_error("trace: NULL path", uniopProfilerWriteTrace(NULL), UNIOP_ERROR_PARAM_NULLPTR, "'path'");
  expect_error("trace: unwritable path", uniopProfilerWriteTrace("/nonexistent-dir/t.json"), UNIOP_ERROR_PARAM_INVALID,
               "writable file path");
  expect_error("summary: NULL buffer", uniopProfilerSummary(0, NULL, 8, NULL), UNIOP_ERROR_PARAM_NULLPTR, "'buf'");
  uniopTensor *all[] = {tx, tw, ty, tr};
  for (size_t i = 0; i < 4; i++) OK(uniopDestroyTensor(all[i]));
}

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* Per-call overhead on a tiny tensor: phase 1 + phase 2 (+ synchronize), and a repeatable
 * executor's re-launch with rebinding. */
static void bench_overhead(void) {
  float x[16], w[16], y[16], rstd[1];
  fill(x, 16, 10);
  fill(w, 16, 11);
  int64_t xd[] = {1, 16}, wd[] = {16}, rd[] = {1, 1};
  uniopTensor *in[] = {dense(xd, 2, x), dense(wd, 1, w)}, *out[] = {dense(xd, 2, y), dense(rd, 2, rstd)};
  enum { N = 20000 };
  uint64_t ws = 0;
  uniopExecutor *ex = NULL;
  double best_pair = 1e9, best_relaunch = 1e9, best_rebind = 1e9;
  for (int rep = 0; rep < 5; rep++) {
    double t0 = now_us();
    for (int i = 0; i < N; i++) {
      uniopRmsNormGetWorkspaceSize(in[0], in[1], 1e-6, out[0], out[1], &ws, &ex);
      uniopRmsNorm(NULL, 0, ex, NULL);
    }
    OK(uniopSynchronizeStream(NULL));
    double pair = (now_us() - t0) / N;
    if (pair < best_pair) best_pair = pair;
  }
  OK(uniopOpGetWorkspaceSize("rms_norm", (const uniopTensor *const *)in, 2, NULL, (const uniopTensor *const *)out, 2,
                             &ws, &ex));
  OK(uniopSetExecutorRepeatable(ex));
  for (int rep = 0; rep < 5; rep++) {
    double t0 = now_us();
    for (int i = 0; i < N; i++) uniopOpRun(NULL, 0, ex, NULL);
    OK(uniopSynchronizeStream(NULL));
    double relaunch = (now_us() - t0) / N;
    if (relaunch < best_relaunch) best_relaunch = relaunch;
    t0 = now_us();
    for (int i = 0; i < N; i++) {
      uniopSetOutputTensorAddr(ex, 0, y);
      uniopOpRun(NULL, 0, ex, NULL);
    }
    OK(uniopSynchronizeStream(NULL));
    double rebind = (now_us() - t0) / N;
    if (rebind < best_rebind) best_rebind = rebind;
  }
  OK(uniopDestroyExecutor(ex));
  printf("overhead (rms_norm [1,16], default stream): typed two-phase pair %.3f us/call, repeatable re-launch %.3f us, "
         "re-launch after rebinding an output %.3f us\n",
         best_pair, best_relaunch, best_rebind);
  for (int i = 0; i < 2; i++) OK(uniopDestroyTensor(in[i]));
  for (int i = 0; i < 2; i++) OK(uniopDestroyTensor(out[i]));
}

int main(int argc, char **argv) {
  OK(uniopInit());
  OK(uniopSetDevice(0));
  CHECK(uniopGetAbiVersion() == UNIOP_ABI_VERSION, "ABI version");
  uniopStream stream;
  OK(uniopCreateStream(&stream));
  test_rms_norm(stream);
  test_glus(stream);
  test_matmul(stream);
  test_packed_weight(stream);
  test_rope(stream);
  test_attention_and_kv_cache(stream);
  test_direct_call_and_events(stream);
  test_cat_tensor_list(stream);
  test_scalar_and_int_array(stream);
  test_bad_inputs(stream);
  test_runtime_calls(stream);
  int fork_test = 1, bench = 0;
  for (int i = 1; i < argc; i++) {
    fork_test &= strcmp(argv[i], "--no-fork") != 0;
    bench |= strcmp(argv[i], "--bench") == 0;
  }
  if (fork_test) test_fork(stream);
  test_profiler(stream);
  size_t free_b = 0, total_b = 0;
  OK(uniopGetMemInfo(&free_b, &total_b));
  CHECK(total_b > 0 && free_b <= total_b, "mem info %zu / %zu", free_b, total_b);
  uniopMemStats stats;
  OK(uniopGetMemStats(&stats));
  CHECK(stats.liveBuffers == 0, "%llu buffers still allocated", (unsigned long long)stats.liveBuffers);
  if (bench) bench_overhead();
  OK(uniopDestroyStream(stream));
  OK(uniopFinalize());
  printf("%d failed checks\n", failures);
  return failures == 0 ? 0 : 1;
}
