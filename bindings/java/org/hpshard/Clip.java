package org.hpshard;

import java.lang.ref.Cleaner;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.List;
import java.util.Objects;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.HpshardNativeConstants;
import org.hpshard.internal.SWIGTYPE_p_hps_clip;
import org.hpshard.internal.SWIGTYPE_p_hps_comm;
import org.hpshard.internal.hps_clip_flag_t;
import org.hpshard.internal.hps_clip_options_t;

/**
 * Clips gradients by their global L2 norm over a hybrid topology (hps_clip_t): per gradient
 * the squared norm is summed over the sharding, mp (distributed gradients) and pp groups;
 * coef = maxNorm / (max(norm, maxNorm) + 1e-6) scales every clipped gradient.
 *
 * <p>Gradients are DIRECT ByteBuffers in native byte order, registered from their position
 * to their limit; the clip keeps them reachable while it lives (the library writes them on
 * every {@link #run}). It keeps its communicators reachable too, and closing one of them
 * closes the clip first. {@link #close()} destroys it exactly once. One thread at a time.
 */
public final class Clip implements AutoCloseable {
  /** hps_clip_flag_t bits, for {@link #addTensor(ByteBuffer, DType, long)}. */
  public static final int DISTRIBUTED = hps_clip_flag_t.HPS_CLIP_DISTRIBUTED;
  public static final int NO_CLIP = hps_clip_flag_t.HPS_CLIP_NO_CLIP;
  public static final int SHARED_NOT_FIRST = hps_clip_flag_t.HPS_CLIP_SHARED_NOT_FIRST;

  private static final class State implements Runnable {
    private SWIGTYPE_p_hps_clip handle;
    private final List<Object> keep = new ArrayList<>();
    private final List<Communicator> comms = new ArrayList<>();

    State(SWIGTYPE_p_hps_clip handle) {
      this.handle = handle;
    }

    @Override
    public void run() {
      SWIGTYPE_p_hps_clip h;
      List<Communicator> cs;
      synchronized (this) {
        h = handle;
        handle = null;
        cs = new ArrayList<>(comms);
        comms.clear();
      }
      try {
        if (h != null) HpshardNative.hps_clip_destroy(h);
      } finally {
        synchronized (this) {
          keep.clear();
        }
        for (Communicator c : cs) c.forget(this);
      }
    }
  }

  private final State state;
  private final Cleaner.Cleanable cleanable;
  private final double maxNorm;
  private final boolean deterministic;
  private volatile Device device; // the communicators' (CPU without any)

  /** A clip over no group (one rank) with max_norm {@code maxNorm}. */
  public Clip(double maxNorm) {
    this(null, null, null, maxNorm, false);
  }

  /**
   * A clip over the given groups (each may be null: not reduced over). INVALID_ARGUMENT when
   * maxNorm is not positive and finite; UNIMPLEMENTED for CUDA communicators.
   */
  public Clip(Communicator sharding, Communicator mp, Communicator pp, double maxNorm,
      boolean deterministic) {
    hps_clip_options_t opts =
        HpshardNative.hps_clip_options_init(HpshardNativeConstants.HPS_SWIG_CLIP_OPTIONS_STRUCT_SIZE);
    SWIGTYPE_p_hps_clip h;
    try {
      opts.setMax_norm(maxNorm);
      opts.setDeterministic(deterministic ? 1 : 0);
      h = HpshardNative.hps_clip_create(handle(sharding), handle(mp), handle(pp), opts);
    } finally {
      opts.delete();
    }
    this.state = new State(h);
    this.cleanable = Stream.CLEANER.register(this, state);
    this.maxNorm = maxNorm;
    this.deterministic = deterministic;
    Device first = null;
    for (Communicator c : new Communicator[] {sharding, mp, pp}) {
      if (c != null) {
        state.comms.add(c);
        c.remember(state);
        if (first == null) first = c.device();
      }
    }
    // hps_clip_create refuses communicators on different devices; none: the CPU.
    this.device = first != null ? first : new Device(DeviceType.CPU, 0);
  }

  /** Tests only: pretend the clip's memory is on {@code device}. */
  void setDeviceForTest(Device device) {
    this.device = Objects.requireNonNull(device, "device");
  }

  private static SWIGTYPE_p_hps_comm handle(Communicator c) {
    return c == null ? null : c.handle();
  }

  /** The library's default max_norm (hps_clip_options_init). */
  public static double defaultMaxNorm() {
    hps_clip_options_t o =
        HpshardNative.hps_clip_options_init(HpshardNativeConstants.HPS_SWIG_CLIP_OPTIONS_STRUCT_SIZE);
    try {
      return o.getMax_norm();
    } finally {
      o.delete();
    }
  }

  /**
   * The struct_size hps_clip_options_init records for {@code structSize} bytes; sizes below
   * the first version of the struct throw INVALID_ARGUMENT.
   */
  public static long optionsStructSize(long structSize) {
    hps_clip_options_t o = HpshardNative.hps_clip_options_init(structSize);
    try {
      return o.getStruct_size();
    } finally {
      o.delete();
    }
  }

