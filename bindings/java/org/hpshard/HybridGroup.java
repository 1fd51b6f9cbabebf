package org.hpshard;

import java.lang.ref.Cleaner;
import java.util.Objects;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.SWIGTYPE_p_hps_hybrid_group;

/**
 * This rank's communicators for every group of a topology (hps_hybrid_group_t). It keeps its
 * world communicator reachable; closing the world closes it first. {@link #close()}
 * destroys it exactly once (communicators taken with {@link #comm} stay valid).
 */
public final class HybridGroup implements AutoCloseable {
  static final class State implements Runnable {
    private SWIGTYPE_p_hps_hybrid_group handle;
    private Communicator world;

    State(SWIGTYPE_p_hps_hybrid_group handle, Communicator world) {
      this.handle = handle;
      this.world = world;
    }

    @Override
    public void run() {
      SWIGTYPE_p_hps_hybrid_group h;
      Communicator w;
      synchronized (this) {
        h = handle;
        w = world;
        handle = null;
        world = null;
      }
      if (h != null) HpshardNative.hps_hybrid_group_destroy(h);
      if (w != null) w.forget(this);
    }
  }

  private final State state;
  private final Cleaner.Cleanable cleanable;
  private final Topology topology;

  private HybridGroup(SWIGTYPE_p_hps_hybrid_group handle, Communicator world, Topology topology) {
    this.state = new State(handle, world);
    this.cleanable = Stream.CLEANER.register(this, state);
    this.topology = topology;
  }

  /**
   * Collective over {@code world} (whose size must be the topology's): creates every group's
   * communicator in the same order on every rank.
   */
  public static HybridGroup create(Communicator world, Topology topology) {
    Objects.requireNonNull(world, "world");
    Objects.requireNonNull(topology, "topology");
    HybridGroup g = new HybridGroup(
        HpshardNative.hps_hybrid_group_create(world.handle(), topology.handle()), world, topology);
    world.remember(g.state);
    return g;
  }

  public Topology topology() {
    return topology;
  }

  public boolean isClosed() {
    synchronized (state) {
      return state.handle == null;
    }
  }

  SWIGTYPE_p_hps_hybrid_group handle() {
    synchronized (state) {
      if (state.handle == null) throw new IllegalStateException("hpshard hybrid group is closed");
      return state.handle;
    }
  }

  /** A new Communicator for this rank's group of {@code kind}; the caller closes it. */
  public Communicator comm(Group kind) {
    Objects.requireNonNull(kind, "kind");
    return new Communicator(HpshardNative.hps_hybrid_group_comm(handle(), kind.code()),
        kind.name().toLowerCase());
  }

  /** Destroys the hybrid group; does nothing when already closed. */
  @Override
  public void close() {
    cleanable.clean();
  }
}
