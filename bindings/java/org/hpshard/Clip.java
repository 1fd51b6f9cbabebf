package org.hpshard;

import java.lang.ref.Reference;
import java.nio.ByteBuffer;
import java.util.Objects;
import org.hpshard.internal.ClipHandle;
import org.hpshard.internal.CommHandle;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.hps_clip_flag_t;
import org.hpshard.internal.hps_clip_options_t;

/**
 * Clips gradients by their global L2 norm over a hybrid topology (hps_clip_t): per gradient
 * the squared norm is summed over the sharding, mp (distributed gradients) and pp groups;
 * coef = maxNorm / (max(norm, maxNorm) + 1e-6) scales every clipped gradient.
 *
 * <p>Gradients are DIRECT ByteBuffers in native byte order, registered from their position
 * to their limit, or DLPack {@link Tensor}s (an engine's gradient views); the clip keeps them
 * reachable while it lives (the library writes them on every {@link #run}). It keeps its
 * communicators reachable too, and closing one of them closes the clip first. {@link
 * #close()} destroys it exactly once. One thread at a time.
 */
public final class Clip extends Handle<ClipHandle> {
  /** hps_clip_flag_t bits, for {@link #addTensor(ByteBuffer, DType, long)}. */
  public static final int DISTRIBUTED = hps_clip_flag_t.HPS_CLIP_DISTRIBUTED;
  public static final int NO_CLIP = hps_clip_flag_t.HPS_CLIP_NO_CLIP;
  public static final int SHARED_NOT_FIRST = hps_clip_flag_t.HPS_CLIP_SHARED_NOT_FIRST;

  private final double maxNorm;
  private final boolean deterministic;

  /** A clip over no group (one rank) with max_norm {@code maxNorm}. */
  public Clip(double maxNorm) {
    this(null, null, null, maxNorm, false);
  }

  /**
   * A clip over the given groups (each may be null: not reduced over). INVALID_ARGUMENT when
   * maxNorm is not positive and finite; UNIMPLEMENTED for CUDA communicators in a build
   * without CUDA.
   */
  public Clip(Communicator sharding, Communicator mp, Communicator pp, double maxNorm,
      boolean deterministic) {
    super(create(sharding, mp, pp, maxNorm, deterministic), ClipHandle::delete, "clip");
    this.maxNorm = maxNorm;
    this.deterministic = deterministic;
    for (Communicator c : new Communicator[] {sharding, mp, pp}) dependOn(c);
  }

  private static ClipHandle create(Communicator sharding, Communicator mp, Communicator pp,
      double maxNorm, boolean deterministic) {
    hps_clip_options_t opts = HpshardNative.clipOptionsInit(HpshardNative.clipOptionsStructSize());
    try {
      opts.setMax_norm(maxNorm);
      opts.setDeterministic(deterministic ? 1 : 0);
      return ClipHandle.create(handle(sharding), handle(mp), handle(pp), opts);
    } finally {
      opts.delete();
    }
  }

  private static CommHandle handle(Communicator c) {
    try {
      return c == null ? null : c.h();
    } finally {
      Reference.reachabilityFence(c);
    }
  }

  /** The library's default max_norm (hps_clip_options_init). */
  public static double defaultMaxNorm() {
    hps_clip_options_t o = HpshardNative.clipOptionsInit(HpshardNative.clipOptionsStructSize());
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
    hps_clip_options_t o = HpshardNative.clipOptionsInit(structSize);
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
    final ClipHandle nh = enter();
    try {
      Objects.requireNonNull(grad, "grad");
      Objects.requireNonNull(dtype, "dtype");
      if (flags < 0 || flags > 0xFFFFFFFFL) {
        throw new IllegalArgumentException(
            "Clip.addTensor: flags " + flags + " are not 32-bit hps_clip_flag_t bits");
      }
      if (!grad.isDirect()) {
        throw new IllegalArgumentException(
            "Clip.addTensor: grad is a heap ByteBuffer; use ByteBuffer.allocateDirect");
      }
      if (grad.isReadOnly()) {
        throw new IllegalArgumentException("Clip.addTensor: grad is read-only");
      }
      if (grad.order() != java.nio.ByteOrder.nativeOrder()) {
        throw new IllegalArgumentException("Clip.addTensor: grad is " + grad.order()
            + "; the library reads native order (" + java.nio.ByteOrder.nativeOrder() + ")");
      }
      ByteBuffer slice = grad.slice();
      long size = dtype.size();
      if (slice.remaining() % size != 0) {
        throw new IllegalArgumentException("Clip.addTensor: grad has " + slice.remaining()
            + " bytes, no whole number of " + dtype.name() + " elements");
      }
      synchronized (state) {
        nh.addTensor(slice, slice.remaining() / size, dtype.code(), flags);
        keep(slice);
      }
    } finally {
      leave();
    }
  }