  public double maxNorm() {
    return maxNorm;
  }

  public boolean deterministic() {
    return deterministic;
  }

  public boolean isClosed() {
    synchronized (state) {
      return state.handle == null;
    }
  }

  SWIGTYPE_p_hps_clip handle() {
    synchronized (state) {
      if (state.handle == null) throw new IllegalStateException("hpshard clip is closed");
      return state.handle;
    }
  }

  /** {@link #addTensor(ByteBuffer, DType, boolean, boolean, boolean)}: clipped, replicated. */
  public void addTensor(ByteBuffer grad, DType dtype) {
    addTensor(grad, dtype, false, true, false);
  }

  /**
   * Registers a gradient (FLOAT32, FLOAT64, FLOAT16 or BFLOAT16): {@code distributed}: split
   * across mp; {@code clip} false: neither counted nor scaled; {@code sharedNotFirst}: a
   * pipeline-shared copy, scaled but not counted. INVALID_ARGUMENT (dtype),
   * FAILED_PRECONDITION (sealed).
   */
  public void addTensor(ByteBuffer grad, DType dtype, boolean distributed, boolean clip,
      boolean sharedNotFirst) {
    addTensor(grad, dtype, (distributed ? DISTRIBUTED : 0) | (clip ? 0 : NO_CLIP)
        | (sharedNotFirst ? SHARED_NOT_FIRST : 0));
  }

  /** As above with raw hps_clip_flag_t bits (unknown bits: INVALID_ARGUMENT). */
  public void addTensor(ByteBuffer grad, DType dtype, long flags) {
    Objects.requireNonNull(grad, "grad");
    Objects.requireNonNull(dtype, "dtype");
    if (!grad.isDirect()) {
      throw new IllegalArgumentException(
          "Clip.addTensor: grad is a heap ByteBuffer; use ByteBuffer.allocateDirect");
    }
    if (grad.isReadOnly()) throw new IllegalArgumentException("Clip.addTensor: grad is read-only");
    ByteBuffer slice = grad.slice();
    long size = dtype.size();
    if (slice.remaining() % size != 0) {
      throw new IllegalArgumentException("Clip.addTensor: grad has " + slice.remaining()
          + " bytes, no whole number of " + dtype.name() + " elements");
    }
    synchronized (state) {
      HpshardNative.hps_clip_add_tensor(handle(), slice, slice.remaining() / size, dtype.code(),
          flags);
      state.keep.add(slice);
    }
  }

  /**
   * Finishes registration: collective over mp (one host sync at set-up); INVALID_ARGUMENT
   * when mp ranks registered different flags.
   */
  public void seal() {
    HpshardNative.hps_clip_seal(handle());
  }

  /** {@link #run(Stream, ByteBuffer, boolean)} without the norm, scaling. */
  public void run(Stream stream) {
    run(stream, null, true);
  }

  /**
   * Enqueues one clip on {@code stream}: the norm into {@code normOut} (a direct ByteBuffer
   * of at least one float32 at its position, or null) and, when {@code scale}, the scaling
   * of the gradients. Nothing blocks: read normOut after {@link Stream#synchronize()}, until
   * which the stream keeps it reachable. FAILED_PRECONDITION before {@link #seal()}.
   */
  public void run(Stream stream, ByteBuffer normOut, boolean scale) {
    Objects.requireNonNull(stream, "stream");
    ByteBuffer out = null;
    if (normOut != null) {
      if (!normOut.isDirect() || normOut.isReadOnly()) {
        throw new IllegalArgumentException("Clip.run: normOut must be a writable direct ByteBuffer");
      }
      out = normOut.slice();
      if (out.remaining() < 4) {
        throw new IllegalArgumentException("Clip.run: normOut holds no float32");
      }
    }
    HpshardNative.hps_clip_run(handle(), stream.handle(), out, scale ? 1 : 0);
    stream.keepUntilSynchronized(out);
  }

  /** The address of the latest coefficient (owned by the clip; valid after run, in stream order). */
  public long coefficientAddress() {
    return HpshardNative.hps_clip_coefficient(handle());
  }

  /**
   * A read-only 4-byte direct ByteBuffer (native order) over the latest coefficient (CPU
   * clips only: a clip over CUDA communicators keeps it in device memory, and this throws
   * HpsException FAILED_PRECONDITION; use {@link #coefficientAddress}); read it after
   * synchronizing the stream of {@link #run}. It is INVALID after the clip is closed.
   */
  public ByteBuffer coefficient() {
    Engine.requireHostMemory(device, "Clip.coefficient", "coefficientAddress()", "the clip's");
    return HpshardNative.hps_swig_direct_buffer(coefficientAddress(), 4)
        .order(ByteOrder.nativeOrder()).asReadOnlyBuffer().order(ByteOrder.nativeOrder());
  }

  /** Destroys the clip (and lets go of its gradients); nothing when already closed. */
  @Override
  public void close() {
    cleanable.clean();
  }

  @Override
  public String toString() {
    return "Clip[maxNorm=" + maxNorm + (isClosed() ? ", closed]" : "]");
  }
}
