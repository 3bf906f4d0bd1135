// uniop's C++ kernels for torch.ops.uniop: the CPU kernel and the Autograd kernel of every op.
//
// Why C++: a Python kernel costs each call the GIL, a PyObject per argument and a frame before the
// op runs — on a tiny tensor about 2.5 µs for the CPU kernel and 2 µs more for the Autograd one,
// more than the op itself. Here:
//
// - CpuKernel reads the dispatcher's stack into uniop's boxed values (tensors as DLPack views) and
//   calls the core through the C ABI `_native._torch_abi()` hands over in a capsule
//   (crates/uniop-python/src/torch_abi.rs). The core asks back for each output once it knows the
//   shape (OutputMaker), and the kernel creates it as a plain torch tensor over a c10::Allocator
//   whose blocks are uniop's caching allocator's. No Python runs, and torch has already released
//   the GIL, so threads calling ops run in parallel.
// - AutogradKernel sends a call on plain CPU tensors that needs no gradient (inference, no_grad,
//   tensors without requires_grad) and carries no forward-mode tangent below autograd in C++; one
//   that needs a gradient records a C++ graph node (UniopFunction) whose backward calls the op's
//   backward op through the dispatcher. Every other call (a tangent to refuse, fake tensors, modes,
//   functionalization, torch.func) goes to the generic Python kernel uniop.torch builds from the
//   op's backward (`_autograd_kernel` in uniop/torch/__init__.py), with the arguments and key set it
//   would have had. Both nodes are wired alike, from uniop.torch's `_BackwardWiring`.
//
// All are generic over the registry: one functor type each, one instance per op, no per-op code.
// Built against the installed torch by `python -m uniop.torch.build_kernels` (scripts/python-env.sh).
#include <ATen/DLConvertor.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/dlpack.h>
#include <c10/core/GradMode.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// ---- The C ABI of crates/uniop-python/src/torch_abi.rs (keep in step; the version guards it).

enum ValueKind : uint32_t {
  kNone = 0,
  kTensor = 1,
  kTensorList = 2,
  kInt = 3,
  kFloat = 4,
  kBool = 5,
  kStr = 6,
  kInts = 7,
  kDType = 8,
};

struct BoxedValue {
  uint32_t kind = kNone;
  uint64_t len = 0;
  const DLTensor* tensors = nullptr;
  const int64_t* ints = nullptr;
  const uint8_t* text = nullptr;
  int64_t int_value = 0;
  double float_value = 0;
  DLDataType dtype{0, 0, 0};
};
static_assert(sizeof(BoxedValue) == 64, "BoxedValue must match torch_abi.rs");

struct OutputMaker {
  void* (*make)(void* state, uint64_t index, const int64_t* shape, uint64_t ndim, DLDataType dtype);
  void* state;
};

struct TorchAbi {
  uint32_t version;
  int32_t (*call)(const void* op, const BoxedValue* args, uint64_t num_args, const OutputMaker* outputs,
                  uint64_t num_outs);
  void* (*allocate)(uint64_t bytes, void** context);
  void (*release)(void* context);
};

constexpr uint32_t kTorchAbiVersion = 5;
constexpr const char* kCapsuleName = "uniop._native.torch_abi";

const TorchAbi* g_abi = nullptr;

// ---- Outputs

// Blocks from uniop's caching allocator, so torch.ops.uniop outputs are reused memory (a fresh page's
// first write runs at a fraction of memory bandwidth) and count in uniop.memory_stats().
class UniopAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    void* context = nullptr;
    void* data = g_abi->allocate(bytes, &context);
    TORCH_CHECK_WITH(OutOfMemoryError, data != nullptr, "uniop: out of memory allocating an output of ", bytes,
                     " bytes");
    return {data, context, g_abi->release, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }
};

UniopAllocator g_allocator;

// A contiguous CPU tensor over uniop's allocator: what every output the core asks for becomes.
at::Tensor empty_output(const int64_t* shape, uint64_t ndim, DLDataType dtype) {
  return at::detail::empty_generic(c10::IntArrayRef(shape, ndim), &g_allocator,
                                   c10::DispatchKeySet(c10::DispatchKey::CPU), at::toScalarType(dtype), std::nullopt);
}

// The outputs of one call, made when the core asks for them (OutputMaker::make): `n`, or for an
// op returning a list, as many as the core asks for, in order.
struct Outputs {
  Outputs(size_t n, bool grows) : tensors(n), grows(grows) {}
  c10::SmallVector<at::Tensor, 4> tensors;
  bool grows;

