package org.hpshard;

import java.nio.charset.StandardCharsets;
import java.util.Objects;
import org.hpshard.internal.StoreHandle;

/**
 * A key-value store through which ranks meet (hps_store_t). {@link #close()} destroys it
 * exactly once. One store may be used from several threads at once; a close waits for the
 * calls under way on other threads (a wait, a {@link Communicator} creation over it) to
 * return first ({@link #abort()} ends those at once). Rank 0's TCP store serves until the
 * other ranks have closed theirs: its close waits for that, at most the store's timeout
 * (not at all once aborted).
 */
public final class Store extends Handle<StoreHandle> {
  /** Default wait of {@link #open(String, int)}, {@link #get} and {@link #await}, in ms. */
  public static final long DEFAULT_TIMEOUT_MS = 30000;

  /** Lets abort() reach the store while its destroy waits for the calls under way. */
  static final class StoreState extends State<StoreHandle> {
    private StoreHandle closing; // the proxy while the destroy waits for the calls

    StoreState(StoreHandle proxy) {
      super(proxy, StoreHandle::delete);
    }

    /** Aborts the store, also while the destroy waits for calls (it ends them). */
    synchronized void abort() {
      StoreHandle p = proxy() != null ? proxy() : closing;
      if (p == null) throw new IllegalStateException("hpshard store is closed");
      p.abort(); // under the monitor: the destroy cannot begin meanwhile
    }

    @Override
    void taken(StoreHandle proxy) {
      closing = proxy; // in the step that makes proxy() null: abort() finds one or the other
    }

    @Override
    void beforeDestroy(StoreHandle proxy) {
      synchronized (this) {
        closing = null; // the calls have returned (Handle.State waited for them)
      }
    }
  }

  private final String url;
  private final int rank;

  private Store(StoreHandle handle, String url, int rank) {
    super(new StoreState(handle), "store");
    this.url = url;
    this.rank = rank;
  }

  /**
   * Opens the store at {@code url} as {@code rank}: "memory://NAME" (shared by the threads
   * of this process), "file:///DIR" or "tcp://HOST:PORT" (rank 0 serves, every rank
   * connects, retrying until {@code timeoutMs}).
   */
  public static Store open(String url, int rank, long timeoutMs) {
    Objects.requireNonNull(url, "url");
    return new Store(StoreHandle.open(url, rank, timeoutMs), url, rank);
  }

  /** {@link #open(String, int, long)} with {@link #DEFAULT_TIMEOUT_MS}. */
  public static Store open(String url, int rank) {
    return open(url, rank, DEFAULT_TIMEOUT_MS);
  }

  public String url() {
    return url;
  }

  public int rank() {
    return rank;
  }

  /** Sets {@code key} to {@code value} (binary-safe). */
  public void set(String key, byte[] value) {
    Objects.requireNonNull(key, "key");
    Objects.requireNonNull(value, "value");
    use(h -> {
      h.set(key, value);
      return null;
    });
  }

  /** Sets {@code key} to the UTF-8 bytes of {@code value}. */
  public void set(String key, String value) {
    set(key, value.getBytes(StandardCharsets.UTF_8));
  }

  /** Waits up to {@code timeoutMs} for {@code key}, then returns its value (TIMEOUT). */
  public byte[] get(String key, long timeoutMs) {
    Objects.requireNonNull(key, "key");
    return use(h -> h.get(key, timeoutMs));
  }

  /** {@link #get(String, long)} with {@link #DEFAULT_TIMEOUT_MS}. */
  public byte[] get(String key) {
    return get(key, DEFAULT_TIMEOUT_MS);
  }

  /** Adds {@code delta} to the integer at {@code key} (0 when unset); the new value. */
  public long add(String key, long delta) {
    Objects.requireNonNull(key, "key");
    return use(h -> h.add(key, delta));
  }

  /** Waits up to {@code timeoutMs} until {@code key} is set (hps_store_wait; TIMEOUT). */
  public void await(String key, long timeoutMs) {
    Objects.requireNonNull(key, "key");
    use(h -> {
      h.wait(key, timeoutMs);
      return null;
    });
  }

  /**
   * Aborts the store (hps_store_abort): from now on every call on it, and every wait on it
   * under way (within about 200 ms), throws HpsException ABORTED; so does a
   * {@link Communicator} creation over it that waits for ranks that never come. Any thread
   * may call it, also while another is blocked on the store or {@link #close()} waits for
   * such calls; it cannot be undone (open a new store). Rank 0's TCP store, aborted, closes
   * without waiting for the other ranks.
   */
  public void abort() {
    ((StoreState) state).abort();
  }

  /** Whether {@code key} is set, without waiting. */
  public boolean check(String key) {
    Objects.requireNonNull(key, "key");
    return use(h -> h.check(key)) != 0;
  }

  @Override
  public String toString() {
    return "Store[" + url + ", rank " + rank + (isClosed() ? ", closed]" : "]");
  }
}
