#include "core/checkpoint/reader.h"

#include <cstring>
#include <memory>

#include "core/checkpoint/file_io.h"
#include "core/kernels/cast.h"

namespace hps::ckpt {
namespace {

// The most one read takes in when whole chunks follow each other in a file and a target.
constexpr uint64_t kReadBytes = uint64_t{16} << 20;

// The source's files, opened on first use and checked once.
class FileSet {
 public:
  explicit FileSet(const SourceIndex& source) : source_(source), files_(source.files.size()) {}

  // File `index`, needed for tensor `tensor`.
  StatusOr<const File*> get(uint32_t index, const std::string& tensor) {
    if (files_[index]) return files_[index].get();
    const StoredFile& f = source_.files[index];
    const std::string path = join_path(source_.directory, f.name);
    auto context = [&](const Status& s) {
      const std::string holds = tensor.empty() ? "" : " (it holds tensor '" + tensor + "')";
      return Status(s.code(), source_.description + ": " + s.message() + holds);
    };
    if (index < source_.opened.size() && source_.opened[index]) {
      files_[index] = source_.opened[index];
      return files_[index].get();
    }
    auto file = File::open_read(path);
    if (!file.ok()) return context(file.status());
    if (f.rank >= 0) {
      uint8_t header[kDataHeaderBytes];
      Status s = file->pread_all(header, sizeof header, 0);
      if (s.ok()) s = check_data_file_header(header, source_.id, f.rank, path);
      if (!s.ok()) return context(s);
    }
    auto size = file->size();
    if (!size.ok()) return context(size.status());
    if (*size != f.bytes) {
      return context(invalid_argument("file '" + path + "' has " + std::to_string(*size) +
                                      " bytes, the manifest says " + std::to_string(f.bytes) +
                                      (*size < f.bytes ? " (truncated)" : "")));
    }
    files_[index] = std::make_shared<const File>(std::move(*file));
    return files_[index].get();
  }