  static void* make(void* state, uint64_t index, const int64_t* shape, uint64_t ndim, DLDataType dtype) noexcept {
    auto* self = static_cast<Outputs*>(state);
    if (index >= self->tensors.size() && !(self->grows && index == self->tensors.size())) return nullptr;
    try {
      if (index == self->tensors.size()) self->tensors.emplace_back();
      at::Tensor t = empty_output(shape, ndim, dtype);
      void* data = t.mutable_data_ptr();
      self->tensors[index] = std::move(t);
      return data;
    } catch (...) {
      return nullptr;  // the core reports it; no exception may unwind into Rust
    }
  }
};

// ---- CPU kernel

// How the CPU kernel reads one schema argument off the stack (decided once per op).
enum class ArgClass { Tensor, MutatedTensor, TensorList, DType, Attribute };

// A DLPack code for the dtypes uniop knows; anything else is passed as code 255 with the torch name
// in the value's text, for the core to refuse with its usual error.
bool dl_dtype(c10::ScalarType t, DLDataType* out) {
  switch (t) {
    case c10::ScalarType::Float: *out = {kDLFloat, 32, 1}; return true;
    case c10::ScalarType::Half: *out = {kDLFloat, 16, 1}; return true;
    case c10::ScalarType::BFloat16: *out = {kDLBfloat, 16, 1}; return true;
    case c10::ScalarType::Double: *out = {kDLFloat, 64, 1}; return true;
    case c10::ScalarType::Char: *out = {kDLInt, 8, 1}; return true;
    case c10::ScalarType::Short: *out = {kDLInt, 16, 1}; return true;
    case c10::ScalarType::Int: *out = {kDLInt, 32, 1}; return true;
    case c10::ScalarType::Long: *out = {kDLInt, 64, 1}; return true;
    case c10::ScalarType::Byte: *out = {kDLUInt, 8, 1}; return true;
    case c10::ScalarType::Bool: *out = {kDLBool, 8, 1}; return true;
    default: *out = {255, 0, 1}; return false;
  }
}

// The per-call storage the boxed values point into; sized for typical ops without heap use.
struct CallStorage {
  c10::SmallVector<DLTensor, 8> tensors;
  std::vector<std::vector<int64_t>> int_lists;
  std::vector<std::string> names;  // dtype names uniop does not know
};

// The bytes `t`'s elements reach into its storage, when more than the storage holds: a storage can
// be resized smaller under its views (`untyped_storage().resize_()`), and reading such a view reads
// past the end of its memory. 0 when the elements fit.
// Overflowing extents count as past the end. (at::detail::computeStorageNbytes answers the same
// in ~150 instructions per tensor against ~100 here, measured with callgrind.)
size_t bytes_past_storage(const at::Tensor& t) {
  const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
  uint64_t last = static_cast<uint64_t>(t.storage_offset());  // the last element's index
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return 0;
    uint64_t step = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(sizes[d] - 1), static_cast<uint64_t>(strides[d]), &step) ||
        __builtin_add_overflow(last, step, &last))
      return SIZE_MAX;
  }
  uint64_t needed = 0;
  if (__builtin_mul_overflow(last + 1, static_cast<uint64_t>(t.itemsize()), &needed)) return SIZE_MAX;
  return needed > t.storage().nbytes() ? needed : 0;
}

DLTensor dl_view(const at::Tensor& t, bool mutated, DLDataType dtype) {
  DLTensor d{};
  d.data = mutated ? t.mutable_data_ptr() : const_cast<void*>(t.const_data_ptr());
  // Only CPU tensors reach a CPU kernel, short of a mixed call; the core names any other device.
  d.device = t.is_cpu() ? DLDevice{kDLCPU, 0} : DLDevice{t.is_cuda() ? kDLCUDA : kDLExtDev, t.get_device()};
  d.ndim = static_cast<int32_t>(t.dim());
  d.dtype = dtype;
  d.shape = const_cast<int64_t*>(t.sizes().data());
  d.strides = const_cast<int64_t*>(t.strides().data());
  d.byte_offset = 0;
  return d;
}

// uniop.<op> called directly on torch tensors makes its outputs here too, as new torch.Tensor
// references with `*data` their first byte: half the cost of handing torch a DLPack tensor
// (crates/uniop-python/src/torch_abi.rs, TensorMaker). The caller holds the GIL. Null, with no
// Python error left set, when torch could not.
PyObject* make_py_tensor(const int64_t* shape, uint64_t ndim, DLDataType dtype, void** data) noexcept {
  try {
    at::Tensor t = empty_output(shape, ndim, dtype);
    *data = t.mutable_data_ptr();
    PyObject* obj = THPVariable_Wrap(std::move(t));
    if (obj == nullptr) PyErr_Clear();
    return obj;
  } catch (...) {
    PyErr_Clear();
    return nullptr;
  }
}

