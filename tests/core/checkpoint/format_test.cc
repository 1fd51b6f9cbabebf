// The checkpoint format's pure parts: manifests (round trip, and every kind of hostile
// manifest refused with a message saying where), chunk cutting, data file headers,
// safetensors headers, and the resharding planner (which stored tensor fills which
// target, reading only what a rank holds).
#include "core/checkpoint/format.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/checkpoint/file_io.h"
#include "core/checkpoint/manifest.h"
#include "core/checkpoint/reshard.h"
#include "core/checkpoint/safetensors.h"
#include "core/common/json_input.h"
#include "tests/core/checkpoint/temp_dir.h"

namespace hps::ckpt {
namespace {

using json = nlohmann::json;

// A manifest of one fp32 tensor "param/w" [4, 5] in two files of 2 chunks, and a scalar.
Manifest sample() {
  Manifest m;
  m.id = "0123456789abcdef0123456789abcdef";
  m.name = "step-5";
  m.created_unix_ns = 42;
  m.chunk_bytes = 40;
  m.topology = {2, 2, 0, 1, 0, 256};
  m.world = 2;
  m.engine = EngineOptions{};
  m.engine->optimizer = OptimizerKind::kAdamW;
  m.engine->adamw.learning_rate = 0.125f;
  m.metadata = {{"step", "5"}};
  m.files = {{"rank-00000.bin", 0, 64 + 56}, {"rank-00001.bin", 1, 64 + 32}};
  StoredTensor w{"param/w", DType::kFloat32, {4, 5}, 20, {}};
  w.chunks = {{0, 0, 10, 64, 0x1111}, {0, 10, 12, 104, 0x2222}, {1, 12, 20, 64, 0x3333}};
  StoredTensor s{"step/applied_steps", DType::kInt64, {}, 1, {{0, 0, 1, 104 + 0, 0x4444}}};
  s.chunks[0].offset = 64 + 48;
  m.tensors = {w, s};
  return m;
}

// The whole file at `path`, read through File (empty when it cannot be read).
std::vector<uint8_t> read_back(const std::string& path) {
  auto r = File::open_read(path);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (!r.ok()) return {};
  auto size = r->size();
  EXPECT_TRUE(size.ok());
  std::vector<uint8_t> back(size.ok() ? *size : 0);
  EXPECT_TRUE(r->pread_all(back.data(), back.size(), 0).ok());
  return back;
}

// write_whole: the whole file, byte for byte and of the exact size, through O_DIRECT from an
// aligned buffer (with its rounding zeroed and cut off) and through the page cache from an
// unaligned one; the rounding's bytes are the only ones of the buffer it changes.
TEST(FileIo, WriteWholeWritesExactlyTheBytesAlignedOrNot) {
  std::string dir = (std::filesystem::temp_directory_path() / "hps-write-whole-XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  std::mt19937 rng(7);
  int case_no = 0;
  for (size_t bytes : {size_t{1}, size_t{64}, size_t{4095}, size_t{4096}, size_t{4097},
                       size_t{3 * 4096 + 17}, (size_t{1} << 20) + 123}) {
    for (size_t misalign : {size_t{0}, size_t{8}}) {
      const size_t capacity = (bytes + misalign + 4095) / 4096 * 4096 + 4096;
      auto* raw = static_cast<uint8_t*>(std::aligned_alloc(File::kDirectAlignment, capacity));
      ASSERT_NE(raw, nullptr);
      uint8_t* data = raw + misalign;
      for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(rng());
      const std::vector<uint8_t> expected(data, data + bytes);
      const std::string path = dir + "/f" + std::to_string(case_no++);
      auto f = File::create(path);
      ASSERT_TRUE(f.ok()) << f.status().to_string();
      ASSERT_TRUE(f->write_whole(data, bytes).ok());
      ASSERT_TRUE(f->sync().ok());
      ASSERT_TRUE(f->close().ok());
      EXPECT_EQ(std::vector<uint8_t>(data, data + bytes), expected);
      EXPECT_EQ(read_back(path), expected) << bytes << " bytes, misalign " << misalign;
      std::free(raw);
    }
  }
  std::filesystem::remove_all(dir);
}

// write_whole with a buffer that fills while it is written: every call of `ready` finds
// the file holding exactly the bytes reported so far (whole blocks of them through
// O_DIRECT, all of them through the page cache), so the writing starts before the buffer is
// complete and never reads a byte not yet reported; the file then equals the buffer.
TEST(FileIo, WriteWholeWritesTheBytesReportedReadyAsTheyCome) {
  testing_util::TempDir temp;
  const std::string& dir = temp.path();
  std::mt19937 rng(11);
  int case_no = 0;
  for (size_t bytes : {size_t{1}, size_t{4097}, size_t{3 * 4096 + 17}, (size_t{1} << 20) + 123}) {
    for (size_t misalign : {size_t{0}, size_t{8}}) {
      const size_t capacity = (bytes + misalign + 4095) / 4096 * 4096 + 4096;
      auto* raw = static_cast<uint8_t*>(std::aligned_alloc(File::kDirectAlignment, capacity));
      ASSERT_NE(raw, nullptr);
      uint8_t* data = raw + misalign;
      std::vector<uint8_t> expected(bytes);
      for (auto& b : expected) b = static_cast<uint8_t>(rng());
      std::memset(data, 0xEE, bytes);  // not ready: a byte written before it is stays wrong
      const std::string path = dir + "/f" + std::to_string(case_no++);
      auto f = File::create(path);
      ASSERT_TRUE(f.ok()) << f.status().to_string();
      size_t reported = 0;
      int calls = 0;
      bool started_early = false;
      auto ready = [&](size_t so_far) -> StatusOr<size_t> {
        ++calls;
        EXPECT_EQ(so_far, reported);
        const uint64_t in_file = std::filesystem::file_size(path);
        const uint64_t whole_blocks = so_far / 4096 * 4096;
        EXPECT_TRUE(in_file == so_far || (misalign == 0 && in_file == whole_blocks))
            << in_file << " bytes in the file with " << so_far << " ready";
        started_early = started_early || in_file > 0;
        const size_t step = std::uniform_int_distribution<size_t>(1, 9000)(rng);
        const size_t now = std::min(bytes, reported + step);
        std::memcpy(data + reported, expected.data() + reported, now - reported);
        reported = now;
        return now;
      };
      ASSERT_TRUE(f->write_whole(data, bytes, ready).ok());
      ASSERT_TRUE(f->sync().ok());
      ASSERT_TRUE(f->close().ok());
      if (bytes > 2 * 9000) {
        EXPECT_GT(calls, 2);
        EXPECT_TRUE(started_early) << bytes << " bytes, misalign " << misalign;
      }
      EXPECT_EQ(read_back(path), expected) << bytes << " bytes, misalign " << misalign;
      std::free(raw);
    }
  }
}

// An error of `ready` stops the writing and is returned as it is; a count that does not
// grow, or passes the whole, is refused naming the file.
TEST(FileIo, WriteWholeStopsOnReadyErrorsAndBadCounts) {
  testing_util::TempDir temp;
  const std::string& dir = temp.path();
  const size_t bytes = 5 * 4096;
  auto* data = static_cast<uint8_t*>(std::aligned_alloc(File::kDirectAlignment, bytes));
  ASSERT_NE(data, nullptr);
  std::memset(data, 1, bytes);
  struct Case {
    std::function<StatusOr<size_t>(size_t)> ready;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](size_t so_far) -> StatusOr<size_t> {
         if (so_far > 0) return backend_error("the copy failed");
         return size_t{8192};
       },
       "the copy failed"},
      {[](size_t so_far) -> StatusOr<size_t> { return so_far == 0 ? size_t{4096} : so_far; },
       "told 4096 of 20480 bytes are ready after 4096"},
      {[](size_t) -> StatusOr<size_t> { return bytes + 1; },
       "told 20481 of 20480 bytes are ready after 0"}};
  int case_no = 0;
  for (const Case& c : cases) {
    const std::string path = dir + "/f" + std::to_string(case_no++);
    auto f = File::create(path);
    ASSERT_TRUE(f.ok());
    const Status s = f->write_whole(data, bytes, c.ready);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s.to_string();
    if (c.message != "the copy failed") {
      EXPECT_NE(s.message().find(path), std::string::npos) << s.to_string();
    }
  }
  std::free(data);
}

size_t open_descriptors() {
  return static_cast<size_t>(std::distance(std::filesystem::directory_iterator("/proc/self/fd"),
                                           std::filesystem::directory_iterator{}));
}

// A File moved into another closes the one it replaces and takes over the moved file's
// descriptor and path; the moved-from File holds nothing, and moving a File into itself
// changes nothing.
// Only regular files are read: a FIFO is refused at once instead of waiting for a writer
// forever, a directory at open instead of at the first read.
TEST(FileIo, OpenReadRefusesWhatIsNotARegularFile) {
  testing_util::TempDir dir;
  const std::string fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {fifo, dir.path()}) {
    auto opened = File::open_read(path);
    ASSERT_FALSE(opened.ok()) << path;
    EXPECT_EQ(opened.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(opened.status().message().find("'" + path + "' is not a regular file"),
              std::string::npos)
        << opened.status().message();
  }
  auto text = read_file(fifo, 4096);
  EXPECT_FALSE(text.ok());
  auto safetensors = read_safetensors(fifo, nullptr);
  EXPECT_FALSE(safetensors.ok());
}

TEST(FileIo, MoveAssignmentClosesTheReplacedFile) {
  testing_util::TempDir dir;
  const std::string first = dir.path() + "/first", second = dir.path() + "/second";
  const size_t before = open_descriptors();
  auto a = File::create(first);
  auto b = File::create(second);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(open_descriptors(), before + 2);
  *a = std::move(*b);
  EXPECT_EQ(open_descriptors(), before + 1) << "the replaced file was not closed";
  EXPECT_EQ(a->path(), second);
  EXPECT_FALSE(b->write_all("x", 1).ok()) << "the moved-from File still writes";
  File& self = *a;
  *a = std::move(self);
  EXPECT_EQ(a->path(), second);
  ASSERT_TRUE(a->write_all("xyz", 3).ok());
  ASSERT_TRUE(a->close().ok());
  EXPECT_EQ(open_descriptors(), before);
  EXPECT_EQ(std::filesystem::file_size(second), 3u);
  EXPECT_EQ(std::filesystem::file_size(first), 0u);
}

// Concurrent replacements of one file each write a temporary of their own: every one
// succeeds, a reader only ever sees one writer's whole contents, and no temporary is left
// (with one fixed temporary name, a writer's rename published another's half-written file
// or failed). A file named like the old fixed temporary is not touched.
TEST(FileIo, ConcurrentReplacementsEachPublishWholeContents) {
  testing_util::TempDir dir;
  const std::string path = dir / "latest";
  const std::string bystander = path + ".tmp";
  {
    auto f = File::create(bystander);
    ASSERT_TRUE(f.ok() && f->write_all("mine", 4).ok() && f->close().ok());
  }
  constexpr int kWriters = 4, kRounds = 40;
  constexpr size_t kBytes = 256 << 10;
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0}, torn{0}, reads{0};
  std::thread reader([&] {
    while (!stop.load()) {
      auto text = read_file(path, kBytes * 2);
      if (!text.ok()) continue;  // not yet written
      ++reads;
      const std::string& t = *text;
      if (t.size() != kBytes || t.find_first_not_of(t[0]) != std::string::npos) ++torn;
    }
  });
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      const std::string contents(kBytes, static_cast<char>('a' + w));
      for (int r = 0; r < kRounds; ++r) {
        auto aside = write_beside(path, contents);
        if (!aside.ok() || !rename_path(*aside, path).ok()) ++failures;
      }
    });
  }
  for (auto& t : writers) t.join();
  stop = true;
  reader.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(torn.load(), 0) << "of " << reads.load() << " reads";
  auto names = list_directory(dir.path());
  ASSERT_TRUE(names.ok());
  std::sort(names->begin(), names->end());
  EXPECT_EQ(*names, (std::vector<std::string>{"latest", "latest.tmp"}));
  EXPECT_EQ(read_back(bystander), (std::vector<uint8_t>{'m', 'i', 'n', 'e'}));
}

