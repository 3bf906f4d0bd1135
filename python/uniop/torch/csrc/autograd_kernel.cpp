// The Autograd kernel of every torch.ops.uniop op that has a backward, in C++.
//
// Why C++: a call that needs no gradient (inference, no_grad, tensors without requires_grad) is
// the common case, and a Python autograd kernel costs it a trip into Python — GIL, IValue to
// PyObject conversion, a frame — before the real kernel runs: about 2 µs of a ~5.5 µs call on a
// tiny tensor. Here that call is a C++ redispatch below autograd. Every other call (something
// needs a gradient, fake tensors, modes, functionalization) goes to the generic Python kernel
// torch.library builds from the op's backward (`uniop/torch/__init__.py`), with the same
// arguments and dispatch key set it would have received as a Python kernel.
//
// Generic over the registry: one functor type, one instance per op, no per-op code. Built
// against the installed torch by `python -m uniop.torch.build_kernels` (scripts/python-env.sh).
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// The key set of a call whose arguments are all plain CPU tensors, as an Autograd kernel sees it.
constexpr c10::DispatchKeySet kPlainCpu =
    c10::DispatchKeySet(c10::DispatchKey::CPU) | c10::DispatchKeySet(c10::DispatchKey::AutogradCPU);

bool requires_grad(const c10::IValue& value) {
  if (value.isTensor()) {
    return value.toTensor().requires_grad();
  }
  if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList()) {
      if (t.requires_grad()) return true;
    }
    return false;
  }
  if (value.isList()) {  // Tensor?[]
    for (const c10::IValue& item : value.toListRef()) {
      if (requires_grad(item)) return true;
    }
  }
  return false;
}

class AutogradKernel final : public c10::OperatorKernel {
 public:
  // `generic` is torch.library's autograd kernel for this op: generic(keyset, *args, **kwargs).
  // It is held for the life of the process and deliberately never released: the dispatcher may
  // destroy this functor after the interpreter has finalized, when no reference may be dropped.
  explicit AutogradKernel(py::object generic) : generic_(generic.release().ptr()) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    const auto& schema = op.schema();
    const size_t num_args = schema.arguments().size();
    if (keyset == kPlainCpu && !(c10::GradMode::is_enabled() && any_requires_grad(*stack, num_args))) {
      op.redispatchBoxed(keyset & c10::after_autograd_keyset, stack);
      return;
    }
    call_generic(op, keyset, stack, num_args);
  }

 private:
  static bool any_requires_grad(const torch::jit::Stack& stack, size_t num_args) {
    for (size_t i = stack.size() - num_args; i < stack.size(); ++i) {
      if (requires_grad(stack[i])) return true;
    }
    return false;
  }

  void call_generic(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack,
                    size_t num_args) {
    const auto& schema = op.schema();
    py::gil_scoped_acquire gil;
    py::list args;
    py::dict kwargs;
    args.append(py::cast(keyset));
    const size_t first = stack->size() - num_args;
    for (size_t i = 0; i < num_args; ++i) {
      py::object value = torch::jit::toPyObject(std::move((*stack)[first + i]));
      const auto& arg = schema.arguments()[i];
      if (arg.kwarg_only()) {
        kwargs[py::str(arg.name())] = value;
      } else {
        args.append(value);
      }
    }
    torch::jit::drop(*stack, num_args);
    py::object out = py::reinterpret_borrow<py::object>(generic_)(*py::tuple(args), **kwargs);
    push_returns(schema, stack, out);
  }

  static void push_returns(const c10::FunctionSchema& schema, torch::jit::Stack* stack, const py::object& out) {
    const auto& returns = schema.returns();
    if (returns.size() == 1) {
      stack->push_back(torch::jit::toIValue(out, returns[0].real_type()));
      return;
    }
    auto items = out.cast<py::sequence>();
    TORCH_CHECK(items.size() == returns.size(), "uniop autograd kernel for ", schema.name(), ": expected ",
                returns.size(), " returns, the Python kernel gave ", items.size());
    for (size_t i = 0; i < returns.size(); ++i) {
      stack->push_back(torch::jit::toIValue(items[i], returns[i].real_type()));
    }
  }

  PyObject* generic_;
};

// The IMPL fragments holding the registrations: they live as long as the process (a registration
// ends when its Library is destroyed, and ops are never unregistered).
std::vector<std::unique_ptr<torch::Library>>& libraries() {
  static auto* libs = new std::vector<std::unique_ptr<torch::Library>>();
  return *libs;
}

void register_autograd(const std::string& ns, const std::string& name, py::object generic) {
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::Autograd, __FILE__,
                                              __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<AutogradKernel>(generic)));
  libraries().push_back(std::move(lib));
}

}  // namespace

PYBIND11_MODULE(_autograd_kernel, m) {
  m.doc() = "uniop's C++ Autograd kernel for torch.ops.uniop ops (see uniop/torch/csrc/autograd_kernel.cpp).";
  m.def("register_autograd", &register_autograd, py::arg("namespace"), py::arg("name"), py::arg("generic"),
        "Registers the C++ Autograd kernel for namespace::name; calls needing autograd go to `generic`.");
}
