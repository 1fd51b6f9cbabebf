package org.hpshard;

import java.lang.ref.Reference;
import java.nio.ByteBuffer;
import java.util.Objects;
import org.hpshard.internal.StreamHandle;

/**
 * An ordered queue of work on one device (hps_stream_t). {@link #close()} finishes the
 * queued work and destroys it exactly once. As in the C API, one stream is used by one
 * thread at a time. Buffers given to {@link #memcpyAsync} stay reachable until
 * {@link #synchronize()} or {@link #close()}.
 */
public final class Stream extends Handle<StreamHandle> {
  private final DeviceType deviceType;
  private final int index;

  /** A stream on the CPU device. */
  public Stream() {
    this(DeviceType.CPU, 0);
  }

  /** A stream on device (type, index); OUT_OF_RANGE when there is no such device. */
  public Stream(DeviceType type, int index) {
    super(StreamHandle.create(Objects.requireNonNull(type, "type").code(), index),
        StreamHandle::delete, "stream");
    this.deviceType = type;
    this.index = index;
  }

  public DeviceType deviceType() {
    return deviceType;
  }

  public int index() {
    return index;
  }

  /** Blocks until all queued work has completed (counts one host sync). */
  public void synchronize() {
    final StreamHandle nh = enter();
    try {
      nh.synchronize();
      releaseKept();
    } finally {
      leave();
    }
  }

  /**
   * Makes later work on this stream wait for {@code event}'s most recent record, without
   * blocking the host. A never-recorded event throws FAILED_PRECONDITION.
   */
  public void waitEvent(Event event) {
    final StreamHandle nh = enter();
    try {
      Objects.requireNonNull(event, "event");
      nh.waitEvent(event.h());
    } finally {
      leave();
      Reference.reachabilityFence(event);
    }
  }

  /** Same as {@link Hpshard#memcpyAsync(ByteBuffer, ByteBuffer, long, Stream)} on this stream. */
  public void memcpyAsync(ByteBuffer dst, ByteBuffer src, long bytes) {
    Hpshard.memcpyAsync(dst, src, bytes, this);
  }

  void enqueueCopy(ByteBuffer dst, ByteBuffer src, long bytes) {
    final StreamHandle nh = enter();
    try {
      synchronized (state) {
        nh.memcpyAsync(dst, src, bytes);
        keep(dst);
        keep(src);
      }
    } finally {
      leave();
    }
  }

  @Override
  public String toString() {
    return "Stream[" + deviceType.name().toLowerCase() + ":" + index
        + (isClosed() ? ", closed]" : "]");
  }
}
