package org.hpshard;

import java.lang.ref.Cleaner;
import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.List;
import java.util.Objects;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.SWIGTYPE_p_hps_stream;

/**
 * An ordered queue of work on one device (hps_stream_t).
 *
 * <p>{@link #close()} finishes the queued work and destroys the handle exactly once (later
 * calls do nothing); an unreachable stream that was never closed is destroyed by a Cleaner.
 * As in the C API, one stream is used by one thread at a time.
 */
public final class Stream implements AutoCloseable {
  static final Cleaner CLEANER = Cleaner.create();

  /** The native handle and the buffers it still uses; run() destroys it once. */
  private static final class State implements Runnable {
    private SWIGTYPE_p_hps_stream handle;
    private final List<ByteBuffer> inFlight = new ArrayList<>();

    State(SWIGTYPE_p_hps_stream handle) {
      this.handle = handle;
    }

    @Override
    public void run() {
      SWIGTYPE_p_hps_stream h;
      synchronized (this) {
        h = handle;
        handle = null;
      }
      if (h == null) return;
      try {
        HpshardNative.hps_stream_destroy(h); // finishes the queued work first
      } finally {
        synchronized (this) {
          inFlight.clear();
        }
      }
    }
  }

  private final State state;
  private final Cleaner.Cleanable cleanable;
  private final DeviceType deviceType;
  private final int index;

  /** A stream on the CPU device. */
  public Stream() {
    this(DeviceType.CPU, 0);
  }

  /** A stream on device (type, index); OUT_OF_RANGE when there is no such device. */
  public Stream(DeviceType type, int index) {
    Objects.requireNonNull(type, "type");
    this.state = new State(HpshardNative.hps_stream_create(type.code(), index));
    this.cleanable = CLEANER.register(this, state);
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

  SWIGTYPE_p_hps_stream handle() {
    synchronized (state) {
      if (state.handle == null) throw new IllegalStateException("hpshard stream is closed");
      return state.handle;
    }
  }

  /** Blocks until all queued work has completed (counts one host sync). */
  public void synchronize() {
    HpshardNative.hps_stream_synchronize(handle());
    synchronized (state) {
      state.inFlight.clear();
    }
  }

  /**
   * Makes later work on this stream wait for {@code event}'s most recent record, without
   * blocking the host. A never-recorded event throws FAILED_PRECONDITION.
   */
  public void waitEvent(Event event) {
    Objects.requireNonNull(event, "event");
    HpshardNative.hps_stream_wait_event(handle(), event.handle());
  }

  /** Same as {@link Hpshard#memcpyAsync(ByteBuffer, ByteBuffer, long, Stream)} on this stream. */
  public void memcpyAsync(ByteBuffer dst, ByteBuffer src, long bytes) {
    Hpshard.memcpyAsync(dst, src, bytes, this);
  }

  void enqueueCopy(ByteBuffer dst, ByteBuffer src, long bytes) {
    SWIGTYPE_p_hps_stream h = handle();
    synchronized (state) {
      HpshardNative.hps_memcpy_async(dst, src, bytes, h);
      state.inFlight.add(dst);
      state.inFlight.add(src);
    }
  }

  /** Keeps {@code buffer} reachable until {@link #synchronize()} or {@link #close()}. */
  void keepUntilSynchronized(ByteBuffer buffer) {
    synchronized (state) {
      if (buffer != null) state.inFlight.add(buffer);
    }
  }

  /** Finishes the queued work and destroys the stream; does nothing when already closed. */
  @Override
  public void close() {
    cleanable.clean();
  }

  @Override
  public String toString() {
    return "Stream[" + deviceType.name().toLowerCase() + ":" + index
        + (isClosed() ? ", closed]" : "]");
  }
}