// What read_py_tensor returns; the numbers are the ABI (torch_abi.rs, `read_status`).
enum ReadStatus : int {
  kNotRead = 0,        // not a plain CPU tensor of a dtype uniop knows: the caller reads it another way
  kRead = 1,           // `view` is filled
  kNegativeView = -1,  // `_neg_view()`: values are the negation of its memory's, which DLPack cannot say
  kPastStorage = -2,   // the view reaches past the end of its storage (bytes_past_storage)
};

// uniop.<op> called directly on torch tensors reads each tensor argument here: `view` gets the
// tensor's own data pointer, sizes and strides (valid while the caller holds `obj`). Torch's DLPack
// exchange API, the route otherwise, pays a pybind11 caster, a GIL guard and a work-stream query for
// the same view: about 1,100 instructions per tensor against 350 here with the checks below, most of
// the 7,317 -> 6,679 of a tiny uniop.silu call (callgrind). Negative views are refused because the
// exchange route reads their memory as it is. Not read: other devices, sparse, conjugate views,
// tensor subclasses that dispatch to Python, functional wrappers — the exchange route refuses what the
// core cannot read with its own message.
int read_py_tensor(PyObject* obj, DLTensor* view) noexcept {
  try {
    if (!THPVariable_Check(obj)) return kNotRead;
    const at::Tensor& t = THPVariable_Unpack(obj);
    DLDataType dtype;
    if (!t.defined() || !t.is_cpu() || t.layout() != c10::kStrided || !t.has_storage() || t.is_conj() ||
        !dl_dtype(t.scalar_type(), &dtype))
      return kNotRead;
    const c10::DispatchKeySet keys = t.key_set();
    if (keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Functionalize)) return kNotRead;
    if (t.is_neg()) return kNegativeView;
    if (bytes_past_storage(t) != 0) return kPastStorage;
    *view = dl_view(t, /*mutated=*/true, dtype);
    return kRead;
  } catch (...) {
    return kNotRead;
  }
}

// The two functions above, handed to uniop._native in one capsule (torch_abi.rs, TensorIo).
struct TensorIo {
  PyObject* (*make)(const int64_t* shape, uint64_t ndim, DLDataType dtype, void** data);
  int (*read)(PyObject* obj, DLTensor* view);
};
const TensorIo kTensorIo{&make_py_tensor, &read_py_tensor};
constexpr const char* kTensorIoName = "uniop.torch.tensor_io.v1";

// Whether an argument is missing: None, or the undefined tensor torch's argument parser makes of a
// None given for a `Tensor` argument. The core gets either as no value and refuses it with its
// usual error when the argument is required (the undefined tensor has no strides to read).
bool absent(const c10::IValue& v) { return v.isNone() || (v.isTensor() && !v.toTensor().defined()); }

class CpuKernel final : public c10::OperatorKernel {
 public:
  CpuKernel(const void* op, std::vector<ArgClass> classes, bool returns_list)
      : op_(op), classes_(std::move(classes)), returns_list_(returns_list) {}

