package org.hpshard;

import java.lang.ref.Cleaner;
import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.List;
import java.util.Objects;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.SWIGTYPE_p_hps_work;

/**
 * One asynchronous operation (hps_work_t), returned by every {@link Communicator}
 * collective. It keeps the operation's ByteBuffers reachable until the operation has been
 * observed finished ({@link #await()} returned or threw, {@link #test()} returned true or
 * threw) or the work is closed. {@link #close()} waits for an operation not yet observed
 * finished (the C API needs its buffers until then), then destroys the handle exactly once;
 * an unreachable work is waited for and destroyed by a Cleaner.
 */
public final class Work implements AutoCloseable {
  private static final class State implements Runnable {
    private SWIGTYPE_p_hps_work handle;
    private final List<Object> keep;
    private boolean done;

    State(SWIGTYPE_p_hps_work handle, List<Object> keep) {
      this.handle = handle;
      this.keep = keep;
    }

    synchronized void finished() {
      done = true;
      keep.clear();
    }

    @Override
    public void run() {
      SWIGTYPE_p_hps_work h;
      boolean wait;
      synchronized (this) {
        h = handle;
        handle = null;
        wait = !done;
      }
      if (h == null) return;
      try {
        if (wait) {
          try {
            HpshardNative.hps_work_wait(h);
          } catch (HpsException e) {
            // the operation has ended; its error was not asked for
          }
        }
      } finally {
        finished();
        HpshardNative.hps_work_destroy(h);
      }
    }
  }

  private final State state;
  private final Cleaner.Cleanable cleanable;

  Work(SWIGTYPE_p_hps_work handle, ByteBuffer... buffers) {
    List<Object> keep = new ArrayList<>();
    for (ByteBuffer b : buffers) {
      if (b != null) keep.add(b);
    }
    this.state = new State(handle, keep);
    this.cleanable = Stream.CLEANER.register(this, state);
  }

  void keep(Object o) {
    synchronized (state) {
      if (!state.done && o != null) state.keep.add(o);
    }
  }

  public boolean isClosed() {
    synchronized (state) {
      return state.handle == null;
    }
  }

  SWIGTYPE_p_hps_work handle() {
    synchronized (state) {
      if (state.handle == null) throw new IllegalStateException("hpshard work is closed");
      return state.handle;
    }
  }

  /**
   * True when the operation has finished; never blocks and is not a host sync. A finished
   * operation that failed throws its HpsException.
   */
  public boolean test() {
    boolean done;
    try {
      done = HpshardNative.hps_work_test(handle()) != 0;
    } catch (HpsException e) {
      state.finished();
      throw e;
    }
    if (done) state.finished();
    return done;
  }

  /**
   * Blocks until the operation has finished (hps_work_wait; one host sync); throws its
   * HpsException (TIMEOUT, ABORTED, INVALID_ARGUMENT when ranks disagree, ...).
   */
  public void await() {
    SWIGTYPE_p_hps_work h = handle();
    try {
      HpshardNative.hps_work_wait(h);
    } finally {
      state.finished();
    }
  }

  /**
   * Makes work queued on {@code stream} after this call wait for the operation, without
   * blocking the host. The buffers stay reachable until this work is awaited or closed.
   */
  public void waitStream(Stream stream) {
    Objects.requireNonNull(stream, "stream");
    HpshardNative.hps_work_wait_stream(handle(), stream.handle());
    keep(stream);
  }

  /** Waits for an operation not yet observed finished, then destroys the handle. */
  @Override
  public void close() {
    cleanable.clean();
  }

  @Override
  public String toString() {
    synchronized (state) {
      return "Work[" + (state.handle == null ? "closed" : state.done ? "finished" : "pending")
          + "]";
    }
  }
}
