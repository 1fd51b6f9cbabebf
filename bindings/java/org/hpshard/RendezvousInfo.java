package org.hpshard;

import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.hps_rendezvous_info_t;

/**
 * Where this process sits in the job, as the environment says (hps_rendezvous_info_t).
 *
 * @param rank this process's rank
 * @param worldSize the number of ranks
 * @param localRank rank among the processes of this host
 * @param storeUrl for {@link Store#open}
 * @param source which variables were read: the family, then the variables, e.g.
 *     "hpshard (HPS_RANK, HPS_WORLD_SIZE, HPS_STORE)" or
 *     "torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
 */
public record RendezvousInfo(
    int rank, int worldSize, int localRank, String storeUrl, String source) {

  /**
   * Reads HPS_RANK / HPS_WORLD_SIZE / HPS_STORE (hpshard-run), else torchrun's, Open MPI's
   * or Slurm's variables. Throws NOT_FOUND when none is set, INVALID_ARGUMENT for a
   * malformed or missing variable.
   */
  public static RendezvousInfo fromEnv() {
    hps_rendezvous_info_t info = HpshardNative.rendezvousFromEnv();
    try {
      return new RendezvousInfo(info.getRank(), info.getWorld_size(), info.getLocal_rank(),
          info.getStore_url(), info.getSource());
    } finally {
      info.delete();
    }
  }

  /** sizeof(hps_rendezvous_info_t) as this binding was built. */
  public static long structSize() {
    return structSize(HpshardNative.rendezvousStructSize());
  }

  /**
   * The struct_size hps_rendezvous_info_init records for a struct of {@code structSize}
   * bytes; sizes below the first version of the struct throw INVALID_ARGUMENT.
   */
  public static long structSize(long structSize) {
    hps_rendezvous_info_t info = HpshardNative.rendezvousInfoInit(structSize);
    try {
      return info.getStruct_size();
    } finally {
      info.delete();
    }
  }
}