  // The view of argument `i`, refused (a torch error, before the core) when it reaches past the
  // end of its storage.
  static DLTensor checked_view(const at::Tensor& t, bool mutated, const c10::FunctionSchema& schema, size_t i) {
    const size_t needed = bytes_past_storage(t);
    TORCH_CHECK(needed == 0, schema.name(), ": argument '", schema.arguments()[i].name(),
                "': expected a tensor whose storage holds its elements, got a view reaching ", needed,
                " bytes into a storage of ", t.storage().nbytes());
    return dl_view(t, mutated, at::getDLDataType(t));
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const auto& schema = op.schema();
    const size_t num_args = classes_.size();
    const size_t first = stack->size() - num_args;
    CallStorage storage;
    // Tensor views first, all of them, so the storage never moves once values point into it.
    for (size_t i = 0; i < num_args; ++i) {
      const c10::IValue& v = (*stack)[first + i];
      if (classes_[i] == ArgClass::TensorList && v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) storage.tensors.push_back(checked_view(t, false, schema, i));
      } else if ((classes_[i] == ArgClass::Tensor || classes_[i] == ArgClass::MutatedTensor) && !absent(v)) {
        storage.tensors.push_back(checked_view(v.toTensor(), classes_[i] == ArgClass::MutatedTensor, schema, i));
      }
    }
    c10::SmallVector<BoxedValue, 8> values(num_args);
    const DLTensor* next_tensor = storage.tensors.data();
    for (size_t i = 0; i < num_args; ++i) {
      const c10::IValue& v = (*stack)[first + i];
      BoxedValue& out = values[i];
      if (absent(v)) continue;  // kNone
      switch (classes_[i]) {
        case ArgClass::Tensor:
        case ArgClass::MutatedTensor:
          out.kind = kTensor;
          out.len = 1;
          out.tensors = next_tensor++;
          break;
        case ArgClass::TensorList:
          out.kind = kTensorList;
          out.len = v.toTensorList().size();
          out.tensors = next_tensor;
          next_tensor += out.len;
          break;
        case ArgClass::DType:
          out.kind = kDType;
          if (!dl_dtype(v.toScalarType(), &out.dtype)) {
            const std::string& name = storage.names.emplace_back(c10::toString(v.toScalarType()));
            out.text = reinterpret_cast<const uint8_t*>(name.data());
            out.len = name.size();
          }
          break;
        case ArgClass::Attribute:
          read_attribute(schema, i, v, &out, &storage);
          break;
      }
    }
    Outputs outputs(returns_list_ ? 0 : schema.returns().size(), returns_list_);
    const OutputMaker maker{&Outputs::make, &outputs};
    if (g_abi->call(op_, values.data(), num_args, &maker, schema.returns().size()) != 0) {
      py::gil_scoped_acquire gil;
      throw py::error_already_set();  // uniop.UniopError, set by the core
    }
    torch::jit::drop(*stack, num_args);
    if (returns_list_) {
      c10::List<at::Tensor> list;
      list.reserve(outputs.tensors.size());
      for (at::Tensor& t : outputs.tensors) list.push_back(std::move(t));
      stack->push_back(std::move(list));
      return;
    }
    for (at::Tensor& t : outputs.tensors) stack->push_back(std::move(t));
  }

 private:
  static void read_attribute(const c10::FunctionSchema& schema, size_t i, const c10::IValue& v, BoxedValue* out,
                             CallStorage* storage) {
    if (v.isBool()) {
      out->kind = kBool;
      out->int_value = v.toBool();
    } else if (v.isInt()) {
      out->kind = kInt;
      out->int_value = v.toInt();
    } else if (v.isDouble()) {
      out->kind = kFloat;
      out->float_value = v.toDouble();
    } else if (v.isString()) {
      const std::string& text = v.toStringRef();
      out->kind = kStr;
      out->text = reinterpret_cast<const uint8_t*>(text.data());
      out->len = text.size();
    } else if (v.isIntList()) {
      const auto& ints = storage->int_lists.emplace_back(v.toIntVector());
      out->kind = kInts;
      out->ints = ints.data();
      out->len = ints.size();
    } else {
      TORCH_CHECK(false, schema.name(), ": argument '", schema.arguments()[i].name(),
                  "': uniop's torch kernel takes no value of type ", v.tagKind());
    }
  }

  const void* op_;
  std::vector<ArgClass> classes_;
  bool returns_list_;
};

// Whether `schema` returns one list of tensors (its only return).
bool returns_list(const c10::FunctionSchema& schema) {
  if (schema.returns().size() != 1) return false;
  auto list = schema.returns()[0].real_type()->cast<c10::ListType>();
  return list && list->getElementType()->kind() == c10::TypeKind::TensorType;
}

// How each argument of `schema` is read, or false when one has a type the CPU kernel does not
// convert (the op then keeps the Python CPU kernel, which handles any).
bool classify(const c10::FunctionSchema& schema, std::vector<ArgClass>* classes) {
  for (const auto& arg : schema.arguments()) {
    c10::TypePtr type = arg.real_type();
    if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
    if (type->kind() == c10::TypeKind::TensorType) {
      const bool mutated = arg.alias_info() && arg.alias_info()->isWrite();
      classes->push_back(mutated ? ArgClass::MutatedTensor : ArgClass::Tensor);
    } else if (auto list = type->cast<c10::ListType>()) {
      const auto item = list->getElementType()->kind();
      if (item == c10::TypeKind::TensorType) {
        classes->push_back(ArgClass::TensorList);
      } else if (item == c10::TypeKind::IntType) {
        classes->push_back(ArgClass::Attribute);
      } else {
        return false;
      }
    } else if (type->kind() == c10::TypeKind::ScalarTypeType) {
      classes->push_back(ArgClass::DType);
    } else {
      classes->push_back(ArgClass::Attribute);
    }
  }
  if (returns_list(schema)) return true;
  for (const auto& ret : schema.returns()) {
    if (ret.real_type()->kind() != c10::TypeKind::TensorType) return false;
  }
  return true;
}

// ---- Autograd kernel

