package org.hpshard;

import java.lang.ref.Reference;
import java.util.Objects;
import java.util.concurrent.TimeUnit;
import org.hpshard.internal.WorkHandle;

/**
 * One asynchronous operation (hps_work_t), returned by every {@link Communicator}
 * collective. It keeps the operation's buffers (ByteBuffers, or the memory of Tensors even
 * when they are closed) reachable until the operation has been observed finished ({@link #await()} returned or threw, {@link #test()}
 * returned true or threw) or the work is closed. {@link #close()} waits for an operation
 * not yet observed finished (the C API needs its buffers until then), then destroys the
 * handle exactly once; an unreachable work is waited for and destroyed by a Cleaner.
 */
public final class Work extends Handle<WorkHandle> {
  private static final class State extends Handle.State<WorkHandle> {
    private boolean done;

    State(WorkHandle handle) {
      super(handle, WorkHandle::delete);
    }

    synchronized void finished() {
      done = true;
      keep.clear();
    }

    @Override
    void beforeDestroy(WorkHandle h) {
      boolean wait;
      synchronized (this) {
        wait = !done;
      }
      try {
        if (wait) h.await();
      } catch (HpsException e) {
        // the operation has ended; its error was not asked for
      } finally {
        finished();
      }
    }
  }

  private final State work;

  Work(WorkHandle handle, Object... buffers) {
    this(new State(handle), buffers);
  }

  private Work(State state, Object... buffers) {
    super(state, "work");
    this.work = state;
    for (Object b : buffers) keep(b);
  }

  @Override
  void keep(Object o) {
    synchronized (work) {
      if (!work.done) super.keep(o);
    }
  }

  /**
   * True when the operation has finished; never blocks and is not a host sync. A finished
   * operation that failed throws its HpsException.
   */
  public boolean test() {
    final WorkHandle nh = enter();
    try {
      return finishedBy(() -> nh.test());
    } finally {
      leave();
    }
  }

  /**
   * Whether {@code poll} (a native test or timed wait) found the operation finished; one that
   * failed has finished too (its HpsException is thrown). The work lets go of its buffers then.
   */
  private boolean finishedBy(java.util.function.IntSupplier poll) {
    boolean done;
    try {
      done = poll.getAsInt() != 0;
    } catch (HpsException e) {
      work.finished();
      throw e;
    }
    if (done) work.finished();
    return done;
  }

  /**
   * Blocks until the operation has finished (hps_work_wait; one host sync); throws its
   * HpsException (TIMEOUT, ABORTED, INVALID_ARGUMENT when ranks disagree, ...). The wait
   * does not see {@link Thread#interrupt()}: {@link #awaitInterruptibly()} does.
   */
  public void await() {
    final WorkHandle nh = enter();
    try {
      try {
        nh.await();
      } finally {
        work.finished();
      }
    } finally {
      leave();
    }
  }

  /**
   * As {@link #await()}, and a {@link Thread#interrupt()} of the waiting thread ends the wait
   * within about 50 ms with InterruptedException (the interrupt status cleared, as
   * {@code Object.wait} does); the operation goes on and this work still holds it and its
   * buffers: await, test or close it later. A thread already interrupted throws at once.
   */
  public void awaitInterruptibly() throws InterruptedException {
    while (true) {
      if (Thread.interrupted()) throw new InterruptedException("Work.awaitInterruptibly");
      if (await(INTERRUPT_SLICE_MS, TimeUnit.MILLISECONDS)) return;
    }
  }

  private static final long INTERRUPT_SLICE_MS = 50;

  /**
   * Blocks until the operation has finished or {@code timeout} has passed, whichever comes
   * first (hps_work_wait_timeout; one host sync when it finished): true when it finished,
   * false when the timeout passed first. Throws its HpsException once it finished with one; a
   * negative timeout waits 0.
   */
  public boolean await(long timeout, TimeUnit unit) {
    final WorkHandle nh = enter();
    try {
      Objects.requireNonNull(unit, "unit");
      long ms = Math.max(0, unit.toMillis(timeout));
      if (ms == 0 && timeout > 0 && unit.toNanos(timeout) > 0) ms = 1; // never round a wait to 0
      final long waitMs = ms;
      return finishedBy(() -> nh.waitTimeout(waitMs));
    } finally {
      leave();
    }
  }

  /**
   * Makes work queued on {@code stream} after this call wait for the operation, without
   * blocking the host. The buffers stay reachable until this work is awaited or closed.
   */
  public void waitStream(Stream stream) {
    final WorkHandle nh = enter();
    try {
      Objects.requireNonNull(stream, "stream");
      nh.waitStream(stream.h());
      keep(stream);
    } finally {
      leave();
      Reference.reachabilityFence(stream);
    }
  }

  @Override
  public String toString() {
    synchronized (work) {
      return "Work[" + (isClosed() ? "closed" : work.done ? "finished" : "pending") + "]";
    }
  }
}
