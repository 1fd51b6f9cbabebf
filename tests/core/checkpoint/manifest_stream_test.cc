// A manifest read from disk is parsed in one SAX pass that builds no document: its
// checksum is still that of nlohmann's compact dump of the document (docs/checkpoints.md),
// whatever order its keys come in, and a hostile manifest costs a small multiple of its
// size in memory, and a Status when even that is more than there is.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/checkpoint/format.h"
#include "core/checkpoint/manifest.h"
#include "tests/core/checkpoint/hostile_text.h"

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

// Hostile manifests of 64 MiB, each parsed in a child whose address space may grow by 6x
// the text at most: each gives a Status (an allocation refused included), none aborts.
TEST(ManifestStream, HostileManifestsStayWithinAFewTimesTheirSize) {
#ifdef HPS_TEST_SANITIZED
  GTEST_SKIP() << "a sanitizer's allocator reserves address space of its own";
#else
  constexpr size_t kBytes = size_t{64} << 20;
  const std::pair<const char*, std::string> cases[] = {
      {"zeros under an unknown key", testing_util::repeated(R"({"x":[)", "0", "]}", kBytes)},
      {"a huge shape", testing_util::repeated(R"({"tensors":[{"shape":[)", "0", "]}]}", kBytes)},
      {"tiny metadata entries",
       testing_util::repeated(R"({"metadata":{)", R"("k%09d":"")", "}}", kBytes)},
      {"tiny chunks", testing_util::repeated(
                          R"({"tensors":[{"chunks":[)",
                          R"({"begin":%d,"end":%d,"file":0,"offset":64,"xxh3":"0000000000000000"})",
                          R"(],"dtype":"uint8","name":"t","shape":[1]}]})", kBytes)},
      {"empty chunks", testing_util::repeated(R"({"tensors":[{"chunks":[)", "{}", "]}]}", kBytes)},
      {"empty tensors", testing_util::repeated(R"({"tensors":[)", "{}", "]}", kBytes)},
  };
  for (const auto& [what, text] : cases) {
    EXPECT_TRUE(testing_util::read_within(what, text.size(), 6, [&text = text](std::string& shown) {
      auto m = parse_manifest(text, "hostile/manifest.json");
      shown = m.status().to_string();
      return !m.ok() && m.status().code() != StatusCode::kOutOfMemory;
    }));
  }
  // A manifest sound but for its 4 million tiny metadata entries (no checksum of its own, as
  // before manifests carried one, so its fields are read): refused by their count before any
  // is kept. Keeping them took 9 times the text.
  std::string sound = manifest_to_json(sample());
  json j = json::parse(sound);
  j.erase(std::string(kManifestChecksumKey));
  j["metadata"] = json::object();
  sound = j.dump();
  const std::string key = R"("metadata":{})";
  const size_t at = sound.find(key);
  ASSERT_NE(at, std::string::npos) << sound;
  const std::string tiny = sound.substr(0, at) +
                           testing_util::repeated(R"("metadata":{)", R"("k%09d":"")", "}", kBytes) +
                           sound.substr(at + key.size());
  EXPECT_TRUE(testing_util::read_within(
      "a sound manifest of tiny metadata entries", tiny.size(), 6, [&tiny](std::string& shown) {
        auto m = parse_manifest(tiny, "hostile/manifest.json");
        shown = m.status().to_string();
        return !m.ok() && m.status().code() == StatusCode::kInvalidArgument &&
               m.status().message().find("more than the 65536 allowed") != std::string::npos;
      }));
#endif
}

}  // namespace
}  // namespace hps::ckpt
