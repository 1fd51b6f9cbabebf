package org.hpshard;

import java.lang.ref.Reference;
import java.util.Objects;
import org.hpshard.internal.TopologyHandle;

/**
 * Axes dp × pp × sharding × sep × mp and the rank arithmetic (hps_topology_t; pure, no
 * communication). Ranks are row-major, the last axis of the order fastest. {@link #close()}
 * destroys it exactly once. A topology is immutable: any thread.
 */
public final class Topology extends Handle<TopologyHandle> {
  /** The previous and next stage of a rank in its pipeline. */
  public record PipelineNeighbors(int prev, int next) {}

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
    super(TopologyHandle.create(dp, pp, sharding, sep, mp, order, worldSize),
        TopologyHandle::delete, "topology");
    this.worldSize = worldSize;
  }

  public int worldSize() {
    return worldSize;
  }

  /** The degree of an axis (DP .. MP; the check groups throw INVALID_ARGUMENT). */
  public int degree(Group axis) {
    final TopologyHandle nh = enter();
    try {
      return nh.degree(Objects.requireNonNull(axis).code());
    } finally {
      leave();
    }
  }

  /** {@code rank}'s coordinate on {@code axis}; OUT_OF_RANGE for a bad rank. */
  public int coordinate(int rank, Group axis) {
    final TopologyHandle nh = enter();
    try {
      return nh.coordinate(rank, Objects.requireNonNull(axis).code());
    } finally {
      leave();
    }
  }

  /** The rank at these coordinates; OUT_OF_RANGE for a bad coordinate. */
  public int rankOf(int dp, int pp, int sharding, int sep, int mp) {
    final TopologyHandle nh = enter();
    try {
      return nh.rankOf(dp, pp, sharding, sep, mp);
    } finally {
      leave();
    }
  }

  /** The ranks of {@code rank}'s group of kind {@code group}, ascending. */
  public int[] groupRanks(Group group, int rank) {
    final TopologyHandle nh = enter();
    try {
      return nh.groupRanks(Objects.requireNonNull(group).code(), rank);
    } finally {
      leave();
    }
  }

  /** The previous and next stage of {@code rank} in its pipeline (wrapping around). */
  public PipelineNeighbors pipelineNeighbors(int rank) {
    final TopologyHandle nh = enter();
    try {
      long[] pair = nh.pipelineNeighbors(rank);
      return new PipelineNeighbors((int) pair[0], (int) pair[1]);
    } finally {
      leave();
    }
  }
}
