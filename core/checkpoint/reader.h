// Executes a LoadPlan: opens the source's files (checking each data file's header against
// the checkpoint id and its size against the manifest), reads each needed chunk once with
// pread (a chunk with a checksum is read whole and verified; one without, such as a
// safetensors tensor, only where it overlaps this rank's ranges) and converts it into the
// targets' staging buffers. Every error names the file and the tensor.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/checkpoint/reshard.h"

namespace hps::ckpt {

// staging[t] receives target t's elements [begin, end) in its dtype; it must hold
// (end - begin) * dtype_size bytes. Targets without a source are left untouched. Each run
// of adjacent chunks the plan reads is announced to the kernel before the first read (it
// reads ahead one readahead window of each), so the disk works while earlier chunks are
// checked and converted. `before_write(t)`, when given, runs once before the first byte
// is written into staging[t]; its error stops the reads. `before_read()`, when given, runs
// before each read (a chunk, or a run of whole chunks up to kReadBytes); its error stops
// the reads (an abort).
Status read_plan(const SourceIndex& source, const std::vector<TargetRange>& targets,
                 const LoadPlan& plan, const std::vector<uint8_t*>& staging,
                 const std::function<Status(size_t)>& before_write = {},
                 const std::function<Status()>& before_read = {});

struct VerifyReport {
  uint64_t files = 0;
  uint64_t tensors = 0;
  uint64_t chunks = 0;
  uint64_t bytes = 0;                 // of tensor data read and checked
  bool manifest_checksummed = false;  // the manifest carried its own checksum, which matched
};
// Reads every chunk of every tensor and checks its checksum, every file's header and size.
StatusOr<VerifyReport> verify_source(const SourceIndex& source);

// Elements [begin, end) of stored tensor `tensor`, converted to `dtype`, into `out`.
Status read_tensor_range(const SourceIndex& source, size_t tensor, uint64_t begin, uint64_t end,
                         DType dtype, void* out);

}  // namespace hps::ckpt
