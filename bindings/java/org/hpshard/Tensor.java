package org.hpshard;

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
 * valid memory (it keeps the view reachable), no longer updated.
 *
 * <p>{@link #byteBuffer()} is a direct ByteBuffer over host memory; the library refuses a
 * host view of device memory (HpsException FAILED_PRECONDITION), its one host/device policy.
 * {@link #address()} is the data's address on the tensor's {@link #device()}. Collectives
 * ({@link Communicator}) and {@link Clip#addTensor(Tensor, long)} take views as they are.
 */
public final class Tensor extends Handle<TensorHandle> {
  private final Handle<?> owner;
  private final String what;
  private final long[] shape;
  private final DType dtype;
  private final Device device;

  Tensor(TensorHandle view, Handle<?> owner, String what) {
    super(view, TensorHandle::delete, "tensor");
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
    return h().data();
  }

  /**
   * A direct ByteBuffer (native byte order) over the host memory of the view; it keeps this
   * view, and so the memory, reachable. HpsException FAILED_PRECONDITION off the host.
   */
  public ByteBuffer byteBuffer() {
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
    return HpshardNative.directBuffer(address, bytes, this).order(ByteOrder.nativeOrder());
  }

  @Override
  public String toString() {
    return "Tensor[" + what + " " + dtype.name().toLowerCase() + java.util.Arrays.toString(shape)
        + " " + device + (isClosed() ? ", closed]" : "]");
  }
}
