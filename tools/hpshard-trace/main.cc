// hpshard-trace: joins the timeline files the ranks of a run wrote (HPS_TRACE=DIR, one or
// more per process, and hpshard.torch's per-rank files beside them) into one Chrome-trace
// file, each rank a process row (opens in Perfetto and chrome://tracing).
//
//   hpshard-trace merge -o OUT INPUT...   INPUT: a trace file, or a directory of them
//
// Files of one run only: two processes that name one row differently (two runs of one
// rank, written into one HPS_TRACE directory) are refused rather than drawn as one. A file
// named twice is read once; a merge's own output is no rank's file (left out when found in
// a directory, refused when named).
//
// Exit status: 0 when merged; 1 when an input cannot be read or is not a trace, or two
// files hold one rank's row for different processes (the message names the files; nothing
// is written); 2 for bad usage.
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/common/json_input.h"
#include "core/common/output_file.h"
#include "core/common/shown_path.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Inputs are outside data: a file larger than this is refused rather than read whole.
constexpr std::uintmax_t kMaxInputBytes = std::uintmax_t{1} << 30;
constexpr size_t kMaxDepth = 64;

struct Failure {
  std::string message;
};

struct Input {
  fs::path path;
  bool listed = false;  // found in a directory the command line named
};

// Every trace file an input names: itself, or a directory's *.json files (sorted), less
// the output itself; a file named twice (or through two names) once.
std::vector<Input> expand(const std::vector<std::string>& inputs, const fs::path& output) {
  std::vector<Input> files;
  std::map<std::pair<dev_t, ino_t>, size_t> taken;  // each file's place in `files`
  auto add = [&](const fs::path& p, bool listed) {
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0) {
      const auto [it, fresh] = taken.emplace(std::make_pair(st.st_dev, st.st_ino), files.size());
      if (!fresh) {
        // Named on its own anywhere: so it counts, wherever it was found first.
        if (!listed) files[it->second].listed = false;
        return;
      }
    }
    files.push_back({p, listed});
  };
  std::error_code ec;
  const fs::path out_abs = fs::weakly_canonical(output, ec);
  for (const auto& input : inputs) {
    const fs::path p(input);
    if (fs::is_directory(p, ec)) {
      std::vector<fs::path> found;
      // Only the listing's own errors fail it: an entry that is not a regular file, or a
      // symbolic link that leads nowhere, is no trace file and is skipped (its error was left
      // in the listing's error code, and the merge failed when it came last).
      fs::directory_iterator entries(p, ec);
      for (; !ec && entries != fs::directory_iterator(); entries.increment(ec)) {
        const fs::directory_entry& entry = *entries;
        std::error_code entry_ec;
        if (!entry.is_regular_file(entry_ec) || entry.path().extension() != ".json") continue;
        if (fs::weakly_canonical(entry.path(), entry_ec) == out_abs) continue;
        found.push_back(entry.path());
      }
      if (ec)
        throw Failure{"cannot list the directory '" + hps::shown_path(input) +
                      "': " + ec.message()};
      std::sort(found.begin(), found.end());
      if (found.empty())
        throw Failure{"the directory '" + hps::shown_path(input) + "' holds no .json trace file"};
      for (const auto& f : found) add(f, true);
    } else if (fs::is_regular_file(p, ec)) {
      add(p, false);
    } else {
      throw Failure{"'" + hps::shown_path(input) + "' is neither a trace file nor a directory"};
    }
  }
  return files;
}