 private:
  const SourceIndex& source_;
  std::vector<std::shared_ptr<const File>> files_;
};

// Reads `bytes` at `offset` of `chunk`'s file into `out`; elements [begin, end) of `t`
// name them in an error.
Status read_bytes(const SourceIndex& source, FileSet& files, const StoredTensor& t,
                  const StoredChunk& chunk, uint64_t begin, uint64_t end, uint64_t offset,
                  uint64_t bytes, uint8_t* out) {
  HPS_ASSIGN_OR_RETURN(const File* file, files.get(chunk.file, t.name));
  Status s = file->pread_all(out, bytes, offset);
  if (!s.ok()) {
    return Status(s.code(), source.description + ": tensor '" + t.name + "' elements [" +
                                std::to_string(begin) + ", " + std::to_string(end) +
                                "): " + s.message());
  }
  return Status::Ok();
}

// Checks the checksum of `chunk`, whose bytes are at `data`, when it has one.
Status verify(const SourceIndex& source, const StoredTensor& t, const StoredChunk& chunk,
              const uint8_t* data) {
  if (!chunk.xxh3) return Status::Ok();
  const uint64_t sum = checksum(data, (chunk.end - chunk.begin) * dtype_size(t.dtype));
  if (sum == *chunk.xxh3) return Status::Ok();
  return invalid_argument(source.description + ": tensor '" + t.name + "' elements [" +
                          std::to_string(chunk.begin) + ", " + std::to_string(chunk.end) +
                          ") in file '" + source.files[chunk.file].name + "' at byte " +
                          std::to_string(chunk.offset) + " fail their checksum (stored " +
                          hex64(*chunk.xxh3) + ", read " + hex64(sum) + "): the data is corrupt");
}

// Reads elements [begin, end) of `chunk` into `out`, and checks the checksum when they
// are the whole chunk and it has one.
Status read_into(const SourceIndex& source, FileSet& files, const StoredTensor& t,
                 const StoredChunk& chunk, uint64_t begin, uint64_t end, uint8_t* out) {
  const uint64_t element = dtype_size(t.dtype);
  HPS_RETURN_IF_ERROR(read_bytes(source, files, t, chunk, begin, end,
                                 chunk.offset + (begin - chunk.begin) * element,
                                 (end - begin) * element, out));
  if (begin == chunk.begin && end == chunk.end) return verify(source, t, chunk, out);
  return Status::Ok();
}

// Reads elements [begin, end) of `chunk` into `buffer` (all of it when it has a checksum,
// verified). Returns the element the buffer starts at.
StatusOr<uint64_t> read_chunk(const SourceIndex& source, FileSet& files, const StoredTensor& t,
                              const StoredChunk& chunk, uint64_t begin, uint64_t end,
                              std::vector<uint8_t>& buffer) {
  if (chunk.xxh3) {
    begin = chunk.begin;
    end = chunk.end;
  }
  // The file first: its real size is checked against the manifest's before the chunk's
  // memory is taken.
  HPS_RETURN_IF_ERROR(files.get(chunk.file, t.name).status());
  buffer.resize((end - begin) * dtype_size(t.dtype));
  HPS_RETURN_IF_ERROR(read_into(source, files, t, chunk, begin, end, buffer.data()));
  return begin;
}

void convert(DType from, const void* in, DType to, void* out, size_t count) {
  if (from == to) {
    std::memcpy(out, in, count * dtype_size(from));
  } else {
    cpu::cast(from, in, to, out, count);
  }
}

}  // namespace

Status read_plan(const SourceIndex& source, const std::vector<TargetRange>& targets,
                 const LoadPlan& plan, const std::vector<uint8_t*>& staging,
                 const std::function<Status(size_t)>& before_write,
                 const std::function<Status()>& before_read) {
  FileSet files(source);
  std::vector<uint8_t> writable(before_write ? targets.size() : 0, 0);
  auto writing = [&](size_t target) -> Status {
    if (!before_write || writable[target]) return Status::Ok();
    writable[target] = 1;
    return before_write(target);
  };
  // Readahead of each run of adjacent chunks the plan reads (a chunk with a checksum is
  // read whole): one announcement per run, which starts its first readahead window
  // (announcing a whole run in window-sized pieces submits it all before the first read
  // and measured slower, docs/benchmarks.md); a file that cannot be opened is reported by
  // the reads below.
  {
    const File* file = nullptr;
    uint64_t from = 0, to = 0;
    for (const ReadPiece& p : plan.pieces) {
      const StoredTensor& t = source.tensors[p.tensor];
      const StoredChunk& c = t.chunks[p.chunk];
      auto f = files.get(c.file, t.name);
      if (!f.ok()) break;
      const uint64_t element = dtype_size(t.dtype);
      const uint64_t begin = c.offset + (c.xxh3 ? 0 : (p.begin - c.begin) * element);
      const uint64_t end = c.offset + ((c.xxh3 ? c.end : p.end) - c.begin) * element;
      if (*f == file && begin <= to) {
        to = std::max(to, end);
        continue;
      }
      if (file != nullptr) file->will_need(from, to - from);
      file = *f;
      from = begin;
      to = end;
    }
    if (file != nullptr) file->will_need(from, to - from);
  }
  std::vector<uint8_t> buffer;
  size_t i = 0;
  while (i < plan.pieces.size()) {
    if (before_read) HPS_RETURN_IF_ERROR(before_read());
    const ReadPiece& first = plan.pieces[i];
    const StoredTensor& t = source.tensors[first.tensor];
    const StoredChunk& chunk = t.chunks[first.chunk];
    // The pieces of this chunk are adjacent (ordered by file and offset).
    size_t j = i;
    uint64_t begin = first.begin, end = first.end;
    while (j < plan.pieces.size() && plan.pieces[j].tensor == first.tensor &&
           plan.pieces[j].chunk == first.chunk) {
      begin = std::min(begin, plan.pieces[j].begin);
      end = std::max(end, plan.pieces[j].end);
      ++j;
    }
    const TargetRange& only = targets[first.target];
    if (j == i + 1 && only.dtype == t.dtype && first.begin == chunk.begin &&
        first.end == chunk.end) {
      // A whole chunk for one target in its own dtype: read straight into place, with the
      // whole chunks after it that continue both the file and the target (one read of up
      // to kReadBytes, as a plain sequential read would), each then verified.
      const uint64_t element = dtype_size(t.dtype);
      uint64_t bytes = (chunk.end - chunk.begin) * element;
      size_t k = j;
      while (k < plan.pieces.size() && bytes < kReadBytes) {
        const ReadPiece& p = plan.pieces[k];
        if (p.tensor != first.tensor || p.target != first.target) break;
        const StoredChunk& c = t.chunks[p.chunk];
        const bool alone = k + 1 == plan.pieces.size() || plan.pieces[k + 1].tensor != p.tensor ||
                           plan.pieces[k + 1].chunk != p.chunk;
        if (!alone || p.begin != c.begin || p.end != c.end || c.file != chunk.file ||
            c.offset != chunk.offset + bytes || c.begin != plan.pieces[k - 1].end) {
          break;
        }
        bytes += (c.end - c.begin) * element;
        ++k;
      }
      uint8_t* out = staging[first.target] + (first.begin - only.begin) * element;
      HPS_RETURN_IF_ERROR(writing(first.target));
      HPS_RETURN_IF_ERROR(read_bytes(source, files, t, chunk, first.begin, plan.pieces[k - 1].end,
                                     chunk.offset, bytes, out));
      for (size_t m = i; m < k; ++m) {
        const StoredChunk& c = t.chunks[plan.pieces[m].chunk];
        HPS_RETURN_IF_ERROR(verify(source, t, c, out + (c.begin - first.begin) * element));
      }
      i = k;
      continue;
    }
    HPS_ASSIGN_OR_RETURN(uint64_t at, read_chunk(source, files, t, chunk, begin, end, buffer));
    for (size_t k = i; k < j; ++k) {
      const ReadPiece& p = plan.pieces[k];
      const TargetRange& target = targets[p.target];
      const uint8_t* in = buffer.data() + (p.begin - at) * dtype_size(t.dtype);
      uint8_t* out = staging[p.target] + (p.begin - target.begin) * dtype_size(target.dtype);
      HPS_RETURN_IF_ERROR(writing(p.target));
      convert(t.dtype, in, target.dtype, out, static_cast<size_t>(p.end - p.begin));
    }
    i = j;
  }
  return Status::Ok();
}

StatusOr<VerifyReport> verify_source(const SourceIndex& source) {
  FileSet files(source);
  VerifyReport report;
  std::vector<uint8_t> buffer;
  for (const StoredTensor& t : source.tensors) {
    ++report.tensors;
    for (const StoredChunk& c : t.chunks) {
      HPS_RETURN_IF_ERROR(read_chunk(source, files, t, c, c.begin, c.end, buffer).status());
      ++report.chunks;
      report.bytes += buffer.size();
    }
  }
  // Files no tensor points into still belong to the checkpoint: check them too.
  for (uint32_t f = 0; f < source.files.size(); ++f) {
    HPS_RETURN_IF_ERROR(files.get(f, "").status());
    ++report.files;
  }
  return report;
}

Status read_tensor_range(const SourceIndex& source, size_t tensor, uint64_t begin, uint64_t end,
                         DType dtype, void* out) {
  const StoredTensor& t = source.tensors[tensor];
  std::vector<TargetRange> targets{{t.name, dtype, t.shape, begin, end}};
  LoadPlan plan;
  plan.source_of_target = {static_cast<int64_t>(tensor)};
  for (size_t c = 0; c < t.chunks.size(); ++c) {
    const StoredChunk& chunk = t.chunks[c];
    if (chunk.end <= begin || chunk.begin >= end) continue;
    plan.pieces.push_back({0, tensor, c, std::max(chunk.begin, begin), std::min(chunk.end, end)});
  }
  return read_plan(source, targets, plan, {static_cast<uint8_t*>(out)});
}

}  // namespace hps::ckpt
