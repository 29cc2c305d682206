// Shared helpers for tunedjax's native CPU kernels (XLA FFI handlers).
//
// parallel_for(pool, chunks, fn) runs fn(chunk) for chunk in [0, chunks) on
// XLA's intra-op thread pool *and* the calling thread. The calling thread
// takes chunks too, so the loop finishes even when every pool thread is busy
// (or the pool has a single thread): it never blocks on a task that has not
// started. Tasks that start after the last chunk was taken find nothing to do
// and return; the shared state they hold is reference counted.
//
// Which chunk does which work is fixed by the caller, never by the thread
// that runs it, so results are bitwise the same from run to run.
#ifndef TUNEDJAX_CSRC_TJ_PARALLEL_H_
#define TUNEDJAX_CSRC_TJ_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace tunedjax {

namespace ffi = xla::ffi;

struct LoopState {
  std::function<void(int64_t)> fn;
  int64_t chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  // Takes and runs chunks until none is left.
  void Drain() {
    for (int64_t i = next.fetch_add(1); i < chunks; i = next.fetch_add(1)) {
      fn(i);
      if (done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

inline void parallel_for(ffi::ThreadPool& pool, int64_t chunks,
                         std::function<void(int64_t)> fn) {
  if (chunks <= 0) return;
  if (chunks == 1) {
    fn(0);
    return;
  }
  auto state = std::make_shared<LoopState>();
  state->fn = std::move(fn);
  state->chunks = chunks;
  int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([state] { state->Drain(); });
  }
  state->Drain();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == chunks; });
}

// Splits [0, n) into `parts` nearly equal ranges; range i is [lo, hi).
inline void split_range(int64_t n, int64_t parts, int64_t i, int64_t* lo,
                        int64_t* hi) {
  int64_t base = n / parts, extra = n % parts;
  *lo = i * base + std::min(i, extra);
  *hi = *lo + base + (i < extra ? 1 : 0);
}

}  // namespace tunedjax

// The geometry attributes of a convolution handler, as the Python side passes
// them (`_conv_native.py`, `_conv_native_direct.py`).
#define TJ_GEOMETRY_ATTRS                                                   \
  .Attr<int64_t>("stride_h").Attr<int64_t>("stride_w")                     \
      .Attr<int64_t>("pad_h").Attr<int64_t>("pad_w")                       \
      .Attr<int64_t>("lhs_dil_h").Attr<int64_t>("lhs_dil_w")               \
      .Attr<int64_t>("rhs_dil_h").Attr<int64_t>("rhs_dil_w")

// Binds a two-operand, one-result handler `tunedjax::FN<DT>` (run on XLA's
// thread pool) to the exported symbol NAME; ATTRS are further binding calls,
// or nothing (`TJ_DEFINE_BINARY(Name, Fn, ffi::F32, )`).
#define TJ_DEFINE_BINARY(NAME, FN, DT, ATTRS)                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, tunedjax::FN<DT>,                     \
                                ffi::Ffi::Bind()                            \
                                    .Ctx<ffi::ThreadPool>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Arg<ffi::Buffer<DT>>()                 \
                                    .Ret<ffi::Buffer<DT>>()                 \
                                    ATTRS);

// A convolution handler: the binary binding with the geometry attributes.
#define TJ_DEFINE(NAME, FN, DT) TJ_DEFINE_BINARY(NAME, FN, DT, TJ_GEOMETRY_ATTRS)

#endif  // TUNEDJAX_CSRC_TJ_PARALLEL_H_
