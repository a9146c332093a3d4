// One XLA FFI handler that runs any PyTorch operator inside an XLA program.
//
// XLA hands the handler its operand and result buffers; the handler views them as
// tensors (no copy), builds the operator's arguments from the call's description (the
// attribute "call", written by dynajax/ffi/call.py), and calls the operator through the
// ATen dispatcher by its name, as eager PyTorch would: aten's kernels and a user's C++
// custom ops alike. Where the description names an out= overload, the operator writes
// straight into XLA's result buffers; otherwise its results are copied into them.
// An exception the operator raises (TORCH_CHECK) comes back to XLA as an error whose
// message starts with "dynajax-torch-error[<Python type>]: ", which dynajax re-raises
// as eager's exception.
//
// The description, "<operand dtypes>|<result dtypes>|<arguments>":
//   dtypes     ScalarType codes, comma-separated: the dtype the operator takes for
//              each operand (a buffer of another dtype is converted), and gives for
//              each result.
//   arguments  one value per schema argument, ';'-separated, each one of
//              N (None)  T<i> (operand i)  R<i> (result i, an out= argument)
//              S<i>:<sizes>:<strides>:<offset> (a view of operand i, as eager's view
//              of the same storage: sizes and strides '.'-separated; a transpose or
//              a slice XLA then need not copy)
//              i<int>  f<float>  b0 | b1  c<re>,<im>  s<len>:<text>  D<len>:<device>
//              [<value>,<value>,...] (a list, typed by the schema)

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct BadCall : std::runtime_error {
  using std::runtime_error::runtime_error;
};

at::ScalarType torch_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return at::kBool;
    case ffi::DataType::S8: return at::kChar;
    case ffi::DataType::S16: return at::kShort;
    case ffi::DataType::S32: return at::kInt;
    case ffi::DataType::S64: return at::kLong;
    case ffi::DataType::U8: return at::kByte;
    case ffi::DataType::U16: return at::kUInt16;
    case ffi::DataType::U32: return at::kUInt32;
    case ffi::DataType::U64: return at::kUInt64;
    case ffi::DataType::F16: return at::kHalf;
    case ffi::DataType::BF16: return at::kBFloat16;
    case ffi::DataType::F32: return at::kFloat;
    case ffi::DataType::F64: return at::kDouble;
    case ffi::DataType::C64: return at::kComplexFloat;
    case ffi::DataType::C128: return at::kComplexDouble;
    default: throw BadCall("a buffer of a dtype PyTorch has no tensor for");
  }
}

at::Tensor view(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  std::vector<int64_t> sizes(dims.begin(), dims.end());
  auto options = at::TensorOptions().dtype(torch_dtype(buffer.element_type()));
  // XLA's buffers on the CPU are dense, row-major: a contiguous tensor views them.
  return at::from_blob(buffer.untyped_data(), sizes, options);
}

class Parser {
 public:
  Parser(std::string_view text, const std::vector<at::Tensor>& operands,
         const std::vector<at::Tensor>& results)
      : text_(text), operands_(operands), results_(results) {}

  std::vector<at::ScalarType> dtypes() {
    std::vector<at::ScalarType> out;
    while (peek() != '|') {
      out.push_back(static_cast<at::ScalarType>(integer()));
      if (peek() == ',') ++pos_;
    }
    ++pos_;
    return out;
  }

  c10::IValue value(const c10::TypePtr& type) {
    char c = next();
    switch (c) {
      case 'N': return c10::IValue();
      case 'T': return index(operands_);
      case 'R': return index(results_);
      case 'S': {
        at::Tensor base = index(operands_).toTensor();
        expect(':');
        std::vector<int64_t> sizes = numbers();
        expect(':');
        std::vector<int64_t> strides = numbers();
        expect(':');
        int64_t offset = integer();
        if (sizes.size() != strides.size()) throw BadCall("a view's sizes and strides differ in rank");
        int64_t last = offset;  // the view's last element must lie in the base's buffer
        for (size_t d = 0; d < sizes.size(); ++d) {
          if (sizes[d] == 0) last = -1;
          if (last >= 0) last += (sizes[d] - 1) * strides[d];
        }
        if (offset < 0 || last >= base.numel()) throw BadCall("a view outside its base's buffer");
        return c10::IValue(base.as_strided(sizes, strides, offset));
      }
      case 'i': return c10::IValue(integer());
      case 'f': return c10::IValue(real());
      case 'b': return c10::IValue(next() == '1');
      case 'c': {
        double re = real();
        expect(',');
        return c10::IValue(c10::complex<double>(re, real()));
      }
      case 's': return c10::IValue(text());
      case 'D': return c10::IValue(c10::Device(text()));
      case '[': return list(type);
      default: throw BadCall(std::string("unexpected '") + c + "' in the call's arguments");
    }
  }

