package org.hpshard;

import java.lang.ref.Cleaner;
import java.lang.ref.Reference;
import java.util.ArrayList;
import java.util.List;
import java.util.function.Consumer;
import java.util.function.Function;

/**
 * A native handle (an org.hpshard.internal proxy) destroyed exactly once: by {@link #close()}
 * (later calls do nothing), by try-with-resources, or by a Cleaner once the object is
 * unreachable (every method that calls into the native handle keeps its object reachable
 * until the call returns: Reference.reachabilityFence, so the Cleaner never destroys a
 * handle under its own call). Using a closed handle throws IllegalStateException. A handle
 * can depend on others (an engine on its communicators): it keeps them reachable and is
 * closed before them. Every call into the native handle is counted ({@link #enter} /
 * {@link #leave}, {@link #use}): a close on another thread waits for the calls under way to
 * return before the native handle goes (a close while another thread trains: the engine's
 * next call throws IllegalStateException, never a use of freed memory).
 *
 * @param <P> the proxy type
 */
public abstract class Handle<P> implements AutoCloseable {
  static final Cleaner CLEANER = Cleaner.create();

  /** Set while {@link #close()} runs on this thread: what closing finds is thrown to it. */
  private static final ThreadLocal<Boolean> CLOSING = ThreadLocal.withInitial(() -> false);

  /** What a handle owns; run() destroys it once and never refers to the Handle object. */
  static class State<P> implements Runnable {
    private P proxy;
    private final Consumer<P> destroy;
    final List<Object> keep = new ArrayList<>();
    private final List<State<?>> dependents = new ArrayList<>(); // closed before this
    private final List<State<?>> owners = new ArrayList<>();
    private final List<Handle<?>> ownerHandles = new ArrayList<>(); // kept reachable
    private int inUse; // calls under way through enter()/leave()
    private RuntimeException failure; // what closing found (beforeDestroy, dependents)

    State(P proxy, Consumer<P> destroy) {
      this.proxy = proxy;
      this.destroy = destroy;
    }

    /**
     * Runs under this state's monitor as the proxy is taken for destruction, in the same
     * step that makes proxy() null (so another thread sees it in one place or the other).
     */
    void taken(P proxy) {}

    /** Runs before the proxy is destroyed (waiting for what it still does). */
    void beforeDestroy(P proxy) {}

    synchronized P proxy() {
      return proxy;
    }

    /** The proxy, counted as in use until {@link #leave}; IllegalStateException if closed. */
    synchronized P enter(String kind) {
      if (proxy == null) throw new IllegalStateException("hpshard " + kind + " is closed");
      ++inUse;
      return proxy;
    }

    synchronized void leave() {
      if (--inUse == 0) notifyAll();
    }

    /** Waits until no counted call is under way (the destroy must not overlap one). */
    private void awaitCalls() {
      boolean interrupted = false;
      synchronized (this) {
        while (inUse > 0) {
          try {
            wait();
          } catch (InterruptedException e) {
            interrupted = true; // asked again once the calls have returned
          }
        }
      }
      if (interrupted) Thread.currentThread().interrupt();
    }

    private synchronized void forget(State<?> dependent) {
      dependents.remove(dependent);
    }

    /** Records a failure that closing found, for {@link Handle#close()} to throw. */
    synchronized void fail(RuntimeException e) {
      if (failure == null) {
        failure = e;
      } else if (failure != e) {
        failure.addSuppressed(e);
      }
    }

    synchronized RuntimeException takeFailure() {
      RuntimeException f = failure;
      failure = null;
      return f;
    }

    @Override
    public final void run() {
      List<State<?>> first;
      synchronized (this) {
        first = new ArrayList<>(dependents);
        dependents.clear();
      }
      for (State<?> d : first) {
        d.run();
        RuntimeException f = d.takeFailure();
        if (f != null) fail(f); // a dependent's close failed: this close reports it
      }
      P p;
      List<State<?>> from;
      synchronized (this) {
        p = proxy;
        proxy = null;
        if (p != null) taken(p);
        from = new ArrayList<>(owners);
        owners.clear();
      }
      if (p == null) return;
      try {
        awaitCalls();
        beforeDestroy(p);
      } finally {
        try {
          destroy.accept(p);
        } finally {
          synchronized (this) {
            keep.clear();
            ownerHandles.clear();
          }
          for (State<?> o : from) o.forget(this);
        }
      }
      if (!CLOSING.get()) {
        // The Cleaner's thread: no close() will throw it, so it is written out.
        RuntimeException f = takeFailure();
        if (f != null) {
          System.err.println("hpshard: an engine garbage-collected without close() had "
              + "failed work in flight (its last steps' updates may be missing): " + f);
        }
      }
    }
  }

  final State<P> state;
  private final Cleaner.Cleanable cleanable;
  private final String kind;

  Handle(State<P> state, String kind) {
    this.state = state;
    this.kind = kind;
    this.cleanable = CLEANER.register(this, state);
  }

  Handle(P proxy, Consumer<P> destroy, String kind) {
    this(new State<>(proxy, destroy), kind);
  }

  /** The proxy; IllegalStateException once closed. */
  P h() {
    P p = state.proxy();
    if (p == null) throw new IllegalStateException("hpshard " + kind + " is closed");
    return p;
  }

  public boolean isClosed() {
    return state.proxy() == null;
  }

  /**
   * The proxy, counted as in use until {@link #leave()}, which a finally block calls: a close
   * on another thread meanwhile waits for the call to return, so the native handle never goes
   * under a call (every method calling into its own handle goes through this or
   * {@link #use}). IllegalStateException once closed.
   */
  final P enter() {
    return state.enter(kind);
  }

  /** Ends the call {@link #enter()} began. */
  final void leave() {
    state.leave();
    Reference.reachabilityFence(this);
  }

  /**
   * Runs {@code call} on the proxy, counted: a close on another thread meanwhile waits for it
   * to return. IllegalStateException once closed.
   */
  <T> T use(Function<P, T> call) {
    P p = enter();
    try {
      return call.apply(p);
    } finally {
      leave();
    }
  }

  /** Keeps {@code o} reachable until the handle is closed. */
  void keep(Object o) {
    if (o == null) return;
    synchronized (state) {
      state.keep.add(o);
    }
  }

  /** Lets go of what {@link #keep} kept. */
  void releaseKept() {
    synchronized (state) {
      state.keep.clear();
    }
  }

  /** This handle keeps {@code owner} reachable and is closed before it. */
  void dependOn(Handle<?> owner) {
    if (owner == null) return;
    synchronized (owner.state) {
      owner.state.dependents.add(state);
    }
    synchronized (state) {
      state.owners.add(owner.state);
      state.ownerHandles.add(owner);
    }
  }

  /**
   * Destroys the handle (what depends on it first); does nothing when already closed. Throws
   * what closing found after everything is destroyed: an engine's failed work in flight
   * ({@link Engine#close()}), also when the engine closes with this handle.
   */
  @Override
  public void close() {
    final boolean outer = !CLOSING.get();
    CLOSING.set(true);
    try {
      cleanable.clean();
    } finally {
      if (outer) CLOSING.set(false);
    }
    RuntimeException f = state.takeFailure();
    if (f != null) throw f;
  }
}