// create_beside: a new file under a name of its own beside the target, never one that
// exists; the error names the target.
TEST(FileIo, CreateBesideTakesANameOfItsOwn) {
  testing_util::TempDir dir;
  const std::string target = dir / "out.bin";
  std::set<std::string> names;
  for (int i = 0; i < 32; ++i) {
    auto f = File::create_beside(target);
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    EXPECT_EQ(f->path().rfind(target + ".tmp-", 0), 0u) << f->path();
    EXPECT_EQ(f->path().size(), target.size() + 17) << f->path();
    names.insert(f->path());
  }
  EXPECT_EQ(names.size(), 32u);
  EXPECT_FALSE(std::filesystem::exists(target));
  auto missing = File::create_beside(dir / "no-such-dir/out.bin");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no-such-dir/out.bin"), std::string::npos)
      << missing.status().message();
}

// The file renamed over a target takes the target's mode: a private file stays private
// (it was created 0644 and the rename made it readable to everyone); a new one is 0666 less
// the umask.
TEST(FileIo, CreateBesideKeepsTheTargetsMode) {
  testing_util::TempDir dir;
  const std::string target = dir / "out.bin";
  auto mode_of = [](const std::string& path) {
    struct stat st {};
    EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
    return st.st_mode & 07777;
  };
  const mode_t mask = ::umask(027);
  auto fresh = write_beside(target, "new");
  ASSERT_TRUE(fresh.ok()) << fresh.status().to_string();
  EXPECT_EQ(mode_of(*fresh), 0640u);
  for (const mode_t mode : {0600u, 0640u, 0604u, 0400u}) {
    ASSERT_EQ(::rename(fresh->c_str(), target.c_str()), 0);
    ASSERT_EQ(::chmod(target.c_str(), mode), 0);
    fresh = write_beside(target, "again");
    ASSERT_TRUE(fresh.ok()) << fresh.status().to_string();
    EXPECT_EQ(mode_of(*fresh), mode) << std::oct << mode;
  }
  ::umask(mask);
}

