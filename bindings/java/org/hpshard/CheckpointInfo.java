package org.hpshard;

import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.hps_checkpoint_info_t;

/**
 * What a checkpoint holds (hps_checkpoint_info_t; {@link Checkpoint#inspect}).
 *
 * @param name the checkpoint's name
 * @param id 32 hex digits
 * @param formatVersion the format's version
 * @param stage the stage of the engine that wrote it
 * @param sharding its sharding degree
 * @param dp its dp degree
 * @param world the ranks that saved it
 * @param files its data files
 * @param tensors its logical tensors (parameters, masters, optimizer state, step scalars)
 * @param bytes the tensor data in its data files
 * @param createdUnixNs when it was published, in nanoseconds since the Unix epoch
 * @param mp the mp degree of the part of a model cut across mp and pp it holds (1: none)
 * @param mpRank that part's mp coordinate
 * @param pp the pp degree (1: none)
 * @param ppRank that part's pp coordinate
 */
public record CheckpointInfo(String name, String id, int formatVersion, int stage,
    int sharding, int dp, int world, int files, long tensors, long bytes, long createdUnixNs,
    int mp, int mpRank, int pp, int ppRank) {

  static CheckpointInfo fromNative(hps_checkpoint_info_t i) {
    return new CheckpointInfo(i.getName(), i.getId(), i.getFormat_version(), i.getStage(),
        i.getSharding(), i.getDp(), i.getWorld(), i.getFiles(), i.getTensors(), i.getBytes(),
        i.getCreated_unix_ns(), i.getMp(), i.getMp_rank(), i.getPp(), i.getPp_rank());
  }

  /** sizeof(hps_checkpoint_info_t) as this binding was built. */
  public static long structSize() {
    return structSize(HpshardNative.checkpointInfoStructSize());
  }

  /**
   * The struct_size hps_checkpoint_info_init records for a struct of {@code structSize}
   * bytes; sizes below the first version of the struct, or ending inside one of its fields,
   * throw INVALID_ARGUMENT.
   */
  public static long structSize(long structSize) {
    hps_checkpoint_info_t info = HpshardNative.checkpointInfoInit(structSize);
    try {
      return info.getStruct_size();
    } finally {
      info.delete();
    }
  }
}
