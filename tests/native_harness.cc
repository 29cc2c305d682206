// Calls a native kernel's XLA FFI handler as XLA:CPU would, on buffers the
// caller owns (tests/native_harness.py). It builds the XLA_FFI_CallFrame the
// handler decodes (buffers, scalar attributes sorted by name, the execute
// stage) and an XLA_FFI_Api of its own with the calls the handlers make:
// errors, and the intra-op thread pool, whose tasks run on threads started
// here and joined before the call returns. Only c_api.h is needed, so the
// harness builds in about a second against the installed jaxlib's headers;
// it names no type or field that changed between jaxlib 0.10 and 0.12 (the
// context's type, the error-message call, which only a failed Schedule needs).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/c_api.h"

// The opaque error type of the C API, defined by whoever implements the API.
struct XLA_FFI_Error {
  std::string message;
};

namespace {

// The pool the handler sees: `threads` threads, one started per task.
struct Pool {
  int64_t threads = 0;
  std::mutex mu;
  std::vector<std::thread> started;
};

XLA_FFI_Error* ErrorCreate(XLA_FFI_Error_Create_Args* args) {
  return new XLA_FFI_Error{args->message ? args->message : ""};
}

void ErrorDestroy(XLA_FFI_Error_Destroy_Args* args) { delete args->error; }

XLA_FFI_Error* Schedule(XLA_FFI_ThreadPool_Schedule_Args* args) {
  Pool* pool = reinterpret_cast<Pool*>(args->ctx);
  if (pool->threads == 0) {  // no pool: the caller runs it (handlers do not ask)
    args->task(args->data);
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(pool->mu);
  pool->started.emplace_back(args->task, args->data);
  return nullptr;
}

XLA_FFI_Error* NumThreads(XLA_FFI_ThreadPool_NumThreads_Args* args) {
  *args->num_threads = reinterpret_cast<Pool*>(args->ctx)->threads;
  return nullptr;
}

XLA_FFI_Api MakeApi() {
  XLA_FFI_Api api;
  std::memset(&api, 0, sizeof(api));
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.api_version = {XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR,
                     XLA_FFI_API_MINOR};
  api.XLA_FFI_Error_Create = ErrorCreate;
  api.XLA_FFI_Error_Destroy = ErrorDestroy;
  api.XLA_FFI_ThreadPool_Schedule = Schedule;
  api.XLA_FFI_ThreadPool_NumThreads = NumThreads;
  return api;
}

// Buffers `count` of them: dtypes, data, ranks and all their dims in a row.
std::vector<XLA_FFI_Buffer> Buffers(int64_t count, const int32_t* dtypes,
                                    void* const* data, const int64_t* ranks,
                                    int64_t* dims) {
  std::vector<XLA_FFI_Buffer> out(count);
  for (int64_t i = 0; i < count; ++i) {
    out[i] = {XLA_FFI_Buffer_STRUCT_SIZE, nullptr,
              static_cast<XLA_FFI_DataType>(dtypes[i]), data[i], ranks[i], dims};
    dims += ranks[i];
  }
  return out;
}

}  // namespace

// Runs handler(call frame) with `threads` pool threads (0: a pool of none,
// whose tasks would run on the caller). Attributes are scalars, their names
// sorted: attr_dtypes[i] is an XLA_FFI_DataType (S64, F32 or F64) and
// attr_values[i] holds its bits (an F32 in the slot's first four bytes).
// Returns 0, or 1 with the handler's error message copied into `message`.
extern "C" int tj_harness_call(void* handler, int64_t threads, int64_t nargs,
                               const int32_t* arg_dtypes, void* const* arg_data,
                               const int64_t* arg_ranks, int64_t* arg_dims,
                               int64_t nrets, const int32_t* ret_dtypes,
                               void* const* ret_data, const int64_t* ret_ranks,
                               int64_t* ret_dims, int64_t nattrs,
                               const char* const* attr_names,
                               const int32_t* attr_dtypes, int64_t* attr_values,
                               char* message, int64_t message_size) {
  static const XLA_FFI_Api api = MakeApi();
  std::vector<XLA_FFI_Buffer> args =
      Buffers(nargs, arg_dtypes, arg_data, arg_ranks, arg_dims);
  std::vector<XLA_FFI_Buffer> rets =
      Buffers(nrets, ret_dtypes, ret_data, ret_ranks, ret_dims);
  std::vector<XLA_FFI_ArgType> arg_types(nargs, XLA_FFI_ArgType_BUFFER);
  std::vector<XLA_FFI_RetType> ret_types(nrets, XLA_FFI_RetType_BUFFER);
  std::vector<void*> arg_ptrs, ret_ptrs, attr_ptrs;
  for (auto& b : args) arg_ptrs.push_back(&b);
  for (auto& b : rets) ret_ptrs.push_back(&b);
  std::vector<XLA_FFI_ByteSpan> names(nattrs);
  std::vector<XLA_FFI_ByteSpan*> name_ptrs;
  std::vector<XLA_FFI_Scalar> scalars(nattrs);
  std::vector<XLA_FFI_AttrType> attr_types(nattrs, XLA_FFI_AttrType_SCALAR);
  for (int64_t i = 0; i < nattrs; ++i) {
    names[i] = {attr_names[i], std::strlen(attr_names[i])};
    name_ptrs.push_back(&names[i]);
    scalars[i] = {static_cast<XLA_FFI_DataType>(attr_dtypes[i]), &attr_values[i]};
    attr_ptrs.push_back(&scalars[i]);
  }
  Pool pool;
  pool.threads = threads;
  XLA_FFI_CallFrame frame;
  std::memset(&frame, 0, sizeof(frame));
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.api = &api;
  frame.ctx = reinterpret_cast<decltype(frame.ctx)>(&pool);
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args = {XLA_FFI_Args_STRUCT_SIZE, nullptr, nargs, arg_types.data(),
                arg_ptrs.data()};
  frame.rets = {XLA_FFI_Rets_STRUCT_SIZE, nullptr, nrets, ret_types.data(),
                ret_ptrs.data()};
  frame.attrs = {XLA_FFI_Attrs_STRUCT_SIZE, nullptr, nattrs, attr_types.data(),
                 name_ptrs.data(), attr_ptrs.data()};
  auto fn = reinterpret_cast<XLA_FFI_Handler*>(handler);
  XLA_FFI_Error* error = fn(&frame);
  for (std::thread& t : pool.started) t.join();
  if (error == nullptr) return 0;
  std::snprintf(message, static_cast<size_t>(message_size), "%s",
                error->message.c_str());
  delete error;
  return 1;
}