// The key set of a call whose arguments are all plain CPU tensors, as an Autograd kernel sees it.
constexpr c10::DispatchKeySet kPlainCpu =
    c10::DispatchKeySet(c10::DispatchKey::CPU) | c10::DispatchKeySet(c10::DispatchKey::AutogradCPU);

// Whether any tensor in an argument (a tensor, Tensor[] or Tensor?[]) satisfies `pred`.
template <class Pred>
bool any_tensor(const c10::IValue& value, const Pred& pred) {
  if (value.isTensor()) return pred(value.toTensor());
  if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList()) {
      if (pred(t)) return true;
    }
    return false;
  }
  if (value.isList()) {  // Tensor?[]
    for (const c10::IValue& item : value.toListRef()) {
      if (any_tensor(item, pred)) return true;
    }
  }
  return false;
}

// The work autograd has in a call: none, a gradient to record (grad mode on and a tensor requiring
// one), or a forward-mode tangent to carry (at level 0, where torch.autograd.forward_ad and an
// unnested torch.func.jvp put theirs; forward AD ignores grad mode), which uniop's ops refuse.
enum class AutogradWork { kNone, kGradient, kTangent };

AutogradWork autograd_work(const torch::jit::Stack& stack, size_t num_args) {
  const bool grad_mode = c10::GradMode::is_enabled();
  bool gradient = false;
  const auto tangent = [&](const at::Tensor& t) {
    gradient = gradient || (grad_mode && t.defined() && t.requires_grad());
    return t.defined() && t._fw_grad(/*level=*/0).defined();
  };
  for (size_t i = stack.size() - num_args; i < stack.size(); ++i) {
    if (any_tensor(stack[i], tangent)) return AutogradWork::kTangent;
  }
  return gradient ? AutogradWork::kGradient : AutogradWork::kNone;
}

// How an op's backward op is called from its forward's arguments, returns and incoming gradients:
// uniop.torch's `_BackwardWiring` (the core's `uniop::autograd` wiring with what torch needs
// besides), resolved once at registration and handed over as plain numbers, so that recording
// and running the graph node needs no Python.
struct Wiring {
  enum Source : int64_t { kGrad = 0, kArg = 1, kOut = 2, kNeeds = 3, kDefault = 4 };
  // How the node reads one forward argument.
  enum ArgKind { kTensorArg, kListArg, kAttrArg };

  c10::OperatorHandle backward;
  std::vector<ArgKind> args;                         // per forward argument
  std::vector<std::pair<Source, int64_t>> sources;   // per backward argument
  std::vector<int64_t> grad_of;                      // per backward return: the forward argument
  std::vector<std::pair<int64_t, std::string>> no_grad_message;  // arguments given no gradient
  std::vector<bool> differentiable;                  // per forward return
  std::vector<int64_t> gradient_index;               // per differentiable return: its index among them
  std::vector<int64_t> saved_args, saved_outs;       // forward arguments and returns the backward reads
  std::vector<std::string> saved_keys;               // per forward argument: its key in a node's saved data
};

// Every op's wiring lives as long as the process: a graph node names its op by the wiring's address
// (an int in its saved data, which compiled autograd reads as well). Only registration touches this
// list; calls read their wiring through the pointer their kernel holds.
std::vector<std::unique_ptr<const Wiring>>& wirings() {
  static auto* all = new std::vector<std::unique_ptr<const Wiring>>();
  return *all;
}

const Wiring& wiring_at(const c10::IValue& address) {
  return *reinterpret_cast<const Wiring*>(static_cast<intptr_t>(address.toInt()));
}

// One call being recorded: what the node's forward needs beyond its tensors.
struct Recording {
  const c10::OperatorHandle* op;
  c10::DispatchKeySet keyset;
  torch::jit::Stack* stack;
  const Wiring* wiring;
  std::vector<int64_t> layout;  // per forward argument: tensors it holds (0: None), -1 for others
  torch::autograd::variable_list returns;  // the op's returns, as it made them
};

