/* Plugins from C: load a Rust op library at run time and call its op through the by-name
 * two-phase pair; then the ways loading must fail cleanly (a library for another plugin ABI, a
 * library that is no plugin, a missing file, the same plugin twice, a NULL path).
 *
 *   ./plugin path/to/libuniop_plugin_example.so path/to/wrong_abi.so
 */
#include "check.h"

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s PLUGIN.so WRONG_ABI.so\n", argv[0]);
    return 2;
  }
  OK(uniopInit());
  OK(uniopLoadOpLibrary(argv[1]));

  enum { N = 7 };
  float x[N] = {-2.0f, -0.5f, 0.0f, 0.25f, 1.0f, 3.0f, -1e-3f}, y[N];
  int64_t dims[] = {N}, n = N;
  uniopTensor *tx = uniopCreateTensor(dims, 1, UNIOP_FLOAT, NULL, 0, UNIOP_FORMAT_ND, &n, 1, x);
  uniopTensor *ty = uniopCreateTensor(dims, 1, UNIOP_FLOAT, NULL, 0, UNIOP_FORMAT_ND, &n, 1, y);
  const uniopTensor *in[] = {tx}, *out[] = {ty};
  uint64_t ws = 0;
  uniopExecutor *ex = NULL;
  OK(uniopOpGetWorkspaceSize("squared_relu", in, 1, NULL, out, 1, &ws, &ex));
  OK(uniopOpRun(NULL, ws, ex, NULL));
  OK(uniopSynchronizeStream(NULL));
  int good = 1;
  for (int i = 0; i < N; i++) {
    float r = x[i] > 0 ? x[i] : 0;
    good &= y[i] == r * r;
  }
  CHECK(good, "squared_relu values");
  printf("%-28s %s\n", "plugin op squared_relu", good ? "PASS" : "FAIL");
  OK(uniopDestroyTensor(tx));
  OK(uniopDestroyTensor(ty));

  expect_error("wrong plugin ABI", uniopLoadOpLibrary(argv[2]), UNIOP_ERROR_PARAM_INVALID,
               "speaks plugin ABI version 999, this uniop speaks 1");
  expect_error("not a plugin", uniopLoadOpLibrary("libm.so.6"), UNIOP_ERROR_PARAM_INVALID,
               "is not a uniop op library");
  expect_error("missing file", uniopLoadOpLibrary("/nonexistent/libnope.so"), UNIOP_ERROR_PARAM_INVALID,
               "cannot be loaded");
  expect_error("loaded twice", uniopLoadOpLibrary(argv[1]), UNIOP_ERROR_PARAM_INVALID, "already registered");
  expect_error("null path", uniopLoadOpLibrary(NULL), UNIOP_ERROR_PARAM_NULLPTR, "'path'");
  OK(uniopFinalize());
  printf("%d failed checks\n", failures);
  return failures == 0 ? 0 : 1;
}