TEST(Manifest, RoundTrips) {
  const Manifest m = sample();
  auto back = parse_manifest(manifest_to_json(m), "x/manifest.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->id, m.id);
  EXPECT_EQ(back->metadata, m.metadata);
  EXPECT_EQ(back->world, 2);
  EXPECT_EQ(back->topology.stage, 2);
  ASSERT_TRUE(back->engine);
  EXPECT_EQ(back->engine->optimizer, OptimizerKind::kAdamW);
  EXPECT_EQ(back->engine->adamw.learning_rate, 0.125f);
  ASSERT_EQ(back->tensors.size(), 2u);
  EXPECT_EQ(back->tensors[0].numel, 20u);
  ASSERT_EQ(back->tensors[0].chunks.size(), 3u);
  EXPECT_EQ(*back->tensors[0].chunks[2].xxh3, 0x3333u);
  EXPECT_EQ(back->tensors[1].shape, std::vector<int64_t>{});
}

// A written manifest's JSON without its own checksum (as written before the field): edits of
// it reach the checks of each field rather than the checksum's.
json unchecked(const Manifest& m) {
  json j = json::parse(manifest_to_json(m));
  j.erase(std::string(kManifestChecksumKey));
  return j;
}

TEST(Manifest, CarriesItsOwnChecksum) {
  Manifest m = sample();
  m.topology.mp = 2;
  m.topology.mp_rank = 0;
  const std::string text = manifest_to_json(m);
  auto back = parse_manifest(text, "x/manifest.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_TRUE(back->checksummed);
  // What went unnoticed before: a hand edit of the part, or of where a chunk lies, that
  // keeps the manifest well formed.
  for (const auto& edit : std::vector<std::function<void(json&)>>{
           [](json& j) { j["topology"]["mp_rank"] = 1; },
           [](json& j) { j["tensors"][0]["chunks"][1]["offset"] = 128; },
           [](json& j) { j["tensors"][0]["name"] = "param/renamed"; },
           [](json& j) { j["metadata"]["step"] = "7"; },
           [](json& j) { j["created_unix_ns"] = 5; }}) {
    json j = json::parse(text);
    edit(j);
    auto edited = parse_manifest(j.dump(1), "ckpt/manifest.json");
    ASSERT_FALSE(edited.ok()) << "accepted: " << j.dump();
    EXPECT_EQ(edited.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(edited.status().message().find("ckpt/manifest.json: the manifest's checksum"),
              std::string::npos)
        << edited.status().to_string();
  }
  // Layout does not matter (the sum is over the parsed JSON), the field must be hex.
  json j = json::parse(text);
  back = parse_manifest(j.dump(4), "x/manifest.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  for (const json& bad : {json("xyz"), json(12), json("0123456789ABCDEF")}) {
    j[std::string(kManifestChecksumKey)] = bad;
    auto refused = parse_manifest(j.dump(), "x/manifest.json");
    ASSERT_FALSE(refused.ok()) << bad.dump();
    EXPECT_NE(refused.status().message().find("is not 16 lowercase hex digits"), std::string::npos)
        << refused.status().to_string();
  }
  // Without the field (written before it): read, and said to be unchecked.
  back = parse_manifest(unchecked(m).dump(), "x/manifest.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_FALSE(back->checksummed);
  // Metadata with invalid UTF-8 is replaced as written, and the sum still matches.
  m.metadata["bytes"] = std::string("a\xff\xfe");
  back = parse_manifest(manifest_to_json(m), "x/manifest.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_TRUE(back->checksummed);
}

// Applies `edit` to the sample's JSON; the parse must fail naming `expect`.
void expect_refused(const std::function<void(json&)>& edit, const std::string& expect) {
  json j = unchecked(sample());
  edit(j);
  auto m = parse_manifest(j.dump(), "ckpt/manifest.json");
  ASSERT_FALSE(m.ok()) << "accepted: " << j.dump();
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find(expect), std::string::npos) << m.status().message();
  EXPECT_NE(m.status().message().find("ckpt/manifest.json"), std::string::npos);
}

TEST(Manifest, RefusesHostileManifests) {
  expect_refused([](json& j) { j["format"] = "zip"; }, "'format'");
  expect_refused([](json& j) { j["format_version"] = 2; }, "format version 2");
  expect_refused([](json& j) { j["id"] = "../../etc"; }, "'id'");
  expect_refused([](json& j) { j.erase("tensors"); }, "no field 'tensors'");
  expect_refused([](json& j) { j["files"][0]["name"] = "../../etc/passwd"; }, "rank-00000.bin");
  expect_refused([](json& j) { j["files"][1]["rank"] = 7; }, "'rank' is 7");
  expect_refused(
      [](json& j) {
        j["files"][1]["rank"] = 0;
        j["files"][1]["name"] = "rank-00000.bin";
      },
      "two files");
  expect_refused([](json& j) { j["tensors"][0]["dtype"] = "float33"; }, "unknown dtype");
  expect_refused([](json& j) { j["tensors"][0]["dtype"] = "fp32"; }, "unknown dtype");
  expect_refused([](json& j) { j["tensors"][0]["shape"] = {-4, 5}; }, "dimension");
  expect_refused([](json& j) { j["tensors"][0]["shape"] = {1u << 30, 1u << 30}; }, "2^48");
  expect_refused([](json& j) { j["tensors"][0]["chunks"].erase(1); }, "[12, 20)");        // a gap
  expect_refused([](json& j) { j["tensors"][0]["chunks"][1]["begin"] = 9; }, "[9, 12)");  // overlap
  expect_refused([](json& j) { j["tensors"][0]["chunks"][2]["end"] = 21; }, "[12, 21)");
  expect_refused([](json& j) { j["tensors"][0]["chunks"][2]["file"] = 9; }, "names file 9");
  expect_refused([](json& j) { j["tensors"][0]["chunks"][2]["offset"] = 70; }, "lies outside file");
  expect_refused([](json& j) { j["tensors"][0]["chunks"][2]["offset"] = UINT64_MAX - 3; },
                 "lies outside file");
  expect_refused([](json& j) { j["tensors"][0]["chunks"][0]["offset"] = 0; }, "lies outside file");
  expect_refused([](json& j) { j["tensors"][0]["chunks"][0]["xxh3"] = "xyz"; }, "'xxh3'");
  expect_refused([](json& j) { j["tensors"][1]["name"] = "param/w"; }, "listed twice");
  expect_refused([](json& j) { j["tensors"][1]["name"] = std::string("a\nb"); }, "control");
  expect_refused([](json& j) { j["metadata"]["k"] = 3; }, "metadata 'k'");
  expect_refused([](json& j) { j["engine"]["optimizer"] = "lion"; }, "lion");
  expect_refused([](json& j) { j["engine"]["accumulation_steps"] = 0; }, "accumulation_steps");
  expect_refused([](json& j) { j["topology"]["stage"] = "two"; }, "'stage'");
  expect_refused([](json& j) { j["topology"]["stage"] = 9; }, "'stage' is 9, outside [2, 3]");
  // What no engine could have written: stage 0, a negative or non-float rate, a world that
  // is not the sharding x dp ranks.
  expect_refused([](json& j) { j["topology"]["stage"] = 0; }, "'stage' is 0, outside [2, 3]");
  expect_refused([](json& j) { j["engine"]["learning_rate"] = -5; },
                 "manifest.json: engine: learning_rate must be >= 0 and finite, not -5");
  expect_refused([](json& j) { j["engine"]["learning_rate"] = 1e300; },
                 "'learning_rate' is 1e+300, beyond a float");
  expect_refused([](json& j) { j["engine"]["beta2"] = 1; }, "beta2 must be in [0, 1)");
  expect_refused([](json& j) { j["topology"]["dp"] = 1 << 24; },
                 "sharding 2 x dp 16777216 is not the world of 2 ranks that wrote it");
  expect_refused([](json& j) { j["tensors"][0]["chunks"].erase(2); }, "cover 12 of its 20");
  expect_refused([](json& j) { j["chunk_bytes"] = -40; }, "'chunk_bytes' is not an unsigned");
  expect_refused([](json& j) { j["chunk_bytes"] = 0; }, "'chunk_bytes' is 0, not in [1, 2^34]");
  expect_refused([](json& j) { j["chunk_bytes"] = uint64_t{1} << 40; }, "not in [1, 2^34]");
  // A chunk larger than chunk_bytes allows: a reader would hold it whole to check its sum.
  expect_refused([](json& j) { j["chunk_bytes"] = 20; },
                 "chunk 0: holds 10 elements, more than chunk_bytes (20) allows");
  expect_refused([](json& j) { j["tensors"][0]["chunks"][0]["end"] = 2.5; },
                 "'end' is not an unsigned integer");
  expect_refused([](json& j) { j["engine"]["alignment_bytes"] = uint64_t{1} << 40; },
                 "'alignment_bytes' is 1099511627776, above 1073741824");
  expect_refused([](json& j) { j["created_unix_ns"] = UINT64_MAX; },
                 "'created_unix_ns' is too large");
  expect_refused([](json& j) { j["created_unix_ns"] = "now"; },
                 "'created_unix_ns' is not an integer");
  expect_refused([](json& j) { j["tensors"][0]["name"] = std::string(5000, 'n'); },
                 "'name' is longer than");
  expect_refused([](json& j) { j["tensors"][0]["chunks"][0]["xxh3"] = std::string(17, 'a'); },
                 "'xxh3' is longer than 16 bytes");
  // A prefix with no parameter name: an export would write a tensor named "".
  expect_refused([](json& j) { j["tensors"][1]["name"] = "param/"; }, "names no parameter");
  expect_refused([](json& j) { j["tensors"][1]["name"] = "master/"; }, "names no parameter");
  // The model-parallel part: optional (a whole model without it), checked when present.
  expect_refused([](json& j) { j["topology"]["mp"] = 0; }, "'mp' is 0");
  expect_refused([](json& j) { j["topology"]["mp_rank"] = 1; }, "'mp_rank' is 1, outside [0, 0]");
  expect_refused([](json& j) { j["topology"].erase("pp_rank"); }, "no field 'pp_rank'");
  expect_refused([](json& j) { j["topology"].erase("mp"); }, "'mp_rank' without 'mp'");
}

// The sample's JSON with "master/w" beside "param/w" (its bytes after rank 1's in file
// 1), as `edit` changes it.
json with_master(const std::function<void(json&)>& edit) {
  json j = unchecked(sample());
  j["files"][1]["bytes"] = 64 + 32 + 80;
  json master = j["tensors"][0];
  master["name"] = "master/w";
  master["chunks"] = json::array(
      {{{"file", 1}, {"begin", 0}, {"end", 10}, {"offset", 96}, {"xxh3", "0000000000000001"}},
       {{"file", 1}, {"begin", 10}, {"end", 20}, {"offset", 136}, {"xxh3", "0000000000000002"}}});
  edit(master);
  j["tensors"].push_back(master);
  return j;
}

// What a manifest's parts say of each other: a master has its parameter's shape (a reader
// that loads the parameter leaves the master unread, so nothing else would see it), no two
// chunks share bytes of a file (one checksum would pass both, and the load would copy one
// range's values into another), the writer's alignment is one an engine takes.
TEST(Manifest, RefusesPartsThatContradictEachOther) {
  auto parsed = [](const json& j) { return parse_manifest(j.dump(), "ckpt/manifest.json"); };
  auto good = parsed(with_master([](json&) {}));
  ASSERT_TRUE(good.ok()) << good.status().to_string();
  ASSERT_EQ(good->tensors.size(), 3u);
  auto refused = [&](const json& j, const std::string& expect) {
    auto m = parsed(j);
    ASSERT_FALSE(m.ok()) << "accepted: " << j.dump();
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find("ckpt/manifest.json"), std::string::npos);
    EXPECT_NE(m.status().message().find(expect), std::string::npos) << m.status().message();
  };
  refused(with_master([](json& t) { t["shape"] = {20}; }),
          "tensor 'master/w' has shape [20] but 'param/w' [4, 5]");
  refused(with_master([](json& t) { t["shape"] = {5, 4}; }), "has shape [5, 4]");
  refused(with_master([](json& t) { t["name"] = "master/v"; }),
          "tensor 'master/v' has no 'param/v'");
  refused(with_master([](json& t) { t["dtype"] = "bfloat16"; }),
          "tensor 'master/w' is bfloat16, not float32");
  // Two chunks over the same bytes: the scalar's over w's second chunk, a master's over
  // rank 1's part of w.
  json j = unchecked(sample());
  j["tensors"][1]["chunks"][0]["offset"] = 104;
  refused(j,
          "tensor 'step/applied_steps' chunk 0 and tensor 'param/w' chunk 1 share bytes of "
          "file 'rank-00000.bin'");
  refused(with_master([](json& t) { t["chunks"][0]["offset"] = 88; }),
          "share bytes of file 'rank-00001.bin'");
  // Adjacent is not overlapping.
  j = unchecked(sample());
  j["tensors"][1]["chunks"][0]["offset"] = 112;
  EXPECT_TRUE(parsed(j).ok());
  for (uint64_t alignment : {uint64_t{0}, uint64_t{3}, uint64_t{1} << 22}) {
    j = unchecked(sample());
    j["topology"]["alignment_bytes"] = alignment;
    refused(j, "'alignment_bytes' is " + std::to_string(alignment) +
                   ", not a power of two from 1 to 2097152");
  }
}

TEST(Manifest, RecordsTheModelParallelPart) {
  Manifest m = sample();
  m.topology.mp = 4;
  m.topology.mp_rank = 3;
  m.topology.pp = 2;
  m.topology.pp_rank = 1;
  auto back = parse_manifest(manifest_to_json(m), "x/manifest.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->topology.mp, 4);
  EXPECT_EQ(back->topology.mp_rank, 3);
  EXPECT_EQ(back->topology.pp, 2);
  EXPECT_EQ(back->topology.pp_rank, 1);
  // A part's manifest is version 2 (a reader without parts refuses it), a whole model's 1.
  EXPECT_EQ(back->format_version, kPartFormatVersion);
  EXPECT_EQ(json::parse(manifest_to_json(sample()))["format_version"], kFormatVersion);
  json j = unchecked(m);
  j["format_version"] = kFormatVersion;
  back = parse_manifest(j.dump(), "x/manifest.json");
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("a part of a model (mp or pp above 1) is version 2"),
            std::string::npos)
      << back.status().to_string();
  j = unchecked(m);  // a manifest written before these fields
  for (const char* key : {"mp", "mp_rank", "pp", "pp_rank"}) j["topology"].erase(key);
  j["format_version"] = kFormatVersion;
  back = parse_manifest(j.dump(), "x/manifest.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->topology.mp, 1);
  EXPECT_EQ(back->topology.mp_rank, 0);
  EXPECT_EQ(back->topology.pp, 1);
  EXPECT_EQ(back->topology.pp_rank, 0);
}

TEST(Manifest, RefusesTruncatedAndDeepDocuments) {
  const std::string text = manifest_to_json(sample());
  for (size_t cut : {size_t{0}, size_t{1}, text.size() / 3, text.size() - 3}) {
    auto m = parse_manifest(text.substr(0, cut), "m.json");
    EXPECT_FALSE(m.ok()) << cut;
  }
  // Bytes after a NUL (which nlohmann takes for the end of its input) are not ignored.
  for (const std::string& tail : {std::string(1, '\0'), std::string("\0 {\"x\": [", 8)}) {
    auto m = parse_manifest(text + tail, "m.json");
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find("m.json: not valid JSON"), std::string::npos)
        << m.status().message();
  }
  EXPECT_EQ(parse_checked_json(std::string("{}\0", 3), 3).problem, CheckedJson::Problem::kInvalid);
  // A key repeated within an object (nlohmann would keep the last one silently).
  const std::string repeated = "{\"id\": \"x\", " + text.substr(text.find('{') + 1);
  auto twice = parse_manifest(repeated, "m.json");
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("key 'id' repeated"), std::string::npos)
      << twice.status().message();
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  auto m = parse_manifest(deep, "m.json");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("deeper"), std::string::npos);
  // Brackets inside strings do not count; the depth bound is inclusive.
  EXPECT_EQ(parse_checked_json(R"({"a": "[[[[", "b": [1, {"c": 2}]})", 3).problem,
            CheckedJson::Problem::kNone);
  EXPECT_EQ(parse_checked_json(R"({"a": "[[[[", "b": [1, {"c": 2}]})", 2).problem,
            CheckedJson::Problem::kTooDeep);
  EXPECT_EQ(parse_checked_json(R"({"a": {"k": 1}, "b": {"k": 2}})", 3).problem,
            CheckedJson::Problem::kNone);  // one key in two objects is no repetition
}

TEST(Format, ChunksAreCutAtGlobalMultiples) {
  using Cuts = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(cut_into_chunks(3, 25, 10), (Cuts{{3, 10}, {10, 20}, {20, 25}}));
  EXPECT_EQ(cut_into_chunks(10, 20, 10), (Cuts{{10, 20}}));
  EXPECT_EQ(cut_into_chunks(5, 5, 10), Cuts{});
  EXPECT_EQ(cut_into_chunks(0, 3, 0), (Cuts{{0, 1}, {1, 2}, {2, 3}}));
}

TEST(Format, NamesHeadersAndChecksums) {
  EXPECT_EQ(data_file_name(3), "rank-00003.bin");
  EXPECT_TRUE(check_checkpoint_name("step-100_a.b").ok());
  for (const char* bad :
       {"", ".hidden", "a/b", "latest", "latest.tmp", "latest.tmp-0a1b2c3d4e5f", "x y", "../up"}) {
    EXPECT_FALSE(check_checkpoint_name(bad).ok()) << bad;
  }
  // A name read from a hostile `latest` reaches messages escaped: no terminal escapes, and
  // a NUL does not cut the message.
  const Status escaped = check_checkpoint_name(std::string("a\x1b[31m\0b", 8));
  EXPECT_NE(escaped.message().find("a\\x1b[31m\\x00b"), std::string::npos) << escaped.message();
  EXPECT_EQ(escaped.message().find('\x1b'), std::string::npos);
  EXPECT_NE(check_checkpoint_name(".\x07").message().find(".\\x07"), std::string::npos);
  const std::string id = new_checkpoint_id();
  EXPECT_TRUE(is_checkpoint_id(id));
  EXPECT_NE(id, new_checkpoint_id());
  const std::string header = data_file_header(id, 5);
  ASSERT_EQ(header.size(), kDataHeaderBytes);
  const auto* h = reinterpret_cast<const uint8_t*>(header.data());
  EXPECT_TRUE(check_data_file_header(h, id, 5, "f").ok());
  EXPECT_NE(check_data_file_header(h, id, 4, "f").message().find("rank 5"), std::string::npos);
  EXPECT_NE(check_data_file_header(h, new_checkpoint_id(), 5, "f").message().find("belongs to"),
            std::string::npos);
  std::string newer = header;
  newer[8] = static_cast<char>(kFormatVersion + 1);  // the version, little-endian at byte 8
  EXPECT_NE(check_data_file_header(reinterpret_cast<const uint8_t*>(newer.data()), id, 5, "f")
                .message()
                .find("has format version " + std::to_string(kFormatVersion + 1)),
            std::string::npos);
  std::string garbage(kDataHeaderBytes, 'x');
  EXPECT_NE(check_data_file_header(reinterpret_cast<const uint8_t*>(garbage.data()), id, 5, "f")
                .message()
                .find("not an hpshard"),
            std::string::npos);
  EXPECT_EQ(hex64(0xabcdef0123456789ull), "abcdef0123456789");
  EXPECT_EQ(*parse_hex64("abcdef0123456789"), 0xabcdef0123456789ull);
  EXPECT_FALSE(parse_hex64("ABCDEF0123456789"));
  EXPECT_NE(checksum("a", 1), checksum("b", 1));
}

// The snapshot's fused copy: the destination holds the source's bytes and the sum is the
// one-shot checksum, at every size around the block and vector widths and any alignment.
TEST(Format, CopyWithChecksumCopiesAndSumsLikeTheOneShotChecksum) {
  std::mt19937_64 rng(17);
  std::vector<uint8_t> src((size_t{3} << 17) + 200), dst(src.size() + 64);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  const size_t block = size_t{64} << 10;
  for (size_t bytes :
       {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{63}, size_t{64}, size_t{65},
        size_t{1000}, block - 1, block, block + 1, 2 * block + 77, size_t{3} << 17}) {
    for (size_t dst_shift : {size_t{0}, size_t{1}, size_t{8}, size_t{15}}) {
      for (size_t src_shift : {size_t{0}, size_t{3}}) {
        std::fill(dst.begin(), dst.end(), 0xa5);
        const uint64_t sum =
            copy_with_checksum(dst.data() + dst_shift, src.data() + src_shift, bytes);
        SCOPED_TRACE(testing::Message()
                     << bytes << " bytes, dst +" << dst_shift << ", src +" << src_shift);
        EXPECT_EQ(sum, checksum(src.data() + src_shift, bytes));
        EXPECT_EQ(std::memcmp(dst.data() + dst_shift, src.data() + src_shift, bytes), 0);
        // Nothing written outside the destination.
        for (size_t i = 0; i < dst_shift; ++i) ASSERT_EQ(dst[i], 0xa5);
        for (size_t i = dst_shift + bytes; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xa5);
      }
    }
  }
}
// A host write racing the snapshot (a parameter view written right after a save): the sum
// is the stored bytes', so the checkpoint holds one value or the other and verifies, never
// bytes that fail their own checksum (the sum was of the source, read before the copy's).
TEST(Format, CopyWithChecksumSumsWhatItStoredWhileTheSourceChanges) {
  std::vector<uint8_t> src(size_t{16} << 20), dst(src.size());
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> writes{0};
  std::thread writer([&] {
    std::mt19937_64 rng(5);
    uint64_t n = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      const uint64_t r = rng();
      // A relaxed atomic store: the race is the copy's, as a racing host write's would be.
      std::atomic_ref<uint8_t>(src[r % src.size()])
          .store(static_cast<uint8_t>(r >> 32), std::memory_order_relaxed);
      ++n;
    }
    writes = n;
  });
  size_t rounds = 0, changed = 0;
  for (; rounds < 40; ++rounds) {
    const uint64_t sum = copy_with_checksum(dst.data(), src.data(), dst.size());
    if (sum != checksum(dst.data(), dst.size())) {
      ADD_FAILURE() << "round " << rounds << ": the sum is not of the bytes stored";
      break;
    }
    if (sum != checksum(src.data(), src.size())) ++changed;
  }
  stop = true;
  writer.join();
  EXPECT_GT(writes.load(), 0u);
  // The source did move under the copies (otherwise the test showed nothing).
  EXPECT_GT(changed, 0u);
}

TEST(Safetensors, HeaderRoundTripsAndHostileHeadersAreRefused) {
  uint64_t data = 0;
  auto header = safetensors_header({{"w", DType::kBFloat16, {2, 3}}, {"b", DType::kFloat32, {3}}},
                                   {{"format", "pt"}}, &data);
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(data, 2u * 3 * 2 + 3 * 4);
  EXPECT_EQ(header->size() % 8, 0u);
  auto parsed = parse_safetensors_header(header->substr(8), data, "m.safetensors");
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->metadata.at("format"), "pt");
  ASSERT_EQ(parsed->tensors.size(), 2u);
  for (const auto& t : parsed->tensors) {
    if (t.name == "w") {
      EXPECT_EQ(t.dtype, DType::kBFloat16);
      EXPECT_EQ(t.chunks[0].offset, 0u);
    } else {
      EXPECT_EQ(t.chunks[0].offset, 12u);
    }
  }
  const std::string deep = std::string(200, '[') + std::string(200, ']');
  const std::string long_name(5000, 'n');
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 9]}})", "do not hold 2"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8000]}})", "do not hold 2"},
      {R"({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})", "F8_E4M3"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", "[8, 0)"},
      {R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}})",
       "a dimension is not an unsigned integer"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
       "overlap"},
      {R"({"__metadata__": {"a": 1}})", "__metadata__ 'a' is not a string"},
      {R"({"__metadata__": [1]})", "__metadata__ is not an object"},
      {R"([1, 2])", "does not start with '{'"},
      // The format says the header starts with '{': a parser would skip these.
      {"\xEF\xBB\xBF"
       R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
       "does not start with '{'"},
      {R"( {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
       "does not start with '{'"},
      {"", "does not start with '{'"},
      {R"({"w": 3)", "not a JSON object"},
      {R"({"w": 3})", "'w' is not an object"},
      {R"({"": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", "bad name length"},
      {"{\"" + long_name + R"(": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
       "bad name length"},
      {R"({"w": {"dtype": "F32", "shape": [2]}})", "needs dtype (string), shape (array)"},
      {R"({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})", "needs dtype"},
      {R"({"w": {"dtype": "F32", "shape": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],
           "data_offsets": [0, 4]}})",
       "more than 16 dimensions"},
      {R"({"w": {"dtype": "F32", "shape": [16777216, 16777217], "data_offsets": [0, 4]}})",
       "more than 2^48 elements"},
      {R"({"w": {"dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 4]}})",
       "more than 2^48 elements"},
      {R"({"a": )" + deep + "}", "nested too deep"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
       "key 'w' repeated"},
      // The data is the tensors back to back: no hole between them, nothing after them.
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "v": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}})",
       "no tensor holds data bytes [8, 12)"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
       "no tensor holds data bytes [0, 4)"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
       "8 data bytes after the last tensor's"},
      // nlohmann stops reading at a NUL: what follows one would go unread.
      {R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})" +
           std::string("\0{\"v\": 1", 9),
       "the header is not a JSON object"},
  };
  for (const auto& [text, message] : bad) {
    auto refused = parse_safetensors_header(text, 16, "m.safetensors");
    ASSERT_FALSE(refused.ok()) << text;
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(refused.status().message().find(message), std::string::npos)
        << refused.status().to_string();
    EXPECT_NE(refused.status().message().find("m.safetensors"), std::string::npos);
  }
  EXPECT_FALSE(
      safetensors_header({{"w", DType::kFloat32, {1}}, {"w", DType::kFloat32, {1}}}, {}, &data)
          .ok())
      << "a repeated name";
  auto reserved = safetensors_header({{"__metadata__", DType::kFloat32, {1}}}, {}, &data);
  ASSERT_FALSE(reserved.ok());
  EXPECT_NE(reserved.status().message().find("no tensor can be named '__metadata__'"),
            std::string::npos)
      << reserved.status().to_string();
}