// The graph node of a uniop op with a backward op, as a C++ custom autograd Function: its forward
// runs the op below autograd and saves what the backward op reads; its backward calls the backward
// op through the dispatcher. What the Python `autograd.Function` of `_autograd_kernel` does, with
// the same gradients, in a fraction of the time (no Python frame, GIL or ctx object per call).
// torch::autograd::Function's node materialises missing output gradients as zeros, checks saved
// tensors' versions, runs saved-tensor hooks and takes part in compiled autograd.
struct UniopFunction : public torch::autograd::Function<UniopFunction> {
  // `inputs` are the call's tensors in argument order, list items in place, Nones left out.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                Recording* call) {
    const Wiring& w = *call->wiring;
    torch::jit::Stack& stack = *call->stack;
    const size_t first = stack.size() - w.args.size();
    ctx->saved_data["op"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(call->wiring));
    ctx->saved_data["layout"] = call->layout;
    const std::vector<int64_t> starts = flat_starts(call->layout);
    torch::autograd::variable_list to_save;
    for (int64_t i : w.saved_args) {
      if (w.args[i] == Wiring::kAttrArg) {
        ctx->saved_data[w.saved_keys[i]] = stack[first + i];
      } else if (call->layout[i] == 0) {
        to_save.emplace_back();  // an optional tensor given as None
      } else {
        for (int64_t k = 0; k < call->layout[i]; ++k) to_save.push_back(inputs[starts[i] + k]);
      }
    }
    call->op->redispatchBoxed(call->keyset & c10::after_autograd_keyset, &stack);
    const size_t num_returns = call->op->schema().returns().size();
    torch::autograd::variable_list outputs;
    for (size_t r = stack.size() - num_returns; r < stack.size(); ++r) outputs.push_back(stack[r].toTensor());
    torch::jit::drop(stack, num_returns);
    for (int64_t r : w.saved_outs) to_save.push_back(outputs[r]);
    ctx->save_for_backward(std::move(to_save));
    // Only the differentiable returns leave through the node; the others (rstd, lse) bypass it, as
    // plain tensors needing no gradient. (ctx->mark_non_differentiable would do the same, but
    // compiled autograd refuses a C++ node that used it.)
    torch::autograd::variable_list differentiable;
    call->returns = std::move(outputs);
    for (size_t r = 0; r < call->returns.size(); ++r) {
      if (w.differentiable[r]) differentiable.push_back(call->returns[r]);
    }
    return differentiable;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Wiring& w = wiring_at(ctx->saved_data["op"]);
    const std::vector<int64_t> layout = ctx->saved_data["layout"].toIntVector();
    const std::vector<int64_t> starts = flat_starts(layout);
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const auto arg_needs_grad = [&](int64_t i) {
      for (int64_t k = 0; k < std::max<int64_t>(layout[i], 0); ++k) {
        if (ctx->needs_input_grad(starts[i] + k)) return true;
      }
      return false;
    };
    // Where each saved argument's tensors start among the saved variables; the outputs follow.
    c10::SmallVector<int64_t, 8> saved_at(layout.size(), -1);
    size_t next = 0;
    for (int64_t i : w.saved_args) {
      if (w.args[i] == Wiring::kAttrArg) continue;
      saved_at[i] = static_cast<int64_t>(next);
      next += layout[i] == 0 ? 1 : layout[i];
    }
    const auto& bwd_schema = w.backward.schema();
    torch::jit::Stack stack;
    stack.reserve(w.sources.size());
    for (size_t j = 0; j < w.sources.size(); ++j) {
      const auto [kind, i] = w.sources[j];
      switch (kind) {
        case Wiring::kGrad:
          stack.emplace_back(grads[w.gradient_index[i]]);
          break;
        case Wiring::kArg:
          if (w.args[i] == Wiring::kAttrArg) {
            stack.push_back(ctx->saved_data[w.saved_keys[i]]);
          } else if (w.args[i] == Wiring::kListArg) {
            stack.emplace_back(std::vector<at::Tensor>(saved.begin() + saved_at[i],
                                                       saved.begin() + saved_at[i] + layout[i]));
          } else if (layout[i] == 0) {
            stack.emplace_back();
          } else {
            stack.emplace_back(saved[saved_at[i]]);
          }
          break;
        case Wiring::kOut:
          stack.emplace_back(saved[next + (std::find(w.saved_outs.begin(), w.saved_outs.end(), i) -
                                           w.saved_outs.begin())]);
          break;
        case Wiring::kNeeds:
          stack.emplace_back(arg_needs_grad(i));
          break;
        case Wiring::kDefault:
          stack.push_back(*bwd_schema.arguments()[j].default_value());
          break;
      }
    }
    for (const auto& [i, message] : w.no_grad_message) {
      TORCH_CHECK(!arg_needs_grad(i), message);
    }
    w.backward.callBoxed(&stack);
    // One gradient per input tensor, in the forward's order, plus none for the Recording.
    torch::autograd::variable_list result(starts.back() + 1);
    const auto place = [&](int64_t i, const at::Tensor& g, int64_t k) {
      if (ctx->needs_input_grad(starts[i] + k)) result[starts[i] + k] = g;
    };
    if (bwd_schema.returns().size() == 1 && stack[0].isTensorList()) {
      const int64_t i = w.grad_of[0];
      const auto list = stack[0].toTensorVector();
      for (int64_t k = 0; k < std::min<int64_t>(layout[i], list.size()); ++k) place(i, list[k], k);
    } else {
      for (size_t r = 0; r < w.grad_of.size(); ++r) {
        const int64_t i = w.grad_of[r];
        if (layout[i] > 0) place(i, stack[r].toTensor(), 0);
      }
    }
    return result;
  }

  // Per forward argument, the index of its first tensor among the node's inputs; one more entry,
  // the count of them all.
  static std::vector<int64_t> flat_starts(const std::vector<int64_t>& layout) {
    std::vector<int64_t> starts(layout.size() + 1, 0);
    for (size_t i = 0; i < layout.size(); ++i) starts[i + 1] = starts[i] + std::max<int64_t>(layout[i], 0);
    return starts;
  }
};