// The events of one file: a Chrome trace object with "traceEvents", or a bare array.
// `*merged`: the file is a merge's output (its otherData names what it was merged from).
json read_events(const fs::path& path, uint64_t* dropped, bool* merged) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) throw Failure{"cannot read '" + hps::shown_path(path.string()) + "': " + ec.message()};
  if (size > kMaxInputBytes) {
    throw Failure{"'" + hps::shown_path(path.string()) + "' is " + std::to_string(size) +
                  " bytes, more than a trace file may be (" + std::to_string(kMaxInputBytes) + ")"};
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Failure{"cannot open '" + hps::shown_path(path.string()) + "'"};
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // A trace's events nest a few levels (the trace, its events, their args); a deeper file
  // is refused before nlohmann builds, copies and dumps it recursively.
  hps::CheckedJson parsed = hps::parse_checked_json(text, kMaxDepth);
  if (parsed.problem == hps::CheckedJson::Problem::kTooDeep) {
    throw Failure{"'" + hps::shown_path(path.string()) + "' nests arrays and objects deeper than " +
                  std::to_string(kMaxDepth) + " levels: not a trace"};
  }
  if (parsed.problem != hps::CheckedJson::Problem::kNone) {
    throw Failure{
        "'" + hps::shown_path(path.string()) + "' is not valid JSON" +
        (parsed.problem == hps::CheckedJson::Problem::kRepeatedKey
             ? " (key '" + hps::escape_control_bytes(parsed.key.substr(0, 64), true) + "' repeated)"
             : std::string())};
  }
  json doc = std::move(parsed.value);
  json events;
  if (doc.is_array()) {
    events = std::move(doc);
  } else if (doc.is_object() && doc.contains("traceEvents") && doc["traceEvents"].is_array()) {
    events = std::move(doc["traceEvents"]);
    const auto other = doc.find("otherData");
    if (other != doc.end() && other->is_object()) {
      *merged = other->contains("merged_from");
      const auto d = other->find("dropped_events");
      if (d != other->end() && d->is_number_unsigned()) {
        const uint64_t more = d->get<uint64_t>();
        if (more > UINT64_MAX - *dropped) {
          throw Failure{"'" + hps::shown_path(path.string()) + "': dropped_events " +
                        std::to_string(more) + " overflows the total of the files before it"};
        }
        *dropped += more;
      }
    }
  } else {
    throw Failure{"'" + hps::shown_path(path.string()) +
                  "' is not a Chrome trace (no \"traceEvents\" array)"};
  }
  for (const auto& e : events) {
    if (!e.is_object() || !e.contains("ph") || !e["ph"].is_string()) {
      throw Failure{"'" + hps::shown_path(path.string()) +
                    "' holds an event without a phase (\"ph\")"};
    }
  }
  return events;
}

// A name from a file, for a message: at most 64 bytes, quoted and escaped as JSON.
std::string shown(const std::string& text) {
  return json(text.substr(0, 64)).dump(-1, ' ', false, json::error_handler_t::replace) +
         (text.size() > 64 ? "... (" + std::to_string(text.size()) + " bytes)" : "");
}

// Refuses a "process_name" event that names its row (pid) for another process than an
// earlier file did: the library's files name the row "rank R (pid P)", so two processes of
// one rank (two runs into one HPS_TRACE directory) would share a row and their tracks.
void check_row(std::map<std::string, std::pair<std::string, std::string>>& row_process,
               const json& e, const std::string& path) {
  if (e.value("name", json()) != "process_name") return;
  const auto args = e.find("args");
  if (args == e.end() || !args->is_object()) return;
  const auto name = args->find("name");
  if (name == args->end() || !name->is_string()) return;
  const std::string row = e.value("pid", json()).dump(-1, ' ', true);
  // The library's files also name the process itself: two of one name and pid (other pid
  // namespaces or hosts) differ there.
  const auto id = args->find("hpshard_process");
  const std::string process =
      name->get<std::string>() +
      (id != args->end() && id->is_string() ? "\n" + id->get<std::string>() : std::string());
  const auto [it, first] = row_process.emplace(row, std::make_pair(process, path));
  if (first || it->second.first == process) return;
  const auto name_of = [](const std::string& p) { return p.substr(0, p.find('\n')); };
  const std::string a = name_of(it->second.first), b = name_of(process);
  throw Failure{"'" + hps::shown_path(it->second.second) + "' and '" + hps::shown_path(path) +
                "' hold one row (pid " + row.substr(0, 64) + ") for two processes, " + shown(a) +
                " and " + shown(b) +
                (a == b ? " (of one name: in other pid namespaces or on other hosts)" : "") +
                ": the files of two runs cannot be merged into one trace (each rank a row); "
                "merge each run's files apart"};
}