// A file whose header length does not fit it, or that is shorter than the length itself.
TEST(Safetensors, FilesWhoseHeaderLengthDoesNotFitAreRefused) {
  testing_util::TempDir dir;
  const std::string path = dir.path() + "/m.safetensors";
  auto write = [&](const std::string& bytes) {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
    std::fclose(f);
  };
  std::string length(8, '\0');
  length[0] = 100;  // 100 header bytes promised, 4 present
  write(length + "{}  ");
  auto refused = read_safetensors(path, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("header length 100 does not fit the file (12 bytes)"),
            std::string::npos)
      << refused.status().to_string();
  write("abc");
  refused = read_safetensors(path, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("too short"), std::string::npos);
  // A length past the limit is said to be that (it said "does not fit the file" of one it
  // fitted), and a header that long is not written in the first place.
  const uint64_t over = kMaxSafetensorsHeaderBytes + 8;
  std::string big(8, '\0');
  for (int i = 0; i < 8; ++i) big[static_cast<size_t>(i)] = static_cast<char>(over >> (8 * i));
  write(big + "{}");
  refused = read_safetensors(path, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("more than the 104857600 bytes allowed"),
            std::string::npos)
      << refused.status().to_string();
  std::map<std::string, std::string> metadata;
  for (int i = 0; i < 101; ++i) metadata["k" + std::to_string(i)] = std::string(1 << 20, 'v');
  uint64_t data = 0;
  auto header = safetensors_header({{"w", DType::kFloat32, {1}}}, metadata, &data);
  ASSERT_FALSE(header.ok());
  EXPECT_NE(header.status().message().find("a reader takes"), std::string::npos)
      << header.status().to_string();
  length[0] = 2;
  write(length + "{}");
  auto empty = read_safetensors(path, nullptr);
  ASSERT_TRUE(empty.ok()) << empty.status().to_string();
  EXPECT_TRUE(empty->tensors.empty());
}

