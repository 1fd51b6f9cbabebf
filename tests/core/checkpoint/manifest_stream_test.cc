// A manifest read from disk is parsed in one SAX pass that builds no document: its
// checksum is still that of nlohmann's compact dump of the document (docs/checkpoints.md),
// whatever order its keys come in, and a hostile manifest costs a small multiple of its
// size in memory, and a Status when even that is more than there is.
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/checkpoint/format.h"
#include "core/checkpoint/manifest.h"

namespace hps::ckpt {
namespace {

using json = nlohmann::json;

Manifest sample() {
  Manifest m;
  m.id = "0123456789abcdef0123456789abcdef";
  m.name = "step-5";
  m.created_unix_ns = 42;
  m.chunk_bytes = 40;
  m.topology = {2, 2, 0, 1, 0, 256};
  m.world = 2;
  m.engine = EngineOptions{};
  m.metadata = {{"step", "5"}};
  m.files = {{"rank-00000.bin", 0, 64 + 56}, {"rank-00001.bin", 1, 64 + 32}};
  StoredTensor w{"param/w", DType::kFloat32, {4, 5}, 20, {}};
  w.chunks = {{0, 0, 10, 64, 0x1111}, {0, 10, 12, 104, 0x2222}, {1, 12, 20, 64, 0x3333}};
  m.tensors = {w};
  return m;
}

// JSON texts whose values nlohmann reads in ways a dump writes otherwise: exponents, -0,
// integers beyond 64 bits, escapes, control characters, UTF-8, keys that sort otherwise
// escaped than raw.
const char* const kTokens[] = {"1e2",
                               "-0",
                               "-0.0",
                               "0.1",
                               "1E+2",
                               "2.5",
                               "5e-324",

                               "3.141592653589793238",
                               "18446744073709551615",
                               "18446744073709551616",
                               "-9223372036854775808",
                               "-9223372036854775809",
                               "123456789012345678901234567890",
                               "true",
                               "false",
                               "null",
                               R"("\u0001\u001f")",
                               R"("caf\u00e9")",
                               R"("\ud83d\ude00")",
                               R"("\/\\\"")",
                               "\"\xc3\xa9\xe2\x82\xac\"",
                               R"([1e2,{"b":-0,"a":[]}])",
                               R"({"z":1,"a":{"y":2,"b":"\u00ff"},"\u0000k":0})",
                               R"({"\"q":1,"!":2,"#":3,"\\":4})",
                               R"([])",
                               R"({})",
                               R"("")"};
const char* const kKeys[] = {"zz_extra", "aa_extra", "\xc3\xa9t\xc3\xa9", "A", "x\ty", "\x7f",
                             "\"",       "~"};
constexpr std::string_view kRaw = "\x01raw:";

// Adds unknown members (values from kTokens) to `j` and the objects in it.
void add_unknown(json& j, std::mt19937& rng, bool metadata = false) {
  if (j.is_array()) {
    for (json& e : j) add_unknown(e, rng);
    return;
  }
  if (!j.is_object()) return;
  for (auto& [k, v] : j.items()) add_unknown(v, rng, k == "metadata");
  const size_t n = rng() % 3;
  for (size_t i = 0; i < n; ++i) {
    std::string key = kKeys[rng() % std::size(kKeys)];
    if (j.contains(key)) continue;
    const std::string token = kTokens[rng() % std::size(kTokens)];
    // Metadata holds strings only.
    if (metadata && token[0] != '"') continue;
    j[key] = std::string(kRaw) + token;
  }
}

// `j` as JSON text with each object's keys shuffled and spaces here and there.
void emit(const json& j, std::mt19937& rng, std::string& out) {
  auto space = [&] {
    if (rng() % 4 == 0) out += rng() % 2 ? " " : "\n ";
  };
  if (j.is_object()) {
    std::vector<std::string> keys;
    for (const auto& [k, v] : j.items()) keys.push_back(k);
    std::shuffle(keys.begin(), keys.end(), rng);
    out += '{';
    for (size_t i = 0; i < keys.size(); ++i) {
      if (i > 0) out += ',';
      space();
      out += json(keys[i]).dump();
      out += ':';
      space();
      emit(j.at(keys[i]), rng, out);
    }
    out += '}';
  } else if (j.is_array()) {
    out += '[';
    for (size_t i = 0; i < j.size(); ++i) {
      if (i > 0) out += ',';
      space();
      emit(j[i], rng, out);
    }
    out += ']';
  } else if (j.is_string() && j.get_ref<const std::string&>().rfind(kRaw, 0) == 0) {
    out += j.get_ref<const std::string&>().substr(kRaw.size());
  } else {
    out += j.dump();
  }
}

// What a manifest's checksum is of (docs/checkpoints.md), computed from its document as
// parse_manifest computed it before it read manifests in one pass.
uint64_t dom_checksum(const std::string& text) {
  json j = json::parse(text);
  j.erase(std::string(kManifestChecksumKey));
  const std::string dump = j.dump(-1, ' ', false, json::error_handler_t::replace);
  return checksum(dump.data(), dump.size());
}

