package org.hpshard;

import java.lang.ref.Reference;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.util.Map;
import java.util.Objects;
import org.hpshard.internal.CheckpointHandle;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.hps_checkpoint_info_t;
import org.hpshard.internal.hps_checkpoint_load_options_t;
import org.hpshard.internal.hps_checkpoint_options_t;
import org.hpshard.internal.hps_engine_options_t;

/**
 * Sharded, asynchronous, atomic, verified checkpoints of one {@link Engine} under a root
 * directory every rank sees (hps_checkpoint_t; docs/checkpoints.md).
 *
 * <p>{@link #save} returns at once with a {@link Work} that completes when the checkpoint is
 * published on every rank; the steps that follow overlap the writing and count no host sync.
 * {@link #load} reads a checkpoint written by any topology (stage, sharding and dp degrees,
 * parameter dtypes) into the engine; on any error no rank's engine changed. Save, load and
 * import are collective: every rank calls them at the same point of training.
 *
 * <p>The checkpoint keeps its engine and group reachable; closing either closes the
 * checkpoint first, and {@link #close()} waits for a save in flight and for a save, load or
 * import under way on another thread. One thread at a time per checkpoint (and not beside its
 * engine's calls); calls from two take turns.
 */
public final class Checkpoint extends Handle<CheckpointHandle> {
  /** Options of {@link #create}; unset ones keep the library's defaults. */
  public static final class Options {
    private Integer keepLast;
    private Long chunkBytes;
    private Long timeoutMs;

    /**
     * > 0: after a save is published, delete this model's checkpoints beyond the newest keepLast
     * (a part of a model cut across mp and pp keeps at least 2; another model's under the root
     * are kept).
     */
    public Options keepLast(int keepLast) {
      this.keepLast = keepLast;
      return this;
    }

    /** Ranges are checksummed in chunks of this size (default 1 MiB). */
    public Options chunkBytes(long chunkBytes) {
      this.chunkBytes = Hpshard.unsignedBytes("chunkBytes", chunkBytes);
      return this;
    }

    /** Bound on each agreement among the ranks of a save or load (default 30 minutes). */
    public Options timeoutMs(long timeoutMs) {
      this.timeoutMs = timeoutMs;
      return this;
    }
  }

  private final Path root;

  private Checkpoint(CheckpointHandle handle, Engine engine, Communicator group, Path root) {
    super(handle, CheckpointHandle::delete, "checkpoint");
    this.root = root;
    dependOn(engine);
    dependOn(group);
  }

  /** A checkpoint of {@code engine} under {@code root} with the library's default options. */
  public static Checkpoint create(Engine engine, Communicator group, Path root) {
    return create(engine, group, root, null);
  }

  /**
   * Collective over {@code group}: a CPU communicator of exactly the ranks holding the
   * engine's state (its sharding x dp ranks); {@code root} is created when missing;
   * {@code options} may be null. INVALID_ARGUMENT (a group of another size or device, bad
   * options), BACKEND_ERROR (the root cannot be created).
   */
  public static Checkpoint create(Engine engine, Communicator group, Path root,
      Options options) {
    try {
      Objects.requireNonNull(engine, "engine");
      Objects.requireNonNull(group, "group");
      Objects.requireNonNull(root, "root");
      hps_checkpoint_options_t o =
          HpshardNative.checkpointOptionsInit(HpshardNative.checkpointOptionsStructSize());
      try {
        if (options != null && options.keepLast != null) o.setKeep_last(options.keepLast);
        if (options != null && options.chunkBytes != null) o.setChunk_bytes(options.chunkBytes);
        if (options != null && options.timeoutMs != null) o.setTimeout_ms(options.timeoutMs);
        return new Checkpoint(CheckpointHandle.create(engine.h(), group.h(), root.toString(), o),
            engine, group, root);
      } finally {
        o.delete();
      }
    } finally {
      Reference.reachabilityFence(engine);
      Reference.reachabilityFence(group);
    }
  }

  /** The root the checkpoints are saved under. */
  public Path root() {
    return root;
  }

  /** {@link #save(String, Map)} without metadata. */
  public Work save(String name) {
    return save(name, Map.of());
  }

  /**
   * Starts saving checkpoint root/name ([A-Za-z0-9._-], 1..200 characters, not starting with
   * '.', not "latest" nor beginning "latest.tmp") with {@code metadata} (e.g. the framework's
   * step and data-loader position), after the step whose state it saves. Returns at once:
   * the Work completes when the checkpoint is
   * published on every rank, or throws how it failed (the same error on every rank; nothing
   * is published then; TIMEOUT naming the holder when another job's save held the root's
   * save lock for half the timeout). A save while another is in flight first waits for it
   * (one host sync). The save copies this rank's state on a stream of its own, ordered
   * before the next step's update: write into parameter views after
   * {@link Engine#synchronize()} (before it, the checkpoint may hold either value).
   * INVALID_ARGUMENT (name, metadata), ALREADY_EXISTS (that name exists),
   * FAILED_PRECONDITION (the engine has no state yet).
   */
  public Work save(String name, Map<String, String> metadata) {
    try {
      Objects.requireNonNull(name, "name");
      Objects.requireNonNull(metadata, "metadata");
      String[] flat = new String[2 * metadata.size()];
      int i = 0;
      for (Map.Entry<String, String> e : metadata.entrySet()) {
        flat[i++] = Objects.requireNonNull(e.getKey(), "metadata key");
        flat[i++] = Objects.requireNonNull(e.getValue(), "metadata value of " + e.getKey());
      }
      return new Work(use(h -> h.save(name, flat)));
    } finally {
      Reference.reachabilityFence(this);
    }
  }

