// Checkpointer: sharded, asynchronous, atomic, verified checkpoints of one engine
// (Checkpointable) over the group of ranks that hold its state, under one root directory
// every rank sees (one host, or a shared filesystem).
//
// save(name): returns at once. The snapshot is taken in stream order: after the work
// already enqueued on the engine's state stream, copies of this rank's written ranges go
// into host staging on a side stream, and the state stream waits for them, so the steps
// that follow cannot change what is saved and the caller's thread never blocks. A
// background thread writes each rank's data file (O_DIRECT where the filesystem allows),
// fsyncs it, and the ranks' writers agree (over a communicator of their own) on the
// manifest, which rank 0 writes last into the temporary directory; fsyncs; renames it to
// <root>/<name>; fsyncs the root; replaces <root>/latest atomically; then renames the
// checkpoints beyond the newest keep_last away and deletes their files after the save's
// Work completes. A crash at any moment leaves the previous checkpoints intact and the new
// one complete or absent. A save while another is in flight first waits for it (a
// host-blocking wait, counted as a host sync). The staging memory (as large as this rank's
// written state) stays allocated for the next save or load; the writer thread runs at a
// lower scheduling priority (nice 10) than the training threads.
//
// load(name): every rank reads only the chunks holding its own ranges, checks each
// against its checksum, and converts dtypes; on an error (bad data, a missing or extra
// tensor, a checkpoint of another model) on any rank every engine is left unchanged. A CPU
// engine is read into in place, each tensor's values first copied aside into the staging
// memory (while the reads wait for the disk) and copied back on an error; other devices
// read into the staging memory and copy it into the engine only once every rank has read
// everything. Host-blocking.
//
// The saves list the root's checkpoints (for the new one's sequence, and for keep_last's
// rotation): each manifest there is read once while its file stays the same (device,
// inode, size, modification and change times), and again when it changed, so another job's
// checkpoints under the same root count as they are.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/checkpoint/checkpointable.h"
#include "core/checkpoint/manifest.h"
#include "core/checkpoint/reader.h"
#include "core/checkpoint/staging.h"
#include "core/comm/communicator.h"

