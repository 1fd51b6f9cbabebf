package org.hpshard;

import java.lang.ref.Cleaner;
import java.util.Objects;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.SWIGTYPE_p_hps_event;

/**
 * A mark in a stream (hps_event_t). {@link #close()} destroys it exactly once (later calls
 * do nothing); an unreachable event that was never closed is destroyed by a Cleaner.
 */
public final class Event implements AutoCloseable {
  private static final class State implements Runnable {
    private SWIGTYPE_p_hps_event handle;

    State(SWIGTYPE_p_hps_event handle) {
      this.handle = handle;
    }

    @Override
    public void run() {
      SWIGTYPE_p_hps_event h;
      synchronized (this) {
        h = handle;
        handle = null;
      }
      if (h != null) HpshardNative.hps_event_destroy(h);
    }
  }

  private final State state;
  private final Cleaner.Cleanable cleanable;
  private final DeviceType deviceType;
  private final int index;

  /** An event on the CPU device. */
  public Event() {
    this(DeviceType.CPU, 0);
  }

  /** An event on device (type, index); OUT_OF_RANGE when there is no such device. */
  public Event(DeviceType type, int index) {
    Objects.requireNonNull(type, "type");
    this.state = new State(HpshardNative.hps_event_create(type.code(), index));
    this.cleanable = Stream.CLEANER.register(this, state);
    this.deviceType = type;
    this.index = index;
  }

  public DeviceType deviceType() {
    return deviceType;
  }

  public int index() {
    return index;
  }

  public boolean isClosed() {
    synchronized (state) {
      return state.handle == null;
    }
  }

  SWIGTYPE_p_hps_event handle() {
    synchronized (state) {
      if (state.handle == null) throw new IllegalStateException("hpshard event is closed");
      return state.handle;
    }
  }

  /** Records the event at the current end of {@code stream}'s queue (no host block). */
  public void record(Stream stream) {
    Objects.requireNonNull(stream, "stream");
    HpshardNative.hps_event_record(handle(), stream.handle());
  }

  /**
   * True when the most recent record has completed; never blocks and is not a host sync.
   * A never-recorded event throws FAILED_PRECONDITION.
   */
  public boolean query() {
    return HpshardNative.hps_event_query(handle()) != 0;
  }

  /** Blocks until the most recent record has completed (counts one host sync). */
  public void synchronize() {
    HpshardNative.hps_event_synchronize(handle());
  }

  /** Destroys the event; does nothing when already closed. */
  @Override
  public void close() {
    cleanable.clean();
  }

  @Override
  public String toString() {
    return "Event[" + deviceType.name().toLowerCase() + ":" + index
        + (isClosed() ? ", closed]" : "]");
  }
}
