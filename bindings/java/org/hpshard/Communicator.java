package org.hpshard;

import java.lang.ref.Reference;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.Objects;
import org.hpshard.internal.CommHandle;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.StreamHandle;
import org.hpshard.internal.WorkHandle;
import org.hpshard.internal.hps_comm_options_t;

/**
 * This rank's member of a group of ranks (hps_comm_t), running collectives on its own
 * stream (Gloo on CPU buffers).
 *
 * <p>Data are DIRECT ByteBuffers ({@link ByteBuffer#allocateDirect}) in native byte order,
 * read from their position to their limit; the element count is the bytes remaining divided
 * by the dtype's size. Outputs must be writable. Each collective also takes DLPack
 * {@link Tensor}s (an engine's views): dtype, count and device come from them, checked by
 * the library. Every collective returns a {@link Work} that keeps the buffers reachable: do
 * not touch them before it has been awaited. One thread at a time per communicator, except
 * {@link #abort()} (any thread). {@link #close()} destroys it exactly once (hybrid groups,
 * clips and engines over it first; after its queued operations end).
 */
public final class Communicator extends Handle<CommHandle> {
  /** Communicator options; unset ones keep the library's defaults. */
  public static final class Options {
    private Long timeoutMs;
    private Boolean checkArguments;
    private String name;

    /** Every operation ends by then with TIMEOUT (default 300000, or HPS_COMM_TIMEOUT_MS). */
    public Options timeoutMs(long timeoutMs) {
      this.timeoutMs = timeoutMs;
      return this;
    }

    /** Ranks check they called the same collective (default on, or HPS_COMM_CHECK). */
    public Options checkArguments(boolean checkArguments) {
      this.checkArguments = checkArguments;
      return this;
    }

    /** The group's name in messages (default "world"). */
    public Options name(String name) {
      this.name = name;
      return this;
    }
  }

  private final String name;

  Communicator(CommHandle handle, String name) {
    super(new CommState(handle), "communicator");
    this.name = name;
  }

  /**
   * Closing waits for the queued operations (hps_comm_finish) before the destroy, keeping
   * the handle where {@link #abort()} reaches it: an operation stuck on a rank that has gone
   * ends at once rather than at its timeout. The monitor is held only to hand the handle
   * over, so an abort never overlaps the destroy.
   */
  static final class CommState extends State<CommHandle> {
    private CommHandle closing;

    CommState(CommHandle handle) {
      super(handle, CommHandle::delete);
    }

    @Override
    void taken(CommHandle p) {
      closing = p; // under the monitor, as proxy() becomes null: abort() always finds it
    }

    @Override
    void beforeDestroy(CommHandle p) {
      try {
        p.finish();
      } catch (HpsException e) {
        // the operations' own errors: their works report them
      } finally {
        synchronized (this) {
          closing = null;
        }
      }
    }

    synchronized void abort() {
      CommHandle p = proxy();
      if (p == null) p = closing;
      if (p == null) throw new IllegalStateException("hpshard communicator is closed");
      p.abort();
    }
  }

  /** {@link #create(Store, int, int, DeviceType, int, Options)} on the CPU, defaults. */
  public static Communicator create(Store store, int rank, int size) {
    return create(store, rank, size, DeviceType.CPU, 0, null);
  }

  /** {@link #create(Store, int, int, DeviceType, int, Options)} on the CPU. */
  public static Communicator create(Store store, int rank, int size, Options options) {
    return create(store, rank, size, DeviceType.CPU, 0, options);
  }

  /**
   * Collective: every one of {@code size} ranks calls it; blocks until all have connected or
   * the timeout passed. {@code options} may be null.
   */
  public static Communicator create(Store store, int rank, int size, DeviceType type,
      int deviceIndex, Options options) {
    Objects.requireNonNull(store, "store");
    Objects.requireNonNull(type, "type");
    hps_comm_options_t opts = null;
    try {
      if (options != null) {
        opts = HpshardNative.commOptionsInit(HpshardNative.commOptionsStructSize());
        if (options.timeoutMs != null) opts.setTimeout_ms(options.timeoutMs);
        if (options.checkArguments != null) opts.setCheck_arguments(options.checkArguments ? 1 : 0);
        if (options.name != null) opts.setName(options.name);
      }
      final hps_comm_options_t given = opts;
      // Counted as a use of the store: a close of it meanwhile waits for the creation.
      return new Communicator(
          store.use(h -> CommHandle.create(h, rank, size, type.code(), deviceIndex, given)),
          options == null ? null : options.name);
    } finally {
      if (opts != null) opts.delete();
    }
  }

