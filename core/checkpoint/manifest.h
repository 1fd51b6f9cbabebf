// The manifest of a checkpoint (format.h) and the index every loader reads from: logical
// tensors stored as chunks of files. A manifest read from disk is hostile input: parsing
// checks every field, every size with overflow-checked arithmetic, that each tensor's
// chunks cover it exactly once, and that every chunk lies inside its file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/checkpoint/checkpointable.h"
#include "core/checkpoint/file_io.h"
#include "core/checkpoint/format.h"
#include "core/common/dtype.h"
#include "core/common/status.h"
#include "core/sharding/sharded_engine.h"

namespace hps::ckpt {

// Elements [begin, end) of a logical tensor, stored at byte `offset` of file `file`.
struct StoredChunk {
  uint32_t file = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t offset = 0;
  std::optional<uint64_t> xxh3;  // of the chunk's bytes, when the source records one
};

struct StoredTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  std::vector<StoredChunk> chunks;  // ascending, covering [0, numel) exactly once
};

struct StoredFile {
  std::string name;   // inside the source's directory (a checkpoint) or the file itself
  int32_t rank = -1;  // the writer, whose header the file starts with; -1: no header
  uint64_t bytes = 0;
};

// Tensors stored in files: a checkpoint (from its manifest) or a safetensors file.
struct SourceIndex {
  std::string description;  // "checkpoint /ckpt/step-5", "safetensors model.safetensors"
  std::string directory;    // where `files` are
  std::string id;           // the checkpoint's id, checked against each file's header
  std::vector<StoredFile> files;
  std::vector<StoredTensor> tensors;
  // Files already open, by index into `files` (the rest are opened by path when first read):
  // a file whose header was read stays the file its data is read from.
  std::vector<std::shared_ptr<const File>> opened;
  // What the ranks of a load compare, where the source has no id: the same for the same bytes
  // on every host (a safetensors file: its header's checksum and its size).
  std::string identity;
  // What the ranks of one host compare too: the file itself (File::identity), which two ranks
  // that read one path while it was replaced see differ.
  std::string identity_on_host;
};

// The largest sequence a manifest may carry (a root's sequence stops there).
inline constexpr uint64_t kMaxSequence = uint64_t{1} << 53;

struct Manifest {
  uint32_t format_version = kFormatVersion;
  std::string id;
  std::string name;
  int64_t created_unix_ns = 0;
  // Its place in the order of publication under its root: 1 + the largest sequence of the
  // checkpoints published there before it (0: written without one). Rotation and the
  // newest-first orders go by it, then by created_unix_ns, so a clock that steps back (or
  // another host's) never makes a new checkpoint look older than the ones it follows.
  uint64_t sequence = 0;
  uint64_t chunk_bytes = kDefaultChunkBytes;
  CheckpointTopology topology;  // the writers' stage, degrees and alignment
  int32_t world = 1;            // ranks that saved it
  std::optional<EngineOptions> engine;
  std::map<std::string, std::string> metadata;
  std::vector<StoredFile> files;
  std::vector<StoredTensor> tensors;
  // Whether the manifest read carried its own checksum (kManifestChecksumKey), which
  // matched; every manifest written carries one.
  bool checksummed = false;
};

std::string manifest_to_json(const Manifest& manifest);
// Parses and checks `text` in one SAX pass that builds no document (a few times the text's
// size in memory; OUT_OF_MEMORY when even that is not there); `origin` (a path) names it in
// messages.
StatusOr<Manifest> parse_manifest(std::string_view text, const std::string& origin);
// <directory>/manifest.json, parsed.
StatusOr<Manifest> read_manifest(const std::string& directory);
SourceIndex source_of(const Manifest& manifest, const std::string& directory);

// How deep a manifest's or a safetensors header's arrays and objects may nest
// (parse_manifest's SAX pass; parse_checked_json, core/common/json_input.h).
inline constexpr size_t kMaxJsonDepth = 32;

}  // namespace hps::ckpt
