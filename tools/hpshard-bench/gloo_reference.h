// The reference of the collective benchmark: Gloo called directly, with its own
// algorithms, over its own rendezvous context (gloo::rendezvous::HashStore, a TCP device
// on 127.0.0.1) — what hpshard's Gloo backend is measured against.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/common/dtype.h"
#include "tools/hpshard-bench/coll_op.h"

namespace gloo {
class Algorithm;
namespace rendezvous {
class Context;
class Store;
}  // namespace rendezvous
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace hps::bench {

// One rank's member of a Gloo group. Gloo reports failures by throwing; callers catch.
class GlooReference {
 public:
  // Collective: every rank of `size` constructs its member on the same store and device.
  GlooReference(int32_t rank, int32_t size, ::gloo::rendezvous::Store& store,
                std::shared_ptr<::gloo::transport::Device> device,
                std::chrono::milliseconds timeout);
  ~GlooReference();
  GlooReference(const GlooReference&) = delete;
  GlooReference& operator=(const GlooReference&) = delete;

  // Collective. Sets up what `op` at `count` keeps between runs: Gloo's reduce-scatter
  // (ReduceScatterHalvingDoubling) is an algorithm object bound to its buffer, in place on
  // `work` (size() × count elements); its result lands at the start of `work`.
  void prepare(CollOp op, DType dtype, void* work, size_t count);
  // Drops what prepare() set up. Collective: every rank must have finished its runs.
  void release();

  // Runs `op` once, as hpshard-bench calls hpshard's: all_reduce send → recv (count),
  // all_gather send (count) → recv (size × count), broadcast in place on recv from rank 0,
  // reduce_scatter in place on the buffer given to prepare().
  void run(CollOp op, DType dtype, const void* send, void* recv, size_t count);

 private:
  int32_t size_;
  std::shared_ptr<::gloo::rendezvous::Context> context_;
  std::unique_ptr<::gloo::Algorithm> reduce_scatter_;
};

}  // namespace hps::bench