  /** The name given at creation (null: the library's default). */
  public String name() {
    return name;
  }

  /** This rank's position in the communicator. */
  public int rank() {
    final CommHandle nh = enter();
    try {
      return nh.rank();
    } finally {
      leave();
    }
  }

  /** The number of ranks. */
  public int size() {
    final CommHandle nh = enter();
    try {
      return nh.size();
    } finally {
      leave();
    }
  }

  /**
   * The device the communicator was created on (hps_comm_device). Collectives of a CUDA
   * communicator take device memory, not ByteBuffers of host memory.
   */
  public Device device() {
    final CommHandle nh = enter();
    try {
      return Device.fromNative(nh.device());
    } finally {
      leave();
    }
  }

  /**
   * How collectives move data (hps_comm_transport): "shm" (CPU ranks all on this host), "tcp"
   * (Gloo TCP; also a group of one, or HPS_COMM_SHM=0), "self" (a CPU group of one in a build
   * without Gloo) or "nccl".
   */
  public String transport() {
    final CommHandle nh = enter();
    try {
      return nh.transport();
    } finally {
      leave();
    }
  }

  /**
   * From any thread: pending and later operations end with ABORTED, also while
   * {@link #close()} waits for them (IllegalStateException once it has closed), here and on
   * every live communicator split from this one (a topology's groups, a checkpoint's own).
   */
  public void abort() {
    ((CommState) state).abort();
  }

  /** Changes the timeout of later operations; INVALID_ARGUMENT when <= 0. */
  public void setTimeout(long timeoutMs) {
    final CommHandle nh = enter();
    try {
      nh.setTimeout(timeoutMs);
    } finally {
      leave();
    }
  }

  /**
   * Collective: every rank passes the same {@code ranks} (of this communicator) in the same
   * order. Members get a new communicator (rank = position in {@code ranks}), others null.
   * Every rank takes part: ranks whose lists differ all get INVALID_ARGUMENT and nothing is
   * made. {@code name} (in messages) may be null: this communicator's name + ".split".
   */
  public Communicator split(int[] ranks, String name) {
    final CommHandle nh = enter();
    try {
      Objects.requireNonNull(ranks, "ranks");
      if (name == null) name = (this.name != null ? this.name : "world") + ".split";
      CommHandle h = nh.split(ranks, name);
      return h == null ? null : new Communicator(h, name);
    } finally {
      leave();
    }
  }

  // ---- buffers ---------------------------------------------------------------------------
  /** The slice from position to limit, checked; its element count via count(). */
  private static ByteBuffer data(ByteBuffer b, String op, String what, boolean writable) {
    Objects.requireNonNull(b, op + ": " + what);
    if (!b.isDirect()) {
      throw new IllegalArgumentException(
          op + ": " + what + " is a heap ByteBuffer; use ByteBuffer.allocateDirect");
    }
    if (writable && b.isReadOnly()) {
      throw new IllegalArgumentException(op + ": " + what + " is read-only");
    }
    if (b.order() != ByteOrder.nativeOrder()) {
      throw new IllegalArgumentException(op + ": " + what + " is " + b.order()
          + "; the library reads native order (" + ByteOrder.nativeOrder() + ")");
    }
    return b.slice();
  }

  private static long count(ByteBuffer slice, DType dtype, String op, String what) {
    long size = dtype.size();
    if (slice.remaining() % size != 0) {
      throw new IllegalArgumentException(op + ": " + what + " has " + slice.remaining()
          + " bytes, no whole number of " + dtype.name() + " elements");
    }
    return slice.remaining() / size;
  }

  private static StreamHandle ready(Stream ready) {
    try {
      return ready == null ? null : ready.h();
    } finally {
      Reference.reachabilityFence(ready);
    }
  }

  private static Work work(WorkHandle h, Stream ready, Object... buffers) {
    Work w = new Work(h, buffers);
    w.keep(ready);
    return w;
  }

  private static Tensor.Pinned t(Tensor t, String what) {
    return Objects.requireNonNull(t, what).pinned();
  }

  private static void sameCount(long a, long b, String op) {
    if (a != b) {
      throw new IllegalArgumentException(op + ": send has " + a + " elements, recv " + b);
    }
  }

  // ---- collectives -----------------------------------------------------------------------
  /** recv[i] = op over ranks of send[i]; recv may be send (in place). */
  public Work allReduce(ByteBuffer send, ByteBuffer recv, DType dtype, ReduceOp op) {
    return allReduce(send, recv, dtype, op, null);
  }