SourceIndex source_with(std::vector<StoredTensor> tensors) {
  SourceIndex s;
  s.description = "checkpoint test";
  s.files = {{"rank-00000.bin", 0, 1 << 20}};
  s.tensors = std::move(tensors);
  return s;
}

// A stored tensor of `numel` elements in chunks of `per_chunk`.
StoredTensor stored(const std::string& name, DType dtype, uint64_t numel, uint64_t per_chunk) {
  StoredTensor t{name, dtype, {static_cast<int64_t>(numel)}, numel, {}};
  uint64_t offset = 64;
  for (const auto& [b, e] : cut_into_chunks(0, numel, per_chunk)) {
    t.chunks.push_back({0, b, e, offset, 0});
    offset += (e - b) * dtype_size(dtype);
  }
  return t;
}

TEST(Reshard, ReadsOnlyTheChunksHoldingTheRange) {
  const SourceIndex s = source_with({stored("param/w", DType::kFloat32, 100, 10)});
  auto plan =
      plan_load(s, {{"param/w", DType::kFloat32, {100}, 25, 47}}, SourceNaming::kCheckpoint, false);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_EQ(plan->pieces.size(), 3u);  // chunks [20,30), [30,40), [40,50)
  EXPECT_EQ(plan->pieces[0].chunk, 2u);
  EXPECT_EQ(plan->pieces[0].begin, 25u);
  EXPECT_EQ(plan->pieces[2].end, 47u);
  uint64_t covered = 0;
  for (const auto& p : plan->pieces) covered += p.end - p.begin;
  EXPECT_EQ(covered, 22u);
  auto empty =
      plan_load(s, {{"param/w", DType::kFloat32, {100}, 0, 0}}, SourceNaming::kCheckpoint, false);
  EXPECT_TRUE(empty->pieces.empty());
}

