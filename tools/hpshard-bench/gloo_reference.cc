#include "tools/hpshard-bench/gloo_reference.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace hps::bench {
namespace {

// Gloo's typed entry points, per element type.
template <typename T>
void run_typed(const std::shared_ptr<::gloo::rendezvous::Context>& shared, int32_t size, CollOp op,
               const void* send, void* recv, size_t count) {
  auto* in = static_cast<T*>(const_cast<void*>(send));  // Gloo never writes its inputs
  auto* out = static_cast<T*>(recv);
  switch (op) {
    case CollOp::kAllReduce: {
      ::gloo::AllreduceOptions o(shared);
      o.setAlgorithm(::gloo::AllreduceOptions::Algorithm::RING);
      o.setInput(in, count);
      o.setOutput(out, count);
      void (*sum)(void*, const void*, const void*, size_t) = &::gloo::sum<T>;
      o.setReduceFunction(sum);
      ::gloo::allreduce(o);
      return;
    }
    case CollOp::kAllGather: {
      ::gloo::AllgatherOptions o(shared);
      o.setInput(in, count);
      o.setOutput(out, count * static_cast<size_t>(size));
      ::gloo::allgather(o);
      return;
    }
    case CollOp::kBroadcast: {
      ::gloo::BroadcastOptions o(shared);
      o.setOutput(out, count);
      o.setRoot(0);
      ::gloo::broadcast(o);
      return;
    }
    case CollOp::kReduceScatter: break;  // an algorithm object, see prepare()
  }
}

template <typename T>
std::unique_ptr<::gloo::Algorithm> make_reduce_scatter(
    const std::shared_ptr<::gloo::rendezvous::Context>& context, int32_t size, void* work,
    size_t count) {
  const size_t total = count * static_cast<size_t>(size);
  if (total * sizeof(T) > static_cast<size_t>(INT32_MAX)) {
    // The algorithm keeps its byte count in an int.
    throw std::invalid_argument("Gloo's ReduceScatterHalvingDoubling takes at most 2 GiB");
  }
  std::vector<T*> ptrs{static_cast<T*>(work)};
  std::vector<int> received(static_cast<size_t>(size), static_cast<int>(count));
  return std::make_unique<::gloo::ReduceScatterHalvingDoubling<T>>(
      context, ptrs, static_cast<int>(total), received);
}

}  // namespace

GlooReference::GlooReference(int32_t rank, int32_t size, ::gloo::rendezvous::Store& store,
                             std::shared_ptr<::gloo::transport::Device> device,
                             std::chrono::milliseconds timeout)
    : size_(size) {
  context_ = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  context_->setTimeout(timeout);
  context_->connectFullMesh(store, device);
}

GlooReference::~GlooReference() = default;

void GlooReference::prepare(CollOp op, DType dtype, void* work, size_t count) {
  if (op != CollOp::kReduceScatter) return;
  switch (dtype) {
    case DType::kFloat32:
      reduce_scatter_ = make_reduce_scatter<float>(context_, size_, work, count);
      return;
    case DType::kFloat64:
      reduce_scatter_ = make_reduce_scatter<double>(context_, size_, work, count);
      return;
    default: throw std::invalid_argument("the Gloo reference supports float32 and float64");
  }
}

void GlooReference::release() { reduce_scatter_.reset(); }

void GlooReference::run(CollOp op, DType dtype, const void* send, void* recv, size_t count) {
  if (op == CollOp::kReduceScatter) {
    if (!reduce_scatter_) throw std::logic_error("reduce_scatter run before prepare()");
    reduce_scatter_->run();
    return;
  }
  switch (dtype) {
    case DType::kFloat32: run_typed<float>(context_, size_, op, send, recv, count); return;
    case DType::kFloat64: run_typed<double>(context_, size_, op, send, recv, count); return;
    default: throw std::invalid_argument("the Gloo reference supports float32 and float64");
  }
}

}  // namespace hps::bench
