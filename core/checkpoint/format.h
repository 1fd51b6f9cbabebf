// The on-disk format of a checkpoint (docs/checkpoints.md):
//
//   <root>/<name>/manifest.json     written last: tensors, their ranges and checksums, the
//                                   topology, the engine options, user metadata
//   <root>/<name>/rank-00003.bin    one per writing rank: a 64-byte header, then ranges of
//                                   logical tensors (raw little-endian elements), each
//                                   starting on a 64-byte boundary
//   <root>/latest                   the name of the newest published checkpoint
//
// A data file's header: "HPSCKPT\0" (8 bytes), format version (uint32 LE), writer rank
// (uint32 LE), the checkpoint's id (32 ASCII hex digits), zeros to 64 bytes. Each written
// range is cut into chunks at the multiples of the chunk size in the logical tensor (so
// chunk boundaries do not depend on the writer's shard), each with its XXH3-64 checksum.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/common/status.h"

namespace hps::ckpt {

inline constexpr std::string_view kFormatName = "hpshard-checkpoint";
inline constexpr uint32_t kFormatVersion = 1;
// The manifest of a part of a model cut across mp and pp (topology mp/pp above 1) says
// version 2, so that a reader that knows no parts refuses it rather than load it as the
// whole model; a whole model's manifest, and every data file, stay at version 1.
inline constexpr uint32_t kPartFormatVersion = 2;
inline constexpr std::string_view kManifestFile = "manifest.json";
// The manifest's own checksum: XXH3-64 (16 hex digits) of the manifest's compact JSON
// (nlohmann's dump without indentation, keys sorted) with this field removed. A reader
// refuses a manifest whose checksum does not match; one without the field (written before
// manifests carried it) is read, and verify says that its manifest went unchecked.
inline constexpr std::string_view kManifestChecksumKey = "manifest_xxh3";
inline constexpr std::string_view kLatestFile = "latest";
// The latest pointer's replacements are written as "latest.tmp-" + a random suffix
// (File::create_beside); names beginning so are not checkpoints, and a save removes such a
// file a killed save left.
inline constexpr std::string_view kLatestTemporaryPrefix = "latest.tmp";
// Held (flock) by the process saving into the root, from the leftovers' removal to the
// publication: two jobs that share a root save one after the other, and neither removes the
// other's save in flight as a crash's leftover. It holds the holder's pid and host.
inline constexpr std::string_view kSaveLockFile = ".hpshard-save-lock";
// Directories under the root that are not (yet, or any more) checkpoints.
inline constexpr std::string_view kTemporaryPrefix = ".tmp-";
inline constexpr std::string_view kTrashPrefix = ".trash-";
inline constexpr uint64_t kDataHeaderBytes = 64;
inline constexpr uint64_t kDataAlignment = 64;
inline constexpr uint64_t kDefaultChunkBytes = uint64_t{1} << 20;
// The largest chunk a checkpoint may be cut into (a reader holds one whole chunk).
inline constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 34;
// Bounds on what a reader accepts from a manifest (hostile input).
inline constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 30;
inline constexpr size_t kMaxDimensions = 16;
inline constexpr uint64_t kMaxElements = uint64_t{1} << 48;
inline constexpr size_t kMaxNameBytes = 4096;
// Entries of a checkpoint's (or a safetensors file's) metadata: a save refuses more, a
// reader refuses more before it builds them (hostile tiny entries cost ~100 bytes each).
inline constexpr size_t kMaxMetadataEntries = 65'536;

// "rank-00003.bin".
std::string data_file_name(int32_t rank);
// A checkpoint name a user may give: [A-Za-z0-9._-]{1,200}, not starting with '.', not
// "latest" nor beginning "latest.tmp". INVALID_ARGUMENT naming the problem otherwise.
Status check_checkpoint_name(std::string_view name);

// A fresh random checkpoint id: 32 lowercase hex digits.
std::string new_checkpoint_id();
bool is_checkpoint_id(std::string_view text);

// XXH3-64 of `bytes`, and as 16 lowercase hex digits.
uint64_t checksum(const void* data, size_t bytes);
// Copies `bytes` from `src` to `dst` (not overlapping) and returns the checksum of the bytes
// stored in `dst`, checksum(src, bytes) unless `src` changed during the copy: each block is
// hashed in cache between the copy's read and its stores, which bypass the cache where the
// CPU allows (the copy is read next by the disk, not the CPU), so the two take the memory
// traffic of one copy.
uint64_t copy_with_checksum(void* dst, const void* src, size_t bytes);
std::string hex64(uint64_t value);
std::optional<uint64_t> parse_hex64(std::string_view text);

// The 64 header bytes of rank `rank`'s data file in checkpoint `id`.
std::string data_file_header(std::string_view id, int32_t rank);
// OK when `header` (kDataHeaderBytes) is that of rank `rank`'s file of checkpoint `id`;
// INVALID_ARGUMENT naming `path` and what differs otherwise.
Status check_data_file_header(const uint8_t* header, std::string_view id, int32_t rank,
                              const std::string& path);

// Splits elements [begin, end) at the multiples of `chunk_elements`.
std::vector<std::pair<uint64_t, uint64_t>> cut_into_chunks(uint64_t begin, uint64_t end,
                                                           uint64_t chunk_elements);

// Overflow-checked arithmetic for sizes read from outside.
std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b);
std::optional<uint64_t> checked_add(uint64_t a, uint64_t b);
uint64_t round_up(uint64_t value, uint64_t multiple);

}  // namespace hps::ckpt