namespace hps {

// What a checkpointer learned of the manifests under its root (defined in checkpointer.cc).
class PublishedManifests;

struct CheckpointOptions {
  // > 0: after a save is published, older checkpoints under the root beyond the newest
  // `keep_last` are deleted (a part of a model keeps at least 2). 0 keeps all.
  int32_t keep_last = 0;
  // Ranges are checksummed in chunks of this size; a rank reads the chunks that hold its
  // ranges, so it reads at most one chunk more at each end of a range.
  uint64_t chunk_bytes = ckpt::kDefaultChunkBytes;
  // Bounds each agreement among the ranks of a save or a load (the slowest rank's write or
  // read comes first).
  Milliseconds timeout{1'800'000};
};

struct CheckpointLoadOptions {
  // Tensors the engine has but the source lacks stay unchanged, and tensors the source has
  // but the engine lacks are skipped, instead of being an error naming them.
  bool allow_partial = false;
};

struct LoadReport {
  std::string directory;  // what was loaded
  std::string id;         // the checkpoint's id (empty for safetensors)
  std::map<std::string, std::string> metadata;
  std::vector<std::string> unchanged;  // partial loads: tensors the source lacked
  std::vector<std::string> unused;     // partial loads: source tensors not registered here
  uint64_t tensors_loaded = 0;
};

class Checkpointer {
 public:
  // Collective over `group` (a CPU communicator of exactly the ranks holding the engine's
  // state: its sharding x dp ranks): creates a communicator of its own for the saves'
  // background agreements, and `root` when missing. The engine must outlive the
  // Checkpointer.
  static StatusOr<std::unique_ptr<Checkpointer>> create(Checkpointable& engine,
                                                        std::shared_ptr<Communicator> group,
                                                        std::string root,
                                                        CheckpointOptions options = {});
  ~Checkpointer();  // waits for a save in flight
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Starts saving <root>/<name> with `metadata` (string keys and values kept in the
  // manifest). Every rank calls it at the same point of training. ALREADY_EXISTS when a
  // checkpoint of that name exists. The Work completes when the checkpoint is published on
  // every rank (or failed: its status says why, the same on every rank).
  StatusOr<std::shared_ptr<Work>> save(const std::string& name,
                                       std::map<std::string, std::string> metadata = {});
  // Waits for the save in flight, if any, and returns how it ended. Counted as a host sync.
  Status wait();

  // Loads <root>/<name>, or the checkpoint <root>/latest names when `name` is empty (for a
  // part of a model whose parts' `latest` differ: the newest checkpoint every part holds).
  // Collective over the group (and a part's mp and pp groups); host-blocking.
  StatusOr<LoadReport> load(const std::string& name, CheckpointLoadOptions options = {});
  // Initialises the parameters (and fp32 masters) from a safetensors file whose tensors are
  // named as the parameters; optimizer state and step counts stay. Collective.
  StatusOr<LoadReport> import_safetensors(const std::string& path,
                                          CheckpointLoadOptions options = {});

  const std::string& root() const { return root_; }
  int32_t rank() const { return comm_->rank(); }

 private:
  Checkpointer(Checkpointable& engine, std::unique_ptr<Communicator> comm, std::string root,
               CheckpointOptions options, std::unique_ptr<Stream> side,
               std::unique_ptr<PublishedManifests> manifests);
  struct SaveJob;
  Status write_job(SaveJob& job);
  Status publish(SaveJob& job, const std::vector<std::string>& reports, std::string& directory);
  // Renames this model's checkpoints beyond keep_last away (out of the root's checkpoints;
  // a part of a model, by `part`, keeps at least 2; another model's are kept, with a
  // warning once); returns the new paths, whose files the caller deletes.
  std::vector<std::string> collect_garbage(const std::string& keep, const CheckpointTopology& part);
  // Staging memory of `bytes` for copies to and from `device`: the spare one when it is
  // large enough (its pages are mapped already), else new. keep_staging() hands memory
  // back as the spare when it is at least as large as the one kept.
  StatusOr<ckpt::HostStaging> take_staging(Device device, size_t bytes);
  void keep_staging(ckpt::HostStaging staging);
  // `saved_loss_scaling` false: the checkpoint's engine had no dynamic loss scaling
  // (Checkpointable::restart_loss_scaling after the load).
  // `name`: the checkpoint every part of a model cut across mp and pp must load (empty:
  // each part its own file, as an import).
  StatusOr<LoadReport> run_load(StatusOr<ckpt::SourceIndex> source, ckpt::SourceNaming naming,
                                const CheckpointLoadOptions& options, LoadReport report,
                                bool saved_loss_scaling = true, const std::string& name = {});
  void finish_in_flight();
  // Every rank learns whether every rank succeeded (the first failure's message), whether
  // every rank read the same `source`, and whether the ranks of each host that give
  // `on_host` read the same file (INVALID_ARGUMENT naming two ranks when not).
  Status agree(const Status& local, const char* what, const std::string& source,
               const std::string& on_host = {});
  // Then, for a part of a model, over the engine's mp and pp groups: every part succeeded
  // and loads the checkpoint of the same `name` (see run_load), or every part fails.
  Status agree_across_parts(const Status& agreed, const std::string& name);
  // The checkpoint a load of `latest` takes on a part of a model, over the engine's mp and
  // pp groups (`groups`): the one every part's `latest` names, else (a save that did not
  // complete on every part) the newest checkpoint every part holds.
  StatusOr<std::string> latest_of_every_part(const std::vector<Communicator*>& groups);

  Checkpointable& engine_;
  std::unique_ptr<Communicator> comm_;
  std::string root_;
  CheckpointOptions options_;
  std::unique_ptr<Stream> side_;  // the snapshot copies run here
  // The listings' knowledge of the root's manifests, shared by the writer thread (saves)
  // and the caller's (loads of `latest`); guarded by its own mutex.
  std::unique_ptr<PublishedManifests> manifests_;
  // Held by each call of save, wait, load and import_safetensors, and by the destructor: a
  // checkpointer is used from one thread at a time, and calls from two take turns instead
  // of both handing writer_ on (a joinable std::thread replaced ends the process).
  std::mutex calls_;
  std::thread writer_;
  std::shared_ptr<Work> in_flight_;
  // The last save's staging memory, kept for the next one: its pages stay mapped, so a
  // snapshot costs one copy and no page faults. Handed back by the writer thread.
  std::mutex spare_mutex_;
  bool warned_of_other_models_ = false;  // the writer threads' (one save at a time)
  ckpt::HostStaging spare_;
};

// <path> itself when it holds a manifest, else the checkpoint its `latest` file names.
StatusOr<std::string> resolve_checkpoint(const std::string& path);
// The name in <root>/latest (checked as a checkpoint name).
StatusOr<std::string> latest_checkpoint(const std::string& root);
// Every chunk's checksum, every file's header and size.
StatusOr<ckpt::VerifyReport> verify_checkpoint(const std::string& directory);
// The model of checkpoint `directory` as one safetensors file at `path` (replaced
// atomically): each parameter under its own name, in its model dtype, or with `fp32` as
// float32 (from its master weights where it has them). Reads and checks every chunk.
Status export_safetensors(const std::string& directory, const std::string& path, bool fp32);

}  // namespace hps