class AutogradKernel final : public c10::OperatorKernel {
 public:
  // `generic` is uniop.torch's generic autograd kernel for this op: generic(keyset, *args, **kwargs).
  // It is held for the life of the process and deliberately never released: the dispatcher may
  // destroy this functor after the interpreter has finalized, when no reference may be dropped.
  // `wiring` (one of wirings(), or null) records calls needing a gradient in C++.
  AutogradKernel(py::object generic, const Wiring* wiring) : generic_(generic.release().ptr()), wiring_(wiring) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    const size_t num_args = op.schema().arguments().size();
    if (keyset == kPlainCpu) {
      const AutogradWork work = autograd_work(*stack, num_args);
      if (work == AutogradWork::kNone) {
        op.redispatchBoxed(keyset & c10::after_autograd_keyset, stack);
        return;
      }
      // Under torch.func's transforms (whose layers keep their dispatch keys included while any is on
      // the stack) the call takes the generic route, which records at the level the dispatcher has
      // reached; so does a tangent, which it refuses.
      if (work == AutogradWork::kGradient && wiring_ != nullptr &&
          !c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerBackMode)) {
        record(op, keyset, stack, num_args);
        return;
      }
    }
    call_generic(op, keyset, stack, num_args);
  }

 private:
  void record(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack, size_t num_args) {
    const Wiring& w = *wiring_;
    Recording call{&op, keyset, stack, wiring_, std::vector<int64_t>(num_args, -1)};
    std::vector<at::Tensor> inputs;
    const size_t first = stack->size() - num_args;
    for (size_t i = 0; i < num_args; ++i) {
      const c10::IValue& v = (*stack)[first + i];
      if (w.args[i] == Wiring::kListArg) {
        const c10::List<at::Tensor> items = v.toTensorList();
        for (const at::Tensor& t : items) inputs.push_back(t);
        call.layout[i] = static_cast<int64_t>(items.size());
      } else if (w.args[i] == Wiring::kTensorArg) {
        const bool given = !absent(v);
        if (given) inputs.push_back(v.toTensor());
        call.layout[i] = given;
      }
    }
    const torch::autograd::variable_list differentiable = UniopFunction::apply(at::TensorList(inputs), &call);
    for (size_t r = 0, d = 0; r < call.returns.size(); ++r) {
      stack->push_back(w.differentiable[r] ? differentiable[d++] : std::move(call.returns[r]));
    }
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
    if (returns.empty()) return;
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
  const Wiring* wiring_;
};

// ---- Registration

// The IMPL fragments holding the registrations: they live as long as the process (a registration
// ends when its Library is destroyed, and ops are never unregistered).
void keep(std::unique_ptr<torch::Library> lib) {
  static auto* libs = new std::vector<std::unique_ptr<torch::Library>>();
  libs->push_back(std::move(lib));
}

void init(py::capsule abi) {
  auto* table = static_cast<const TorchAbi*>(PyCapsule_GetPointer(abi.ptr(), kCapsuleName));
  if (table == nullptr) throw py::error_already_set();
  TORCH_CHECK(table->version == kTorchAbiVersion, "uniop: the C++ torch kernels speak ABI version ",
              kTorchAbiVersion, " but uniop._native offers ", table->version,
              "; rebuild them: python -m uniop.torch.build_kernels");
  g_abi = table;
}

bool register_cpu(const std::string& ns, const std::string& name, uintptr_t handle) {
  TORCH_CHECK(g_abi != nullptr, "uniop: init() the C++ torch kernels before registering");
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + name).c_str(), "");
  std::vector<ArgClass> classes;
  if (!classify(op.schema(), &classes)) return false;
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CPU, __FILE__, __LINE__);
  auto kernel =
      std::make_unique<CpuKernel>(reinterpret_cast<const void*>(handle), std::move(classes), returns_list(op.schema()));
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
  keep(std::move(lib));
  return true;
}