TEST(Reshard, ParametersComeFromMastersWhenTheDtypeDiffers) {
  // Saved as bf16 with fp32 masters.
  const SourceIndex bf16 = source_with(
      {stored("param/w", DType::kBFloat16, 8, 8), stored("master/w", DType::kFloat32, 8, 8)});
  auto into_fp32 =
      plan_load(bf16, {{"param/w", DType::kFloat32, {8}, 0, 8}}, SourceNaming::kCheckpoint, false);
  ASSERT_TRUE(into_fp32.ok()) << into_fp32.status().to_string();
  EXPECT_EQ(into_fp32->source_of_target[0], 1);  // the master; param/w (bf16) is not extra
  auto into_bf16 = plan_load(
      bf16, {{"param/w", DType::kBFloat16, {8}, 0, 8}, {"master/w", DType::kFloat32, {8}, 0, 8}},
      SourceNaming::kCheckpoint, false);
  ASSERT_TRUE(into_bf16.ok());
  EXPECT_EQ(into_bf16->source_of_target, (std::vector<int64_t>{0, 1}));
  auto into_fp16 = plan_load(
      bf16, {{"param/w", DType::kFloat16, {8}, 0, 8}, {"master/w", DType::kFloat32, {8}, 0, 8}},
      SourceNaming::kCheckpoint, false);
  EXPECT_EQ(into_fp16->source_of_target, (std::vector<int64_t>{1, 1}));
  // Saved as fp32: the parameter is its own master.
  const SourceIndex fp32 = source_with({stored("param/w", DType::kFloat32, 8, 8)});
  auto widened = plan_load(
      fp32, {{"param/w", DType::kBFloat16, {8}, 0, 8}, {"master/w", DType::kFloat32, {8}, 0, 8}},
      SourceNaming::kCheckpoint, false);
  ASSERT_TRUE(widened.ok());
  EXPECT_EQ(widened->source_of_target, (std::vector<int64_t>{0, 0}));
  // A model file's bare names fill both.
  const SourceIndex model = source_with({stored("w", DType::kFloat32, 8, 8)});
  auto bare = plan_load(
      model, {{"param/w", DType::kBFloat16, {8}, 0, 8}, {"master/w", DType::kFloat32, {8}, 0, 8}},
      SourceNaming::kBareParameters, false);
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ(bare->source_of_target, (std::vector<int64_t>{0, 0}));
}

