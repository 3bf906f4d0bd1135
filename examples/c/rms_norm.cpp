// The C API from C++: RAII owners for descriptors and executors, errors as exceptions, one
// two-phase rms_norm on a user stream with a workspace from uniopMalloc. Checked against a
// double-precision reference; exit status 0 when it matches.
//
//   g++ -std=c++17 -Wall -Wextra -Werror -I include examples/c/rms_norm.cpp -L target/release -luniop_capi
#include "uniop.h"

#include <cmath>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

void check(uniopStatus s, const char* what) {
  if (s != UNIOP_SUCCESS) throw std::runtime_error(std::string(what) + ": " + uniopGetRecentErrMsg());
}

struct TensorDeleter {
  void operator()(uniopTensor* t) const { uniopDestroyTensor(t); }
};
using Tensor = std::unique_ptr<uniopTensor, TensorDeleter>;

Tensor dense(std::vector<int64_t> dims, float* data) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  uniopTensor* t = uniopCreateTensor(dims.data(), dims.size(), UNIOP_FLOAT, nullptr, 0, UNIOP_FORMAT_ND, &n, 1, data);
  if (!t) throw std::runtime_error(uniopGetRecentErrMsg());
  return Tensor(t);
}

}  // namespace

int main() {
  try {
    const int rows = 3, hidden = 64;
    std::vector<float> x(rows * hidden), w(hidden), y(rows * hidden), rstd(rows);
    for (int i = 0; i < rows * hidden; i++) x[i] = std::sin(0.37f * i);
    for (int j = 0; j < hidden; j++) w[j] = 1.0f + 0.01f * j;

    uniopStream stream = nullptr;
    check(uniopCreateStream(&stream), "uniopCreateStream");
    Tensor tx = dense({rows, hidden}, x.data()), tw = dense({hidden}, w.data());
    Tensor ty = dense({rows, hidden}, y.data()), tr = dense({rows, 1}, rstd.data());
    const uniopTensor* in[] = {tx.get(), tw.get()};
    const uniopTensor* out[] = {ty.get(), tr.get()};
    uint64_t ws_size = 0;
    uniopExecutor* exec = nullptr;
    check(uniopOpGetWorkspaceSize("rms_norm", in, 2, "eps=1e-6", out, 2, &ws_size, &exec), "rms_norm phase 1");
    void* ws = nullptr;
    if (ws_size) check(uniopMalloc(&ws, ws_size, UNIOP_MEM_MALLOC_HUGE_FIRST), "uniopMalloc");
    check(uniopOpRun(ws, ws_size, exec, stream), "rms_norm phase 2");
    check(uniopSynchronizeStream(stream), "uniopSynchronizeStream");
    if (ws) check(uniopFree(ws), "uniopFree");
    check(uniopDestroyStream(stream), "uniopDestroyStream");

    double worst = 0;
    for (int r = 0; r < rows; r++) {
      double ss = 0;
      for (int j = 0; j < hidden; j++) ss += double(x[r * hidden + j]) * x[r * hidden + j];
      double inv = 1.0 / std::sqrt(ss / hidden + 1e-6);
      for (int j = 0; j < hidden; j++) {
        double want = x[r * hidden + j] * inv * w[j];
        worst = std::fmax(worst, std::fabs(y[r * hidden + j] - want) / (1.0 + std::fabs(want)));
      }
    }
    std::printf("C++ rms_norm max rel err %.2e %s\n", worst, worst <= 1e-5 ? "PASS" : "FAIL");
    return worst <= 1e-5 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
}