TEST(ManifestStream, ChecksumIsThatOfTheDocumentsCompactDump) {
  std::mt19937 rng(20261206);
  const json written = json::parse(manifest_to_json(sample()));
  for (int round = 0; round < 300; ++round) {
    json j = written;
    j.erase(std::string(kManifestChecksumKey));
    add_unknown(j, rng);
    std::string unsummed;
    emit(j, rng, unsummed);
    const uint64_t expected = dom_checksum(unsummed);
    for (bool right : {true, false}) {
      j[std::string(kManifestChecksumKey)] = hex64(right ? expected : expected ^ 1);
      std::string text;
      emit(j, rng, text);
      auto m = parse_manifest(text, "m.json");
      if (right) {
        ASSERT_TRUE(m.ok()) << m.status().to_string() << "\n" << text;
        EXPECT_TRUE(m->checksummed);
        EXPECT_EQ(m->tensors.size(), 1u);
      } else {
        ASSERT_FALSE(m.ok()) << text;
        EXPECT_NE(m.status().message().find("does not match its contents"), std::string::npos)
            << m.status().message();
      }
    }
  }
  // Invalid UTF-8 is no JSON nlohmann reads: refused as before, not replaced.
  std::string text = manifest_to_json(sample());
  text.replace(text.find("\"5\""), 3, "\"\xff\"");
  auto m = parse_manifest(text, "m.json");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("m.json: not valid JSON"), std::string::npos);
}

// Manifests written before the reader read them in one pass verify bit for bit.
TEST(ManifestStream, WrittenManifestsVerify) {
  Manifest m = sample();
  m.metadata["\xc3\xa9t\xc3\xa9"] = "caf\xc3\xa9 \x01\t\"\\";
  m.metadata["a"] = "";
  const std::string text = manifest_to_json(m);
  auto back = parse_manifest(text, "m.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_TRUE(back->checksummed);
  EXPECT_EQ(back->metadata, m.metadata);
  EXPECT_EQ(manifest_to_json(*back), text);
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define HPS_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define HPS_TEST_SANITIZED 1
#endif
#endif

[[maybe_unused]] size_t status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stoul(line.substr(std::strlen(field)));
  }
  return 0;
}

// About `bytes` of JSON: `head`, then `element` (with %d its number) over and over, then
// `tail`.
[[maybe_unused]] std::string repeated(const std::string& head, const std::string& element,
                                      const std::string& tail, size_t bytes) {
  std::string text = head;
  text.reserve(bytes + 256);
  char buffer[512];
  for (int i = 0; text.size() < bytes; ++i) {
    if (i > 0) text += ',';
    std::snprintf(buffer, sizeof buffer, element.c_str(), i, i + 1);
    text += buffer;
  }
  return text + tail;
}

// Hostile manifests of 64 MiB, each parsed in a child whose address space may grow by 6x
// the text at most: each gives a Status (an allocation refused included), none aborts.
TEST(ManifestStream, HostileManifestsStayWithinAFewTimesTheirSize) {
#ifdef HPS_TEST_SANITIZED
  GTEST_SKIP() << "a sanitizer's allocator reserves address space of its own";
#else
  constexpr size_t kBytes = size_t{64} << 20;
  const std::pair<const char*, std::string> cases[] = {
      {"zeros under an unknown key", repeated(R"({"x":[)", "0", "]}", kBytes)},
      {"a huge shape", repeated(R"({"tensors":[{"shape":[)", "0", "]}]}", kBytes)},
      {"tiny metadata entries", repeated(R"({"metadata":{)", R"("k%09d":"")", "}}", kBytes)},
      {"tiny chunks",
       repeated(R"({"tensors":[{"chunks":[)",
                R"({"begin":%d,"end":%d,"file":0,"offset":64,"xxh3":"0000000000000000"})",
                R"(],"dtype":"uint8","name":"t","shape":[1]}]})", kBytes)},
      {"empty chunks", repeated(R"({"tensors":[{"chunks":[)", "{}", "]}]}", kBytes)},
      {"empty tensors", repeated(R"({"tensors":[)", "{}", "]}", kBytes)},
  };
  for (const auto& [what, text] : cases) {
    std::fflush(nullptr);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // Peak resident memory counted from here (Linux 4.0 on): what the parse touches,
      // once the pages the parent freed are given back.
      ::malloc_trim(0);
      if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
        std::fputs("5", f);
        std::fclose(f);
      }
      const size_t resident = status_kib("VmRSS:") << 10;
      const size_t before = status_kib("VmSize:") << 10;
      const rlimit limit{before + 6 * text.size(), before + 6 * text.size()};
      ::setrlimit(RLIMIT_AS, &limit);
      auto m = parse_manifest(text, "hostile/manifest.json");
      std::fprintf(stderr, "%s (%zu MiB): %zu MiB more resident at the peak; %s\n", what,
                   text.size() >> 20, ((status_kib("VmHWM:") << 10) - resident) >> 20,
                   m.status().to_string().substr(0, 160).c_str());
      ::_exit(m.ok() ? 1 : 0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << what << ": " << (WIFSIGNALED(status) ? "killed by signal " : "exit ")
        << (WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
  }
#endif
}

}  // namespace
}  // namespace hps::ckpt
