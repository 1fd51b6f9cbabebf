package org.hpshard;

import java.lang.ref.Reference;
import java.util.Objects;
import org.hpshard.internal.EventHandle;

/** A mark in a stream (hps_event_t). {@link #close()} destroys it exactly once. */
public final class Event extends Handle<EventHandle> {
  private final DeviceType deviceType;
  private final int index;

  /** An event on the CPU device. */
  public Event() {
    this(DeviceType.CPU, 0);
  }

  /** An event on device (type, index); OUT_OF_RANGE when there is no such device. */
  public Event(DeviceType type, int index) {
    super(EventHandle.create(Objects.requireNonNull(type, "type").code(), index),
        EventHandle::delete, "event");
    this.deviceType = type;
    this.index = index;
  }

  public DeviceType deviceType() {
    return deviceType;
  }

  public int index() {
    return index;
  }

  /** Records the event at the current end of {@code stream}'s queue (no host block). */
  public void record(Stream stream) {
    final EventHandle nh = enter();
    try {
      Objects.requireNonNull(stream, "stream");
      nh.record(stream.h());
    } finally {
      leave();
      Reference.reachabilityFence(stream);
    }
  }

  /**
   * True when the most recent record has completed; never blocks. A never-recorded event
   * throws FAILED_PRECONDITION.
   */
  public boolean query() {
    final EventHandle nh = enter();
    try {
      return nh.query() != 0;
    } finally {
      leave();
    }
  }

  /** Blocks until the most recent record has completed (counts one host sync). */
  public void synchronize() {
    final EventHandle nh = enter();
    try {
      nh.synchronize();
    } finally {
      leave();
    }
  }

  @Override
  public String toString() {
    return "Event[" + deviceType.name().toLowerCase() + ":" + index
        + (isClosed() ? ", closed]" : "]");
  }
}