  /** As above; the operation starts after the work queued on {@code ready} (may be null). */
  public Work allReduce(ByteBuffer send, ByteBuffer recv, DType dtype, ReduceOp op,
      Stream ready) {
    final CommHandle nh = enter();
    try {
      Objects.requireNonNull(dtype, "dtype");
      Objects.requireNonNull(op, "op");
      ByteBuffer s = data(send, "allReduce", "send", false);
      ByteBuffer r = data(recv, "allReduce", "recv", true);
      long n = count(s, dtype, "allReduce", "send");
      sameCount(n, count(r, dtype, "allReduce", "recv"), "allReduce");
      return work(nh.allReduce(s, r, n, dtype.code(), op.code(),
          ready(ready)), ready, s, r);
    } finally {
      leave();
    }
  }

  /** Like allReduce, but only {@code root} receives ({@code recv} may be null elsewhere). */
  public Work reduce(ByteBuffer send, ByteBuffer recv, DType dtype, ReduceOp op, int root) {
    return reduce(send, recv, dtype, op, root, null);
  }

  public Work reduce(ByteBuffer send, ByteBuffer recv, DType dtype, ReduceOp op, int root,
      Stream ready) {
    final CommHandle nh = enter();
    try {
      Objects.requireNonNull(dtype, "dtype");
      Objects.requireNonNull(op, "op");
      ByteBuffer s = data(send, "reduce", "send", false);
      long n = count(s, dtype, "reduce", "send");
      ByteBuffer r = null;
      if (recv != null) {
        r = data(recv, "reduce", "recv", true);
        sameCount(n, count(r, dtype, "reduce", "recv"), "reduce");
      }
      return work(nh.reduce(s, r, n, dtype.code(), op.code(), root,
          ready(ready)), ready, s, r);
    } finally {
      leave();
    }
  }

  /** {@code root}'s buffer is copied into every rank's buffer. */
  public Work broadcast(ByteBuffer buffer, DType dtype, int root) {
    return broadcast(buffer, dtype, root, null);
  }

  public Work broadcast(ByteBuffer buffer, DType dtype, int root, Stream ready) {
    final CommHandle nh = enter();
    try {
      Objects.requireNonNull(dtype, "dtype");
      ByteBuffer b = data(buffer, "broadcast", "buffer", true);
      long n = count(b, dtype, "broadcast", "buffer");
      return work(nh.broadcast(b, n, dtype.code(), root,
          ready(ready)), ready, b);
    } finally {
      leave();
    }
  }

  /**
   * Rank r's send lands at element r * (send elements) of recv, which needs size * (send
   * elements); fewer throws INVALID_ARGUMENT with nothing sent.
   */
  public Work allGather(ByteBuffer send, ByteBuffer recv, DType dtype) {
    return allGather(send, recv, dtype, null);
  }

  public Work allGather(ByteBuffer send, ByteBuffer recv, DType dtype, Stream ready) {
    final CommHandle nh = enter();
    try {
      Objects.requireNonNull(dtype, "dtype");
      ByteBuffer s = data(send, "allGather", "send", false);
      ByteBuffer r = data(recv, "allGather", "recv", true);
      return work(nh.allGather(s, count(s, dtype, "allGather",
          "send"), r, count(r, dtype, "allGather", "recv"), dtype.code(), ready(ready)), ready, s,
          r);
    } finally {
      leave();
    }
  }

  /** Rank r receives the reduction of slice r of every rank's send (size * recv elements). */
  public Work reduceScatter(ByteBuffer send, ByteBuffer recv, DType dtype, ReduceOp op) {
    return reduceScatter(send, recv, dtype, op, null);
  }

  public Work reduceScatter(ByteBuffer send, ByteBuffer recv, DType dtype, ReduceOp op,
      Stream ready) {
    final CommHandle nh = enter();
    try {
      Objects.requireNonNull(dtype, "dtype");
      Objects.requireNonNull(op, "op");
      ByteBuffer s = data(send, "reduceScatter", "send", false);
      ByteBuffer r = data(recv, "reduceScatter", "recv", true);
      return work(nh.reduceScatter(s, count(s, dtype,
          "reduceScatter", "send"), r, count(r, dtype, "reduceScatter", "recv"), dtype.code(),
          op.code(), ready(ready)), ready, s, r);
    } finally {
      leave();
    }
  }

  /** Sends the buffer to {@code peer}, which receives it with {@link #recv}. */
  public Work send(ByteBuffer buffer, DType dtype, int peer) {
    return send(buffer, dtype, peer, null);
  }

