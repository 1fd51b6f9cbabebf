package org.hpshard;

import java.lang.ref.Reference;
import java.util.Objects;
import org.hpshard.internal.HybridGroupHandle;

/**
 * This rank's communicators for every group of a topology (hps_hybrid_group_t). It keeps its
 * world communicator reachable; closing the world closes it first. {@link #close()}
 * destroys it exactly once (communicators taken with {@link #comm} stay valid).
 */
public final class HybridGroup extends Handle<HybridGroupHandle> {
  private final Topology topology;

  private HybridGroup(HybridGroupHandle handle, Communicator world, Topology topology) {
    super(handle, HybridGroupHandle::delete, "hybrid group");
    this.topology = topology;
    dependOn(world);
  }

  /**
   * Collective over {@code world} (whose size must be the topology's): creates every group's
   * communicator in the same order on every rank.
   */
  public static HybridGroup create(Communicator world, Topology topology) {
    try {
      Objects.requireNonNull(world, "world");
      Objects.requireNonNull(topology, "topology");
      return new HybridGroup(HybridGroupHandle.create(world.h(), topology.h()), world, topology);
    } finally {
      Reference.reachabilityFence(world);
      Reference.reachabilityFence(topology);
    }
  }

  public Topology topology() {
    return topology;
  }

  /**
   * A new Communicator handle for this rank's group of {@code kind}; the caller closes it.
   * Every handle of one kind is that one communicator: one thread at a time across all of
   * them (two threads each calling collectives on its own handle pair them differently on
   * each rank: wrong results). A communicator of its own for another thread: {@link
   * Communicator#split}.
   */
  public Communicator comm(Group kind) {
    final HybridGroupHandle nh = enter();
    try {
      Objects.requireNonNull(kind, "kind");
      return new Communicator(nh.comm(kind.code()), kind.name().toLowerCase());
    } finally {
      leave();
    }
  }
}