// How the node reads each argument of `schema`, from the CPU kernel's classification; false for an
// op whose calls it does not record (a mutated argument, one the CPU kernel does not convert, no
// return or a list return): those record through the Python kernel.
bool classify_for_autograd(const c10::FunctionSchema& schema, std::vector<Wiring::ArgKind>* kinds) {
  std::vector<ArgClass> classes;
  if (!classify(schema, &classes) || schema.returns().empty() || returns_list(schema)) return false;
  for (ArgClass c : classes) {
    switch (c) {
      case ArgClass::MutatedTensor:
        return false;
      case ArgClass::Tensor:
        kinds->push_back(Wiring::kTensorArg);
        break;
      case ArgClass::TensorList:
        kinds->push_back(Wiring::kListArg);
        break;
      case ArgClass::DType:
      case ArgClass::Attribute:
        kinds->push_back(Wiring::kAttrArg);
        break;
    }
  }
  return true;
}

// `wiring` is uniop.torch's `_BackwardWiring` in numbers: (backward op name, sources as (kind, index)
// pairs, grad_of, (argument, message) pairs, differentiable per return, saved_args, saved_outs).
void register_autograd(const std::string& ns, const std::string& name, py::object generic, py::tuple wiring) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + name).c_str(), "");
  auto w = std::make_unique<Wiring>(Wiring{
      c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + wiring[0].cast<std::string>()).c_str(), ""),
  });
  const Wiring* recorded = nullptr;
  if (classify_for_autograd(op.schema(), &w->args)) {
    for (const auto& [kind, i] : wiring[1].cast<std::vector<std::pair<int64_t, int64_t>>>()) {
      w->sources.emplace_back(static_cast<Wiring::Source>(kind), i);
    }
    w->grad_of = wiring[2].cast<std::vector<int64_t>>();
    w->no_grad_message = wiring[3].cast<std::vector<std::pair<int64_t, std::string>>>();
    w->differentiable = wiring[4].cast<std::vector<bool>>();
    w->gradient_index.assign(w->differentiable.size(), -1);
    for (size_t r = 0, d = 0; r < w->differentiable.size(); ++r) {
      if (w->differentiable[r]) w->gradient_index[r] = static_cast<int64_t>(d++);
    }
    w->saved_args = wiring[5].cast<std::vector<int64_t>>();
    w->saved_outs = wiring[6].cast<std::vector<int64_t>>();
    for (size_t i = 0; i < w->args.size(); ++i) w->saved_keys.push_back("arg" + std::to_string(i));
    recorded = w.get();
    wirings().push_back(std::move(w));
  }
  auto lib =
      std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::Autograd, __FILE__, __LINE__);
  auto kernel = std::make_unique<AutogradKernel>(generic, recorded);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
  keep(std::move(lib));
}

// An op without a backward op gets torch's not-implemented autograd kernel: differentiating through it
// (backward, double backward through a backward op, forward AD) raises "the derivative for
// 'uniop::<op>' is not implemented". Without a kernel, torch's default fallback only warns and lets the
// gradient through as none or zero.
void register_no_backward(const std::string& ns, const std::string& name) {
  auto lib =
      std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::Autograd, __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::autograd::autogradNotImplementedFallback());
  keep(std::move(lib));
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "uniop's C++ CPU and Autograd kernels for torch.ops.uniop (see uniop/torch/csrc/kernels.cpp).";
  m.def("init", &init, py::arg("abi"), "Takes the C ABI table from uniop._native._torch_abi().");
  m.def("register_cpu", &register_cpu, py::arg("namespace"), py::arg("name"), py::arg("handle"),
        "Registers the C++ CPU kernel for namespace::name (op handle from Op._torch_handle()); "
        "False when the schema has an argument type it does not convert.");
  m.def("register_autograd", &register_autograd, py::arg("namespace"), py::arg("name"), py::arg("generic"),
        py::arg("wiring"),
        "Registers the C++ Autograd kernel for namespace::name: calls on plain CPU tensors needing a gradient "
        "record a C++ graph node calling the backward op as `wiring` says; other calls needing autograd go to "
        "`generic`.");
  m.def("register_no_backward", &register_no_backward, py::arg("namespace"), py::arg("name"),
        "Registers torch's not-implemented Autograd kernel for namespace::name, an op without a backward.");
  m.def(
      "tensor_io", [] { return py::capsule(const_cast<TensorIo*>(&kTensorIo), kTensorIoName); },
      "The functions uniop.<op> makes torch outputs and reads torch inputs with, for "
      "uniop._native._use_torch_tensors.");
}
