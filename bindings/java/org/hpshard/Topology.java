package org.hpshard;

import java.lang.ref.Cleaner;
import java.util.Objects;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.SWIGTYPE_p_hps_topology;

/**
 * Axes dp x pp x sharding x sep x mp and the rank arithmetic (hps_topology_t; pure, no
 * communication, immutable: any thread). With the default order "dp,pp,sharding,sep,mp",
 * rank = ((((d*P + p)*S + s)*E + e)*M + m). {@link #close()} destroys it exactly once.
 */
public final class Topology implements AutoCloseable {
  /** The previous and next stage of a rank in its pipeline. */
  public record PipelineNeighbors(int prev, int next) {}

  private static final class State implements Runnable {
    private SWIGTYPE_p_hps_topology handle;

    State(SWIGTYPE_p_hps_topology handle) {
      this.handle = handle;
    }

    @Override
    public void run() {
      SWIGTYPE_p_hps_topology h;
      synchronized (this) {
        h = handle;
        handle = null;
      }
      if (h != null) HpshardNative.hps_topology_destroy(h);
    }
  }

  private final State state;
  private final Cleaner.Cleanable cleanable;
  private final int worldSize;

  /** A topology in the default axis order. */
  public Topology(int dp, int pp, int sharding, int sep, int mp, int worldSize) {
    this(dp, pp, sharding, sep, mp, worldSize, null);
  }

  /**
   * A topology with the given degrees (each >= 1, multiplying to {@code worldSize}) and
   * axis order, slowest first ("dp,pp,sharding,sep,mp" when null). INVALID_ARGUMENT else.
   */
  public Topology(int dp, int pp, int sharding, int sep, int mp, int worldSize, String order) {
    this.state = new State(
        HpshardNative.hps_topology_create(dp, pp, sharding, sep, mp, order, worldSize));
    this.cleanable = Stream.CLEANER.register(this, state);
    this.worldSize = worldSize;
  }

  public int worldSize() {
    return worldSize;
  }

  public boolean isClosed() {
    synchronized (state) {
      return state.handle == null;
    }
  }

  SWIGTYPE_p_hps_topology handle() {
    synchronized (state) {
      if (state.handle == null) throw new IllegalStateException("hpshard topology is closed");
      return state.handle;
    }
  }

  /** The degree of an axis (DP .. MP; the check groups throw INVALID_ARGUMENT). */
  public int degree(Group axis) {
    return HpshardNative.hps_topology_degree(handle(), Objects.requireNonNull(axis).code());
  }

  /** {@code rank}'s coordinate on {@code axis}; OUT_OF_RANGE for a bad rank. */
  public int coordinate(int rank, Group axis) {
    return HpshardNative.hps_topology_coordinate(
        handle(), rank, Objects.requireNonNull(axis).code());
  }

  /** The rank at these coordinates; OUT_OF_RANGE for a bad coordinate. */
  public int rankOf(int dp, int pp, int sharding, int sep, int mp) {
    return HpshardNative.hps_topology_rank_of(handle(), dp, pp, sharding, sep, mp);
  }

  /** The ranks of {@code rank}'s group of kind {@code group}, ascending. */
  public int[] groupRanks(Group group, int rank) {
    return HpshardNative.hps_topology_group_ranks(
        handle(), Objects.requireNonNull(group).code(), rank);
  }

  /** The previous and next stage of {@code rank} in its pipeline (wrapping around). */
  public PipelineNeighbors pipelineNeighbors(int rank) {
    int[] pair = HpshardNative.hps_topology_pipeline_neighbors(handle(), rank);
    return new PipelineNeighbors(pair[0], pair[1]);
  }

  /** Destroys the topology; does nothing when already closed. */
  @Override
  public void close() {
    cleanable.clean();
  }
}