TEST(Reshard, MissingExtraAndMismatchedTensorsAreNamed) {
  const SourceIndex s = source_with(
      {stored("param/w", DType::kFloat32, 8, 8), stored("momentum/w", DType::kFloat32, 8, 8),
       stored("param/old", DType::kFloat32, 3, 8), stored("step/good_steps", DType::kInt32, 1, 8)});
  const std::vector<TargetRange> targets = {{"param/w", DType::kFloat32, {8}, 0, 4},
                                            {"exp_avg/w", DType::kFloat32, {8}, 0, 4},
                                            {"step/good_steps", DType::kInt32, {1}, 0, 1}};
  auto refused = plan_load(s, targets, SourceNaming::kCheckpoint, false);
  ASSERT_FALSE(refused.ok());
  for (const char* name : {"exp_avg/w", "momentum/w", "param/old", "missing", "not registered"}) {
    EXPECT_NE(refused.status().message().find(name), std::string::npos)
        << refused.status().message();
  }
  auto partial = plan_load(s, targets, SourceNaming::kCheckpoint, true);
  ASSERT_TRUE(partial.ok());
  EXPECT_EQ(partial->unchanged, std::vector<std::string>{"exp_avg/w"});
  EXPECT_EQ(partial->unused, (std::vector<std::string>{"momentum/w", "param/old"}));
  EXPECT_EQ(partial->source_of_target[1], -1);
  auto shape =
      plan_load(s, {{"param/w", DType::kFloat32, {2, 4}, 0, 8}}, SourceNaming::kCheckpoint, true);
  ASSERT_FALSE(shape.ok());
  EXPECT_NE(shape.status().message().find("[2, 4]"), std::string::npos);
  // A tensor of another shape is that, not also one this engine does not register.
  auto whole =
      plan_load(s, {{"param/w", DType::kFloat32, {2, 4}, 0, 8}}, SourceNaming::kCheckpoint, false);
  ASSERT_FALSE(whole.ok());
  const std::string message = whole.status().message();
  const size_t extra = message.find("not registered here: ");
  ASSERT_NE(extra, std::string::npos) << message;  // momentum/w, param/old, step/good_steps
  EXPECT_EQ(message.find("'param/w'", extra), std::string::npos) << message;
  auto ints = plan_load(s, {{"step/good_steps", DType::kInt64, {1}, 0, 1}},
                        SourceNaming::kCheckpoint, true);
  ASSERT_FALSE(ints.ok());
  EXPECT_NE(ints.status().message().find("int32"), std::string::npos);
}

}  // namespace
}  // namespace hps::ckpt