  bool at_end() const { return pos_ >= text_.size(); }
  void separator() {
    if (!at_end()) expect(';');
  }

 private:
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  char next() {
    if (at_end()) throw BadCall("the call's arguments end early");
    return text_[pos_++];
  }
  void expect(char c) {
    if (next() != c) throw BadCall(std::string("expected '") + c + "' in the call's arguments");
  }
  std::string token() {
    size_t end = text_.find_first_of(",;]|:", pos_);
    if (end == std::string_view::npos) end = text_.size();
    std::string out(text_.substr(pos_, end - pos_));
    pos_ = end;
    return out;
  }
  int64_t integer() { return std::strtoll(token().c_str(), nullptr, 10); }
  std::vector<int64_t> numbers() {  // '.'-separated; none for an empty token
    std::string text = token();
    std::vector<int64_t> out;
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find('.', start);
      if (end == std::string::npos) end = text.size();
      out.push_back(std::strtoll(text.substr(start, end - start).c_str(), nullptr, 10));
      start = end + 1;
    }
    return out;
  }
  double real() { return std::strtod(token().c_str(), nullptr); }
  std::string text() {
    size_t length = static_cast<size_t>(integer());
    expect(':');
    std::string out(text_.substr(pos_, length));
    pos_ += length;
    return out;
  }
  c10::IValue index(const std::vector<at::Tensor>& tensors) {
    int64_t i = integer();
    if (i < 0 || static_cast<size_t>(i) >= tensors.size()) throw BadCall("a buffer index out of range");
    return c10::IValue(tensors[i]);
  }

  c10::IValue list(const c10::TypePtr& type) {
    c10::TypePtr t = type;
    if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
    auto list_type = t->cast<c10::ListType>();
    if (!list_type) throw BadCall("a list where the schema takes " + type->str());
    c10::TypePtr element = list_type->getElementType();
    std::vector<c10::IValue> items;
    while (peek() != ']') {
      items.push_back(value(element));
      if (peek() == ',') ++pos_;
    }
    ++pos_;
    switch (element->kind()) {
      case c10::TypeKind::IntType:
      case c10::TypeKind::SymIntType: {
        c10::List<int64_t> out;
        for (auto& v : items) out.push_back(v.toInt());
        return out;
      }
      case c10::TypeKind::FloatType: {
        c10::List<double> out;
        for (auto& v : items) out.push_back(v.toDouble());
        return out;
      }
      case c10::TypeKind::BoolType: {
        c10::List<bool> out;
        for (auto& v : items) out.push_back(v.toBool());
        return out;
      }
      case c10::TypeKind::TensorType: {
        c10::List<at::Tensor> out;
        for (auto& v : items) out.push_back(v.toTensor());
        return out;
      }
      case c10::TypeKind::OptionalType: {
        c10::List<std::optional<at::Tensor>> out;
        for (auto& v : items) {
          out.push_back(v.isNone() ? std::optional<at::Tensor>() : std::optional(v.toTensor()));
        }
        return out;
      }
      default:
        throw BadCall("a list of " + element->str() + ", which dynajax does not pass");
    }
  }

  std::string_view text_;
  size_t pos_ = 0;
  const std::vector<at::Tensor>& operands_;
  const std::vector<at::Tensor>& results_;
};

void flatten(const c10::IValue& value, std::vector<at::Tensor>& out) {
  if (value.isTensor()) {
    out.push_back(value.toTensor());  // (undefined: a result the op did not compute)
  } else if (value.isTuple()) {
    for (const auto& v : value.toTupleRef().elements()) flatten(v, out);
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorVector()) out.push_back(t);
  } else if (value.isList()) {
    for (const auto& v : value.toListRef()) flatten(v, out);
  } else if (!value.isNone()) {
    throw BadCall("the operator returned " + value.tagKind() + " where a tensor was expected");
  }
}

