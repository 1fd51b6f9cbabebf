package org.hpshard;

import java.lang.ref.Reference;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.TensorHandle;

/**
 * A view of library memory as a DLPack tensor (DLManagedTensor): an engine's parameter or
 * gradient, a clip's coefficient, the loss scale. It holds the library's reference that
 * keeps that memory alive until the view is closed (or collected): the engine's memory
 * outlives {@link Engine#close()} while views of it exist. A view of a closed engine or
 * clip refuses to be used (IllegalStateException); a ByteBuffer taken from it before stays
 * valid memory (it keeps the view reachable), no longer updated. A stage-3 parameter's view
 * is the exception: its memory serves the next gathered unit once its own is released
 * ({@link Engine}).
 *
 * <p>{@link #byteBuffer()} is a direct ByteBuffer over host memory; the library refuses a
 * host view of device memory (HpsException FAILED_PRECONDITION), its one host/device policy.
 * {@link #address()} is the data's address on the tensor's {@link #device()}. Collectives
 * ({@link Communicator}) and {@link Clip#addTensor(Tensor, long)} take views as they are,
 * and keep the view's memory alive while they use it (an operation until its {@link Work}
 * has been observed finished or closed, a clip until it is closed), also when this Tensor
 * or its engine is closed first.
 */
public final class Tensor extends Handle<TensorHandle> {
  private final Handle<?> owner;
  private final String what;
  private final long[] shape;
  private final DType dtype;
  private final Device device;
  private final Release release;
  private Object pin; // the ByteBuffers' attachment, once one was handed out

  /**
   * When the native view goes: at close() (or collection) of the Tensor, unless a
   * ByteBuffer over it exists; then when the last such buffer is collected. close() thus
   * ends the Tensor's use, never the buffers' memory.
   */
  private static final class Release {
    private TensorHandle view;
    private boolean closed;
    private boolean pinned;

    synchronized void destroy(TensorHandle p) {
      view = p;
      closed = true;
      if (!pinned) free();
    }

    synchronized void pin() {
      pinned = true;
    }

    synchronized void unpinned() {
      pinned = false;
      if (closed) free();
    }

    private void free() {
      if (view != null) view.delete();
      view = null;
    }
  }

  Tensor(TensorHandle view, Handle<?> owner, String what) {
    this(view, owner, what, new Release());
  }

  private Tensor(TensorHandle view, Handle<?> owner, String what, Release release) {
    super(view, release::destroy, "tensor");
    this.release = release;
    this.owner = owner;
    this.what = what;
    this.shape = new long[view.ndim()];
    for (int i = 0; i < shape.length; ++i) shape[i] = view.dim(i);
    this.dtype = dtypeOf(view.dtypeCode(), view.dtypeBits());
    // DLPack: kDLCPU = 1, kDLCUDA = 2.
    this.device = new Device(view.deviceType() == 2 ? DeviceType.CUDA : DeviceType.CPU,
        view.deviceId());
  }

  private static DType dtypeOf(int code, int bits) {
    // DLPack type codes: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4.
    if (code == 2) return bits == 64 ? DType.FLOAT64 : bits == 16 ? DType.FLOAT16 : DType.FLOAT32;
    if (code == 4) return DType.BFLOAT16;
    if (code == 1) return DType.UINT8;
    return bits == 64 ? DType.INT64 : DType.INT32;
  }

  /** The view, unless its owner (engine, clip) or the view itself is closed. */
  @Override
  TensorHandle h() {
    if (owner.isClosed()) {
      throw new IllegalStateException(what + ": the " + owner.getClass().getSimpleName()
          .toLowerCase() + " of this view is closed");
    }
    return super.h();
  }

  public long[] shape() {
    return shape.clone();
  }

  public DType dtype() {
    return dtype;
  }

  /** Where the memory is. */
  public Device device() {
    return device;
  }

  /** Elements of the view. */
  public long numel() {
    long n = 1;
    for (long d : shape) n *= d;
    return n;
  }

  /** The data's address on {@link #device()}, for that device's tools. */
  public long address() {
    try {
      return h().data();
    } finally {
      Reference.reachabilityFence(this);
    }
  }

  /**
   * A direct ByteBuffer (native byte order) over the host memory of the view; it keeps the
   * memory alive (past close() of this Tensor and of its engine) while it, or a buffer
   * derived from it, is reachable. HpsException FAILED_PRECONDITION off the host.
   */
  public ByteBuffer byteBuffer() {
    try {
      long address;
      try {
        address = h().hostData();
      } catch (HpsException e) {
        throw new HpsException(e.status(), what + ": " + e.getMessage());
      }
      long bytes = numel() * dtype.size();
      if (bytes > Integer.MAX_VALUE) {
        throw new UnsupportedOperationException(what + " exceeds 2 GiB");
      }
      return HpshardNative.directBuffer(address, bytes, pinned().keep)
          .order(ByteOrder.nativeOrder());
    } finally {
      Reference.reachabilityFence(this);
    }
  }

  /**
   * The view with an object that keeps its native view (and so the memory) alive while the
   * object is reachable, past close() of this Tensor and of its owner: what a ByteBuffer
   * over it, an operation ({@link Work}) or a {@link Clip} holds. IllegalStateException
   * when the Tensor or its owner is closed.
   */
  Pinned pinned() {
    try {
      synchronized (release) {
        TensorHandle view = h(); // open now, and stays so: a close takes this monitor
        if (pin == null) {
          pin = new Object();
          release.pin();
          CLEANER.register(pin, release::unpinned);
        }
        return new Pinned(view, pin);
      }
    } finally {
      Reference.reachabilityFence(this);
    }
  }

  /** A view and the object whose reachability keeps it (see {@link #pinned()}). */
  static final class Pinned {
    final TensorHandle view;
    final Object keep;

    Pinned(TensorHandle view, Object keep) {
      this.view = view;
      this.keep = keep;
    }
  }

  /**
   * Ends this Tensor's use; the native view goes now, or, when ByteBuffers were taken, once
   * the last of them is collected.
   */
  @Override
  public void close() {
    synchronized (release) {
      super.close();
      pin = null; // the buffers, operations and clips that hold it alone keep it now
    }
  }

  @Override
  public String toString() {
    return "Tensor[" + what + " " + dtype.name().toLowerCase() + java.util.Arrays.toString(shape)
        + " " + device + (isClosed() ? ", closed]" : "]");
  }
}