  /**
   * Registers a gradient given as a DLPack {@link Tensor} (dtype, count and device from it,
   * checked by the library) with raw hps_clip_flag_t bits; the clip keeps it reachable.
   */
  public void addTensor(Tensor grad, long flags) {
    final ClipHandle nh = enter();
    try {
      Objects.requireNonNull(grad, "grad");
      Tensor.Pinned g = grad.pinned(); // its memory stays while the clip holds this
      synchronized (state) {
        nh.addTensorDlpack(g.view, flags);
        keep(g.keep);
      }
    } finally {
      leave();
    }
  }

  /**
   * Finishes registration: collective over the clip's sharding, mp and pp groups (host syncs
   * at set-up); INVALID_ARGUMENT on every rank when the ranks of any mp group registered
   * different flags.
   */
  public void seal() {
    final ClipHandle nh = enter();
    try {
      nh.seal();
    } finally {
      leave();
    }
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
    final ClipHandle nh = enter();
    try {
      Objects.requireNonNull(stream, "stream");
      ByteBuffer out = null;
      if (normOut != null) {
        if (!normOut.isDirect() || normOut.isReadOnly()) {
          throw new IllegalArgumentException(
              "Clip.run: normOut must be a writable direct ByteBuffer");
        }
        if (normOut.order() != java.nio.ByteOrder.nativeOrder()) {
          throw new IllegalArgumentException("Clip.run: normOut is " + normOut.order()
              + "; the library writes native order (" + java.nio.ByteOrder.nativeOrder() + ")");
        }
        out = normOut.slice();
        if (out.remaining() < 4) {
          throw new IllegalArgumentException("Clip.run: normOut holds no float32");
        }
      }
      nh.run(stream.h(), out, scale ? 1 : 0);
      stream.keep(out);
    } finally {
      leave();
      Reference.reachabilityFence(stream);
    }
  }

  /** The address of the latest coefficient (owned by the clip; valid after run, in stream order). */
  public long coefficientAddress() {
    final ClipHandle nh = enter();
    try {
      return nh.coefficient();
    } finally {
      leave();
    }
  }

  /**
   * The latest coefficient as a DLPack {@link Tensor} (float32, shape {1}, on the clip's
   * device; hps_clip_coefficient_dlpack): it keeps the clip's memory alive.
   */
  public Tensor coefficientTensor() {
    final ClipHandle nh = enter();
    try {
      return new Tensor(nh.coefficientDlpack(), this, "Clip.coefficient");
    } finally {
      leave();
    }
  }

  /**
   * A read-only 4-byte direct ByteBuffer (native order) over the latest coefficient; read it
   * after synchronizing the stream of {@link #run}. It keeps the clip's memory alive. A clip
   * over CUDA communicators keeps the coefficient in device memory: the library refuses the
   * host view (HpsException FAILED_PRECONDITION; see {@link #coefficientTensor}).
   */
  public ByteBuffer coefficient() {
    return coefficientTensor().byteBuffer().asReadOnlyBuffer()
        .order(java.nio.ByteOrder.nativeOrder());
  }

  @Override
  public String toString() {
    return "Clip[maxNorm=" + maxNorm + (isClosed() ? ", closed]" : "]");
  }
}