// Streams the events out as each file is read: memory holds one input file's events at a
// time, whatever the run's total.
int merge(const std::vector<std::string>& inputs, const std::string& output) {
  const auto files = expand(inputs, output);
  // Whole or absent: written beside the target, then renamed over it (a symbolic link
  // followed, anything but a regular file refused: core/common/output_file.h).
  const hps::OutputFile checked = hps::output_file(output);
  if (!checked.error.empty())
    throw Failure{"cannot write '" + hps::shown_path(output) + "': " + checked.error};
  const fs::path target(checked.target);
  // A temporary of this merge's own: concurrent merges to one output each publish a whole
  // file, and no file of another name is truncated.
  std::string partial;
  const int fd = hps::create_beside(target.string(), &partial);
  if (fd < 0) {
    throw Failure{"cannot write beside '" + hps::shown_path(output) + "': " + std::strerror(errno)};
  }
  std::FILE* file = ::fdopen(fd, "wb");
  if (file == nullptr) {
    const int err = errno;
    ::close(fd);
    ::unlink(partial.c_str());
    throw Failure{"cannot write '" + hps::shown_path(partial) + "': " + std::strerror(err)};
  }
  const auto put = [&](const std::string& text) {
    if (std::fwrite(text.data(), 1, text.size(), file) != text.size()) {
      throw Failure{"cannot write '" + hps::shown_path(partial) + "': " + std::strerror(errno)};
    }
  };
  size_t count = 0;
  size_t merged_inputs = 0;
  try {
    // Metadata (names, sort order) once per (pid, tid, kind): a rank writes it in every file.
    std::set<std::tuple<std::string, std::string, std::string>> seen;
    // Each row's process (its "process_name": "rank 0 (pid 12580)") and the file that named
    // it first: a second process on one row is a second run's, and is refused.
    std::map<std::string, std::pair<std::string, std::string>> row_process;
    uint64_t dropped = 0;
    json sources = json::array();
    put("{\"traceEvents\":[");
    for (const auto& [path, listed] : files) {
      bool merged = false;
      const json events = read_events(path, &dropped, &merged);
      // A merge's output holds the ranks' events again: one found beside the ranks' files (an
      // earlier merge written into the directory) is left out; one named on its own is an
      // error.
      if (merged) {
        if (!listed) {
          throw Failure{"'" + hps::shown_path(path.string()) +
                        "' is a merged trace (hpshard-trace's output): merge the ranks' files"};
        }
        std::fprintf(stderr, "hpshard-trace: left out '%s': a merged trace, not a rank's file\n",
                     hps::shown_path(path.string()).c_str());
        ++merged_inputs;
        continue;
      }
      for (const auto& e : events) {
        if (e["ph"] == "M") {
          check_row(row_process, e, path.string());
          auto key = std::make_tuple(e.value("pid", json()).dump(), e.value("tid", json()).dump(),
                                     e.value("name", json()).dump());
          if (!seen.insert(key).second) continue;
        }
        put((count++ == 0 ? "" : ",") + e.dump());
      }
      sources.push_back(path.string());
    }
    if (merged_inputs == files.size()) {
      throw Failure{"no rank's trace file among the inputs (only earlier merges' outputs)"};
    }
    const json other = {{"merged_from", sources}, {"dropped_events", dropped}};
    // Paths need not be UTF-8: such bytes are replaced in the listing of sources.
    put("],\"displayTimeUnit\":\"ms\",\"otherData\":" +
        other.dump(-1, ' ', false, json::error_handler_t::replace) + "}");
    const int closed = std::fclose(file);
    file = nullptr;
    if (closed != 0)
      throw Failure{"cannot write '" + hps::shown_path(partial) + "': " + std::strerror(errno)};
  } catch (...) {
    if (file != nullptr) std::fclose(file);
    ::unlink(partial.c_str());
    throw;
  }
  std::error_code ec;
  fs::rename(partial, target, ec);
  if (ec) {
    ::unlink(partial.c_str());
    throw Failure{"cannot write '" + hps::shown_path(output) + "': " + ec.message()};
  }
  std::printf("%s: %zu events from %zu files\n", hps::shown_path(output).c_str(), count,
              files.size() - merged_inputs);

  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hpshard-trace: the timeline files of a run (HPS_TRACE=DIR) as one Chrome trace"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "hpshard-trace " HPS_TOOLS_VERSION);
  std::string output;
  std::vector<std::string> inputs;
  auto* merge_cmd =
      app.add_subcommand("merge",
                         "join one run's trace files (or directories of them) into one file, "
                         "each rank a process row (two processes of one rank: exit 1)");
  merge_cmd->add_option("-o,--output", output, "the merged trace file")->required();
  merge_cmd->add_option("inputs", inputs, "trace files or directories")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    return merge(inputs, output);
  } catch (const Failure& f) {
    std::fprintf(stderr, "hpshard-trace: %s\n", f.message.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hpshard-trace: %s\n", e.what());
    return 1;
  }
}