void run(ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view name,
         std::string_view overload, std::string_view call) {
  std::vector<at::Tensor> operands, results;
  for (size_t i = 0; i < args.size(); ++i) operands.push_back(view(*args.get<ffi::AnyBuffer>(i)));
  for (size_t i = 0; i < rets.size(); ++i) results.push_back(view(**rets.get<ffi::AnyBuffer>(i)));

  Parser parser(call, operands, results);
  std::vector<at::ScalarType> operand_dtypes = parser.dtypes();
  std::vector<at::ScalarType> result_dtypes = parser.dtypes();
  if (operand_dtypes.size() != operands.size() || result_dtypes.size() != results.size()) {
    throw BadCall("the call's dtypes do not match its buffers");
  }
  // A buffer XLA keeps in another dtype (an int64 index as int32 without JAX's 64-bit
  // mode) is converted to the one the operator takes.
  for (size_t i = 0; i < operands.size(); ++i) {
    if (operands[i].scalar_type() != operand_dtypes[i]) operands[i] = operands[i].to(operand_dtypes[i]);
  }
  std::vector<at::Tensor> targets = results;
  for (size_t i = 0; i < results.size(); ++i) {
    if (results[i].scalar_type() != result_dtypes[i]) {
      results[i] = at::empty(results[i].sizes(), results[i].options().dtype(result_dtypes[i]));
    }
  }

  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(
      std::string(name).c_str(), std::string(overload).c_str());
  const auto& schema = handle.schema();
  torch::jit::Stack stack;
  for (const auto& argument : schema.arguments()) {
    if (parser.at_end()) throw BadCall("fewer arguments than " + schema.name() + " takes");
    stack.push_back(parser.value(argument.type()));
    parser.separator();
  }
  if (!parser.at_end()) throw BadCall("more arguments than " + schema.name() + " takes");

  {
    // The operator's own kernel, as eager runs it on tensors without grad: no autograd
    // recording, no Python modes (this thread does not hold the GIL).
    c10::impl::ExcludeDispatchKeyGuard no_python(c10::DispatchKeySet(
        {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
         c10::DispatchKey::PythonDispatcher}));
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    handle.callBoxed(stack);
  }

  std::vector<at::Tensor> outs;
  for (const auto& v : stack) flatten(v, outs);
  if (outs.size() != results.size()) {
    // The results the op was asked not to compute are Nones, which XLA has no buffer for.
    std::vector<at::Tensor> defined;
    for (const auto& t : outs) {
      if (t.defined()) defined.push_back(t);
    }
    outs = std::move(defined);
  }
  if (outs.size() != results.size()) {
    throw BadCall(schema.name() + " returned " + std::to_string(outs.size()) +
                  " tensors where XLA expects " + std::to_string(results.size()));
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!outs[i].defined()) {
      // An empty result (a workspace the kernel did not need) may come back undefined.
      if (targets[i].numel() == 0) continue;
      throw BadCall(schema.name() + " returned no tensor where its fake tensor promised " +
                    c10::str(targets[i].sizes()));
    }
    if (outs[i].sizes() != targets[i].sizes()) {
      throw BadCall(schema.name() + " returned shape " + c10::str(outs[i].sizes()) +
                    " where its fake tensor promised " + c10::str(targets[i].sizes()) +
                    ": its output shape depends on the data");
    }
    if (outs[i].data_ptr() != targets[i].data_ptr() || !outs[i].is_contiguous()) {
      targets[i].copy_(outs[i]);
    }
  }
}

ffi::Error error(const char* type, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("dynajax-torch-error[") + type + "]: " + message);
}

// The Python exception eager raises for a c10 error (torch/csrc/Exceptions.h's mapping).
const char* python_type(const c10::Error& e) {
  if (dynamic_cast<const c10::IndexError*>(&e)) return "IndexError";
  if (dynamic_cast<const c10::ValueError*>(&e)) return "ValueError";
  if (dynamic_cast<const c10::TypeError*>(&e)) return "TypeError";
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) return "NotImplementedError";
  if (dynamic_cast<const c10::LinAlgError*>(&e)) return "LinAlgError";
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) return "OutOfMemoryError";
  return "RuntimeError";
}

ffi::Error TorchOpImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view name,
                       std::string_view overload, std::string_view call) {
  try {
    run(args, rets, name, overload, call);
    return ffi::Error::Success();
  } catch (const c10::Error& e) {
    return error(python_type(e), e.what_without_backtrace());
  } catch (const BadCall& e) {
    return error("DynajaxError", e.what());
  } catch (const std::exception& e) {
    return error("RuntimeError", e.what());
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynajaxTorchOp, TorchOpImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::string_view>("op")
                                  .Attr<std::string_view>("overload")
                                  .Attr<std::string_view>("call"));