  public Work send(ByteBuffer buffer, DType dtype, int peer, Stream ready) {
    final CommHandle nh = enter();
    try {
      Objects.requireNonNull(dtype, "dtype");
      ByteBuffer b = data(buffer, "send", "buffer", false);
      return work(nh.send(b, count(b, dtype, "send", "buffer"),
          dtype.code(), peer, ready(ready)), ready, b);
    } finally {
      leave();
    }
  }

  /** Receives the buffer's element count from {@code peer}. */
  public Work recv(ByteBuffer buffer, DType dtype, int peer) {
    return recv(buffer, dtype, peer, null);
  }

  public Work recv(ByteBuffer buffer, DType dtype, int peer, Stream ready) {
    final CommHandle nh = enter();
    try {
      Objects.requireNonNull(dtype, "dtype");
      ByteBuffer b = data(buffer, "recv", "buffer", true);
      return work(nh.recv(b, count(b, dtype, "recv", "buffer"),
          dtype.code(), peer, ready(ready)), ready, b);
    } finally {
      leave();
    }
  }

  /** Completes once every rank has reached it. */
  public Work barrier() {
    return barrier(null);
  }

  public Work barrier(Stream ready) {
    final CommHandle nh = enter();
    try {
      return work(nh.barrier(ready(ready)), ready);
    } finally {
      leave();
    }
  }

  // ---- collectives over DLPack tensors -------------------------------------------------------
  // Each view is pinned before the call and the Work holds the pins: a Tensor (or its engine)
  // closed while the operation is pending keeps its memory until the operation is over.

  /** allReduce over tensors (dtype and counts from them; send may be recv). */
  public Work allReduce(Tensor send, Tensor recv, ReduceOp op, Stream ready) {
    final CommHandle nh = enter();
    try {
      Tensor.Pinned s = t(send, "send"), r = t(recv, "recv");
      return work(nh.allReduceDlpack(s.view, r.view, Objects.requireNonNull(op, "op").code(),
          ready(ready)), ready, s.keep, r.keep);
    } finally {
      leave();
    }
  }

  /** reduce over tensors ({@code recv} may be null on other ranks than root). */
  public Work reduce(Tensor send, Tensor recv, ReduceOp op, int root, Stream ready) {
    final CommHandle nh = enter();
    try {
      Tensor.Pinned s = t(send, "send"), r = recv == null ? null : recv.pinned();
      return work(nh.reduceDlpack(s.view, r == null ? null : r.view,
          Objects.requireNonNull(op, "op").code(), root, ready(ready)), ready, s.keep,
          r == null ? null : r.keep);
    } finally {
      leave();
    }
  }

  /** broadcast of a tensor. */
  public Work broadcast(Tensor buffer, int root, Stream ready) {
    final CommHandle nh = enter();
    try {
      Tensor.Pinned b = t(buffer, "buffer");
      return work(nh.broadcastDlpack(b.view, root, ready(ready)), ready, b.keep);
    } finally {
      leave();
    }
  }

  /** allGather over tensors (recv needs size x send elements). */
  public Work allGather(Tensor send, Tensor recv, Stream ready) {
    final CommHandle nh = enter();
    try {
      Tensor.Pinned s = t(send, "send"), r = t(recv, "recv");
      return work(nh.allGatherDlpack(s.view, r.view, ready(ready)), ready, s.keep, r.keep);
    } finally {
      leave();
    }
  }

  /** reduceScatter over tensors (send needs size x recv elements). */
  public Work reduceScatter(Tensor send, Tensor recv, ReduceOp op, Stream ready) {
    final CommHandle nh = enter();
    try {
      Tensor.Pinned s = t(send, "send"), r = t(recv, "recv");
      return work(nh.reduceScatterDlpack(s.view, r.view, Objects.requireNonNull(op, "op").code(),
          ready(ready)), ready, s.keep, r.keep);
    } finally {
      leave();
    }
  }

  /** send of a tensor to {@code peer}. */
  public Work send(Tensor buffer, int peer, Stream ready) {
    final CommHandle nh = enter();
    try {
      Tensor.Pinned b = t(buffer, "buffer");
      return work(nh.sendDlpack(b.view, peer, ready(ready)), ready, b.keep);
    } finally {
      leave();
    }
  }

  /** recv into a tensor from {@code peer}. */
  public Work recv(Tensor buffer, int peer, Stream ready) {
    final CommHandle nh = enter();
    try {
      Tensor.Pinned b = t(buffer, "buffer");
      return work(nh.recvDlpack(b.view, peer, ready(ready)), ready, b.keep);
    } finally {
      leave();
    }
  }

  @Override
  public String toString() {
    return "Communicator[" + (name == null ? "world" : name) + (isClosed() ? ", closed]" : "]");
  }
}