  /** Loads the checkpoint root/latest names; see {@link #load(String, boolean)}. */
  public void load() {
    load(null, false);
  }

  /**
   * Loads checkpoint root/name (null: the one root/latest names; for a part of a model whose
   * parts' latest differ, the newest checkpoint every part holds) into the engine, whatever
   * topology and parameter dtypes wrote it; between steps (stage 3: after
   * {@link Engine#broadcastParameters()}), host-blocking. {@code allowPartial}: tensors the
   * checkpoint lacks stay unchanged and tensors the engine lacks are skipped, instead of an
   * error naming them. NOT_FOUND (no such checkpoint, a missing file), INVALID_ARGUMENT
   * (corrupt, truncated or mismatched data, another model), FAILED_PRECONDITION (in the middle
   * of a step); no engine changed then.
   */
  public void load(String name, boolean allowPartial) {
    try {
      hps_checkpoint_load_options_t o = loadOptions(allowPartial);
      try {
        use(h -> {
          h.load(name, o);
          return null;
        });
      } finally {
        o.delete();
      }
    } finally {
      Reference.reachabilityFence(this);
    }
  }

  /**
   * Initialises the engine's parameters (and fp32 masters) from the safetensors file
   * {@code path}, whose tensors carry the parameters' names; each rank reads only its shard;
   * optimizer state and step counts stay. Collective, as {@link #load(String, boolean)}.
   */
  public void importSafetensors(Path path, boolean allowPartial) {
    try {
      Objects.requireNonNull(path, "path");
      hps_checkpoint_load_options_t o = loadOptions(allowPartial);
      try {
        use(h -> {
          h.importSafetensors(path.toString(), o);
          return null;
        });
      } finally {
        o.delete();
      }
    } finally {
      Reference.reachabilityFence(this);
    }
  }

  /**
   * The value of metadata {@code key} of the last successful load or import. NOT_FOUND (no
   * such key, or nothing loaded).
   */
  public String metadata(String key) {
    try {
      Objects.requireNonNull(key, "key");
      return new String(use(h -> h.metadata(key)), StandardCharsets.UTF_8);
    } finally {
      Reference.reachabilityFence(this);
    }
  }

  private static hps_checkpoint_load_options_t loadOptions(boolean allowPartial) {
    hps_checkpoint_load_options_t o =
        HpshardNative.checkpointLoadOptionsInit(HpshardNative.checkpointLoadOptionsStructSize());
    o.setAllow_partial(allowPartial ? 1 : 0);
    return o;
  }

  /**
   * Reads the manifest of the checkpoint at {@code path} (a checkpoint directory, or a root
   * whose latest is read), checking it but not the data. NOT_FOUND, INVALID_ARGUMENT,
   * BACKEND_ERROR (a path that cannot be read or searched).
   */
  public static CheckpointInfo inspect(Path path) {
    Objects.requireNonNull(path, "path");
    hps_checkpoint_info_t info = HpshardNative.checkpointInspect(path.toString());
    try {
      return CheckpointInfo.fromNative(info);
    } finally {
      info.delete();
    }
  }

  /**
   * Checks every data file's header and size and every chunk's checksum of the checkpoint at
   * {@code path}. NOT_FOUND, INVALID_ARGUMENT naming the file and tensor, BACKEND_ERROR.
   */
  public static void verify(Path path) {
    Objects.requireNonNull(path, "path");
    HpshardNative.checkpointVerify(path.toString());
  }

  /**
   * The engine options the checkpoint at {@code path} was saved with (stage, optimizer and
   * its hyperparameters, clipping, accumulation, alignment, prefetch window, loss scaling),
   * every other field the library's default: pass them to {@link Engine#create} to resume
   * with the same engine. NOT_FOUND, INVALID_ARGUMENT, BACKEND_ERROR.
   */
  public static Engine.Options readEngineOptions(Path path) {
    Objects.requireNonNull(path, "path");
    hps_engine_options_t o =
        HpshardNative.engineOptionsInit(HpshardNative.engineOptionsStructSize());
    try {
      HpshardNative.checkpointReadEngineOptions(path.toString(), o);
      return Engine.Options.fromNative(o);
    } finally {
      o.delete();
    }
  }

  /**
   * Writes the parameters of the checkpoint at {@code path} as one safetensors file
   * {@code out} (replaced atomically), each under its own name, in its dtype or with
   * {@code fp32} as float32 (from the fp32 masters where the checkpoint has them); every chunk
   * read is checked. NOT_FOUND, INVALID_ARGUMENT, BACKEND_ERROR.
   */
  public static void exportSafetensors(Path path, Path out, boolean fp32) {
    Objects.requireNonNull(path, "path");
    Objects.requireNonNull(out, "out");
    HpshardNative.checkpointExportSafetensors(path.toString(), out.toString(), fp32 ? 1 : 0);
  }

  @Override
  public String toString() {
    return "Checkpoint[" + root + (isClosed() ? ", closed]" : "]");
  }
}
