// hpshard-ckpt: look into, check and convert hpshard checkpoints.
//
//   hpshard-ckpt inspect PATH [--json]      what a checkpoint holds (PATH: a checkpoint, or a
//                                           root whose latest is shown)
//   hpshard-ckpt verify PATH                every data file's header and size, every chunk's
//                                           checksum, the manifest's own checksum
//   hpshard-ckpt export PATH OUT [--fp32]   the model as one safetensors file
//   hpshard-ckpt list ROOT                  the checkpoints under a root, oldest first
//
// Exit status: 0 on success, 1 when the checkpoint is bad or an operation failed, 2 for bad
// usage.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "core/checkpoint/checkpointer.h"
#include "core/checkpoint/file_io.h"
#include "core/checkpoint/reshard.h"
#include "core/common/env.h"

namespace {

using namespace hps;

std::string printable(const std::string& text, bool escape_backslashes = true);

// Messages name paths and values from the checkpoint. The library shows the values it quotes
// escaped already (\xNN, a backslash as \x5c): its backslashes stay as they are (escaped again,
// "\x1b" read "\\x1b"), and control bytes from elsewhere in the message (a path) are escaped.
int fail(const Status& s) {
  std::fprintf(stderr, "hpshard-ckpt: %s\n", printable(s.to_string(), false).c_str());
  return 1;
}

std::string utc(int64_t unix_ns) {
  const std::time_t seconds = static_cast<std::time_t>(unix_ns / 1000000000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

std::string engine_text(const EngineOptions& e) {
  char text[512];
  if (e.optimizer == OptimizerKind::kAdamW) {
    std::snprintf(text, sizeof text, "AdamW lr %g betas (%g, %g) eps %g weight decay %g",
                  e.adamw.learning_rate, e.adamw.beta1, e.adamw.beta2, e.adamw.epsilon,
                  e.adamw.weight_decay);
  } else {
    std::snprintf(text, sizeof text, "SGD lr %g momentum %g%s weight decay %g", e.sgd.learning_rate,
                  e.sgd.momentum, e.sgd.nesterov ? " (nesterov)" : "", e.sgd.weight_decay);
  }
  std::string out = text;
  std::snprintf(
      text, sizeof text, "; clip %g%s; accumulation %d; prefetch window %d; loss scaling %s",
      e.clip_max_norm, e.deterministic_clip ? " (deterministic)" : "", e.accumulation_steps,
      e.prefetch_window, e.dynamic_loss_scaling ? "dynamic" : "off");
  out += text;
  if (e.dynamic_loss_scaling) {
    std::snprintf(text, sizeof text, " (initial %g, growth %g every %d, backoff %g)",
                  e.initial_loss_scale, e.growth_factor, e.growth_interval, e.backoff_factor);
    out += text;
  }
  return out;
}

// A manifest's strings and a root's entries are the writer's: shown with their control bytes
// (and backslashes, unless told otherwise) escaped.
std::string printable(const std::string& text, bool escape_backslashes) {
  return hps::escape_control_bytes(text, escape_backslashes);
}

// "  (part: mp rank 1 of 2, pp rank 0 of 2)" for a part of a model cut across mp and pp.
std::string part_text(const ckpt::Manifest& m) {
  if (m.topology.mp <= 1 && m.topology.pp <= 1) return "";
  return "  (part: mp rank " + std::to_string(m.topology.mp_rank) + " of " +
         std::to_string(m.topology.mp) + ", pp rank " + std::to_string(m.topology.pp_rank) +
         " of " + std::to_string(m.topology.pp) + ")";
}

int inspect(const std::string& path, bool as_json) {
  auto directory = resolve_checkpoint(path);
  if (!directory.ok()) return fail(directory.status());
  auto m = ckpt::read_manifest(*directory);
  if (!m.ok()) return fail(m.status());
  if (as_json) {
    std::fputs(ckpt::manifest_to_json(*m).c_str(), stdout);
    return 0;
  }
  uint64_t bytes = 0;
  for (const auto& t : m->tensors) bytes += t.numel * dtype_size(t.dtype);
  std::printf("checkpoint %s\n", directory->c_str());
  std::printf("  name %s, id %s, format version %u, published %s\n", printable(m->name).c_str(),
              m->id.c_str(), m->format_version, utc(m->created_unix_ns).c_str());
  std::printf(
      "  written by stage %d engines: sharding %d x dp %d (%d ranks), alignment %llu "
      "bytes, checksummed chunks of %llu bytes\n",
      m->topology.stage, m->topology.sharding, m->topology.dp, m->world,
      static_cast<unsigned long long>(m->topology.alignment_bytes),
      static_cast<unsigned long long>(m->chunk_bytes));
  if (m->engine) std::printf("  engine: %s\n", engine_text(*m->engine).c_str());
  if (m->topology.mp > 1 || m->topology.pp > 1) {
    std::printf("  a part of a model cut across mp and pp: mp rank %d of %d, pp rank %d of %d\n",
                m->topology.mp_rank, m->topology.mp, m->topology.pp_rank, m->topology.pp);
  }
  for (const auto& [k, v] : m->metadata) {
    std::printf("  metadata %s = %s\n", printable(k).c_str(), printable(v).c_str());
  }
  for (const auto& f : m->files) {
    std::printf("  file %s (rank %d): %llu bytes\n", f.name.c_str(), f.rank,
                static_cast<unsigned long long>(f.bytes));
  }
  std::printf("  %zu tensors, %llu bytes:\n", m->tensors.size(),
              static_cast<unsigned long long>(bytes));
  for (const auto& t : m->tensors) {
    std::printf("    %-40s %-9s %-16s %zu chunk%s\n", t.name.c_str(),
                std::string(dtype_name(t.dtype)).c_str(), ckpt::shape_text(t.shape).c_str(),
                t.chunks.size(), t.chunks.size() == 1 ? "" : "s");
  }
  return 0;
}

int verify(const std::string& path) {
  auto directory = resolve_checkpoint(path);
  if (!directory.ok()) return fail(directory.status());
  auto report = verify_checkpoint(*directory);
  if (!report.ok()) return fail(report.status());
  std::printf(
      "%s: OK: %llu files, %llu tensors, %llu chunks, %llu bytes checked%s\n", directory->c_str(),
      static_cast<unsigned long long>(report->files),
      static_cast<unsigned long long>(report->tensors),
      static_cast<unsigned long long>(report->chunks),
      static_cast<unsigned long long>(report->bytes),
      report->manifest_checksummed
          ? ", and the manifest's own checksum"
          : "; the manifest carries no checksum of its own (written before manifests carried one): "
            "its contents went unchecked");
  return 0;
}

int export_model(const std::string& path, const std::string& out, bool fp32) {
  auto directory = resolve_checkpoint(path);
  if (!directory.ok()) return fail(directory.status());
  Status s = export_safetensors(*directory, out, fp32);
  if (!s.ok()) return fail(s);
  auto m = ckpt::read_manifest(*directory);
  std::printf("wrote %s from %s%s%s\n", out.c_str(), directory->c_str(),
              m.ok() ? part_text(*m).c_str() : "",
              fp32 ? " (float32, from the fp32 masters where saved)" : "");
  return 0;
}

int list(const std::string& root) {
  auto names = ckpt::list_directory(root);
  if (!names.ok()) return fail(names.status());
  auto latest = latest_checkpoint(root);
  std::vector<std::tuple<uint64_t, int64_t, std::string, std::string>> rows;
  for (const auto& n : *names) {
    if (n.empty() || n[0] == '.' || n == ckpt::kLatestFile) continue;
    std::error_code ec;
    if (!std::filesystem::is_directory(ckpt::join_path(root, n), ec)) continue;  // a file
    auto m = ckpt::read_manifest(ckpt::join_path(root, n));
    if (!m.ok()) {
      // Not a checkpoint (no manifest) is not listed; a manifest that does not read is said.
      if (m.status().code() != StatusCode::kNotFound) {
        std::fprintf(stderr, "hpshard-ckpt: %s not listed: %s\n", printable(n).c_str(),
                     printable(m.status().to_string(), false).c_str());
      }
      continue;
    }
    rows.emplace_back(m->sequence, m->created_unix_ns, n, m->id + part_text(*m));
  }
  std::sort(rows.begin(), rows.end());  // in the order of publication (Manifest::sequence)
  bool latest_listed = false;
  for (const auto& [sequence, created, name, id] : rows) {
    const bool is_latest = latest.ok() && *latest == name;
    latest_listed = latest_listed || is_latest;
    std::printf("%s  %s  %s%s\n", utc(created).c_str(), id.c_str(), printable(name).c_str(),
                is_latest ? "  (latest)" : "");
  }
  // A latest pointer that names no listed checkpoint (removed by hand, or unreadable).
  if (latest.ok() && !latest_listed) {
    std::fprintf(stderr, "hpshard-ckpt: %s names '%s', which is not a checkpoint here\n",
                 ckpt::join_path(root, std::string(ckpt::kLatestFile)).c_str(),
                 printable(*latest).c_str());
  } else if (!latest.ok() && latest.status().code() != StatusCode::kNotFound) {
    std::fprintf(stderr, "hpshard-ckpt: %s\n",
                 printable(latest.status().to_string(), false).c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hpshard-ckpt: inspect, verify and export hpshard checkpoints"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "hpshard-ckpt " HPS_TOOLS_VERSION);
  app.footer(
      "Exit status: 0 on success; 1 when the checkpoint is unreadable, damaged or refused "
      "(verify: a checksum, size or header that does not match), the message naming the file "
      "and tensor; 2 for bad usage.");
  std::string path, out;
  bool as_json = false, fp32 = false;
  auto* inspect_cmd = app.add_subcommand("inspect", "what a checkpoint holds");
  inspect_cmd->add_option("path", path, "a checkpoint directory, or a root (its latest)")
      ->required();
  inspect_cmd->add_flag("--json", as_json, "print the manifest as JSON");
  auto* verify_cmd = app.add_subcommand("verify", "check every file header, size and checksum");
  verify_cmd->add_option("path", path, "a checkpoint directory, or a root (its latest)")
      ->required();
  auto* export_cmd = app.add_subcommand("export", "write the model as one safetensors file");
  export_cmd->add_option("path", path, "a checkpoint directory, or a root (its latest)")
      ->required();
  export_cmd->add_option("out", out, "the safetensors file to write")->required();
  export_cmd->add_flag("--fp32", fp32, "every parameter as float32 (the fp32 masters where saved)");
  auto* list_cmd = app.add_subcommand("list", "the checkpoints under a root, oldest first");
  list_cmd->add_option("root", path, "a root of checkpoints")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    if (inspect_cmd->parsed()) return inspect(path, as_json);
    if (verify_cmd->parsed()) return verify(path);
    if (export_cmd->parsed()) return export_model(path, out, fp32);
    return list(path);
  } catch (const std::bad_alloc&) {
    return fail(out_of_memory("not enough memory for '" + path + "'"));
  } catch (const std::exception& e) {
    return fail(internal_error(std::string("'") + path + "': " + e.what()));
  }
}
