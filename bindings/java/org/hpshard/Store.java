package org.hpshard;

import java.lang.ref.Cleaner;
import java.nio.charset.StandardCharsets;
import java.util.Objects;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.SWIGTYPE_p_hps_store;

/**
 * A key-value store through which ranks meet (hps_store_t). {@link #close()} destroys it
 * exactly once; an unreachable store is destroyed by a Cleaner. One store may be used from
 * several threads at once.
 */
public final class Store implements AutoCloseable {
  /** Default wait of {@link #open(String, int)}, {@link #get} and {@link #await}, in ms. */
  public static final long DEFAULT_TIMEOUT_MS = 30000;

  private static final class State implements Runnable {
    private SWIGTYPE_p_hps_store handle;

    State(SWIGTYPE_p_hps_store handle) {
      this.handle = handle;
    }

    @Override
    public void run() {
      SWIGTYPE_p_hps_store h;
      synchronized (this) {
        h = handle;
        handle = null;
      }
      if (h != null) HpshardNative.hps_store_destroy(h);
    }
  }

  private final State state;
  private final Cleaner.Cleanable cleanable;
  private final String url;
  private final int rank;

  private Store(SWIGTYPE_p_hps_store handle, String url, int rank) {
    this.state = new State(handle);
    this.cleanable = Stream.CLEANER.register(this, state);
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
    return new Store(HpshardNative.hps_store_open(url, rank, timeoutMs), url, rank);
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

  public boolean isClosed() {
    synchronized (state) {
      return state.handle == null;
    }
  }

  SWIGTYPE_p_hps_store handle() {
    synchronized (state) {
      if (state.handle == null) throw new IllegalStateException("hpshard store is closed");
      return state.handle;
    }
  }

  /** Sets {@code key} to {@code value} (binary-safe). */
  public void set(String key, byte[] value) {
    Objects.requireNonNull(key, "key");
    Objects.requireNonNull(value, "value");
    HpshardNative.hps_store_set(handle(), key, value);
  }

  /** Sets {@code key} to the UTF-8 bytes of {@code value}. */
  public void set(String key, String value) {
    set(key, value.getBytes(StandardCharsets.UTF_8));
  }

  /** Waits up to {@code timeoutMs} for {@code key}, then returns its value (TIMEOUT). */
  public byte[] get(String key, long timeoutMs) {
    Objects.requireNonNull(key, "key");
    return HpshardNative.hps_store_get(handle(), key, timeoutMs);
  }

  /** {@link #get(String, long)} with {@link #DEFAULT_TIMEOUT_MS}. */
  public byte[] get(String key) {
    return get(key, DEFAULT_TIMEOUT_MS);
  }

  /** Adds {@code delta} to the integer at {@code key} (0 when unset); the new value. */
  public long add(String key, long delta) {
    Objects.requireNonNull(key, "key");
    return HpshardNative.hps_store_add(handle(), key, delta);
  }

  /** Waits up to {@code timeoutMs} until {@code key} is set (hps_store_wait; TIMEOUT). */
  public void await(String key, long timeoutMs) {
    Objects.requireNonNull(key, "key");
    HpshardNative.hps_store_wait(handle(), key, timeoutMs);
  }

  /** Whether {@code key} is set, without waiting. */
  public boolean check(String key) {
    Objects.requireNonNull(key, "key");
    return HpshardNative.hps_store_check(handle(), key) != 0;
  }

  /** Destroys the store; does nothing when already closed. */
  @Override
  public void close() {
    cleanable.clean();
  }

  @Override
  public String toString() {
    return "Store[" + url + ", rank " + rank + (isClosed() ? ", closed]" : "]");
  }
}
