package org.hpshard;

import java.lang.ref.Cleaner;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.List;
import java.util.Objects;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.HpshardNativeConstants;
import org.hpshard.internal.SWIGTYPE_p_hps_engine;
import org.hpshard.internal.hps_engine_options_t;
import org.hpshard.internal.hps_param_flag_t;
import org.hpshard.internal.hps_status_t;

/**
 * ZeRO-style sharded data parallelism (hps_engine_t) for a framework that keeps its own
 * forward and backward: register the parameters, {@link #seal()}, write the parameters into
 * the {@link #param} views, add gradients into the {@link #grad} views, check each in with
 * {@link #gradReady}, then {@link #step()}.
 *
 * <p>{@link #param} and {@link #grad} return DIRECT ByteBuffers in native byte order OVER the
 * engine's memory (float32 elements; no copy) on an engine whose {@link #device()} is the CPU;
 * on another device (CUDA) they, {@link #lossScale()} and {@link #skippedSteps()} throw
 * HpsException FAILED_PRECONDITION, and {@link #paramAddress}, {@link #gradAddress} and
 * {@link #lossScaleAddresses()} give the device addresses instead. They are INVALID once the
 * engine is closed:
 * using one afterwards reads or writes freed memory. With stage 3 a parameter buffer is valid
 * only between {@link #waitParameters} and {@link #releaseParameters} of its unit. The engine
 * keeps its communicators reachable, and closing one of them closes the engine first.
 * {@link #close()} finishes what is in flight and destroys it exactly once. One thread at a
 * time per engine.
 */
public final class Engine implements AutoCloseable {
  /** hps_param_flag_t bits, for {@link #addParam(String, long[], DType, long, int)}. */
  public static final int FROZEN = hps_param_flag_t.HPS_PARAM_FROZEN;
  public static final int DISTRIBUTED = hps_param_flag_t.HPS_PARAM_DISTRIBUTED;
  public static final int NO_CLIP = hps_param_flag_t.HPS_PARAM_NO_CLIP;
  public static final int SHARED_NOT_FIRST = hps_param_flag_t.HPS_PARAM_SHARED_NOT_FIRST;

  /** Engine options; unset ones keep the library's defaults (hps_engine_options_init). */
  public static final class Options {
    private Integer stage;
    private Optimizer optimizer;
    private Float learningRate;
    private Float momentum;
    private Float weightDecay;
    private Boolean nesterov;
    private Float beta1;
    private Float beta2;
    private Float eps;
    private Double clipMaxNorm;
    private Boolean deterministicClip;
    private Integer accumulationSteps;
    private Long alignmentBytes;
    private Integer prefetchWindow;
    private Boolean dynamicLossScaling;
    private Float initialLossScale;
    private Float growthFactor;
    private Float backoffFactor;
    private Integer growthInterval;

    /** 2 (default) or 3. */
    public Options stage(int stage) {
      this.stage = stage;
      return this;
    }

    public Options optimizer(Optimizer optimizer) {
      this.optimizer = Objects.requireNonNull(optimizer, "optimizer");
      return this;
    }

    public Options learningRate(float learningRate) {
      this.learningRate = learningRate;
      return this;
    }

    public Options momentum(float momentum) {
      this.momentum = momentum;
      return this;
    }

    public Options weightDecay(float weightDecay) {
      this.weightDecay = weightDecay;
      return this;
    }

    public Options nesterov(boolean nesterov) {
      this.nesterov = nesterov;
      return this;
    }

    /** AdamW's (beta1, beta2). */
    public Options betas(float beta1, float beta2) {
      this.beta1 = beta1;
      this.beta2 = beta2;
      return this;
    }

    /** AdamW's epsilon. */
    public Options eps(float eps) {
      this.eps = eps;
      return this;
    }

    /** > 0: global-norm clipping folded into the optimizer. */
    public Options clipMaxNorm(double clipMaxNorm) {
      this.clipMaxNorm = clipMaxNorm;
      return this;
    }

    public Options deterministicClip(boolean deterministicClip) {
      this.deterministicClip = deterministicClip;
      return this;
    }

    public Options accumulationSteps(int accumulationSteps) {
      this.accumulationSteps = accumulationSteps;
      return this;
    }

    public Options alignmentBytes(long alignmentBytes) {
      this.alignmentBytes = alignmentBytes;
      return this;
    }

    /** Stage 3: units live at once, prefetch included. */
    public Options prefetchWindow(int prefetchWindow) {
      this.prefetchWindow = prefetchWindow;
      return this;
    }

    /**
     * Multiply the loss by {@link Engine#lossScale()}; non-finite gradients skip the step on
     * every rank (default off).
     */
    public Options dynamicLossScaling(boolean dynamicLossScaling) {
      this.dynamicLossScaling = dynamicLossScaling;
      return this;
    }

    /** Default 65536. */
    public Options initialLossScale(float initialLossScale) {
      this.initialLossScale = initialLossScale;
      return this;
    }

    /** Applied after growthInterval good steps (default 2). */
    public Options growthFactor(float growthFactor) {
      this.growthFactor = growthFactor;
      return this;
    }

    /** Applied on a skipped step (default 0.5). */
    public Options backoffFactor(float backoffFactor) {
      this.backoffFactor = backoffFactor;
      return this;
    }

    /** Good steps before the scale grows (default 2000). */
    public Options growthInterval(int growthInterval) {
      this.growthInterval = growthInterval;
      return this;
    }

    void applyTo(hps_engine_options_t o) {
      if (stage != null) o.setStage(stage);
      if (optimizer != null) o.setOptimizer(optimizer.code());
      if (learningRate != null) o.setLearning_rate(learningRate);
      if (momentum != null) o.setMomentum(momentum);
      if (weightDecay != null) o.setWeight_decay(weightDecay);
      if (nesterov != null) o.setNesterov(nesterov ? 1 : 0);
      if (beta1 != null) o.setBeta1(beta1);
      if (beta2 != null) o.setBeta2(beta2);
      if (eps != null) o.setEpsilon(eps);
      if (clipMaxNorm != null) o.setClip_max_norm(clipMaxNorm);
      if (deterministicClip != null) o.setDeterministic_clip(deterministicClip ? 1 : 0);
      if (accumulationSteps != null) o.setAccumulation_steps(accumulationSteps);
      if (alignmentBytes != null) o.setAlignment_bytes(alignmentBytes);
      if (prefetchWindow != null) o.setPrefetch_window(prefetchWindow);
      if (dynamicLossScaling != null) o.setDynamic_loss_scaling(dynamicLossScaling ? 1 : 0);
      if (initialLossScale != null) o.setInitial_loss_scale(initialLossScale);
      if (growthFactor != null) o.setGrowth_factor(growthFactor);
      if (backoffFactor != null) o.setBackoff_factor(backoffFactor);
      if (growthInterval != null) o.setGrowth_interval(growthInterval);
    }
  }

  private static final class State implements Runnable {
    private SWIGTYPE_p_hps_engine handle;
    private final List<Object> keep = new ArrayList<>(); // ready streams until synchronize
    private final List<Communicator> comms = new ArrayList<>();

    State(SWIGTYPE_p_hps_engine handle) {
      this.handle = handle;
    }

    @Override
    public void run() {
      SWIGTYPE_p_hps_engine h;
      List<Communicator> cs;
      synchronized (this) {
        h = handle;
        handle = null;
        cs = new ArrayList<>(comms);
        comms.clear();
      }
      try {
        if (h != null) HpshardNative.hps_engine_destroy(h); // finishes what is in flight
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
  private final List<long[]> shapes = new ArrayList<>();
  private final List<Integer> elementBytes = new ArrayList<>();
  private final List<String> names = new ArrayList<>();
  // Fixed at creation: the views are host memory only on a CPU engine. Not final so the
  // package's tests can show the guard without a GPU.
  private Device device;

  private Engine(SWIGTYPE_p_hps_engine handle, Communicator sharding, Communicator dp) {
    this.state = new State(handle);
    this.cleanable = Stream.CLEANER.register(this, state);
    this.device = Device.fromNative(HpshardNative.hps_engine_device(handle));
    for (Communicator c : new Communicator[] {sharding, dp}) {
      if (c != null) {
        state.comms.add(c);
        c.remember(state);
      }
    }
  }

  /** An engine over {@code sharding} with the library's default options. */
  public static Engine create(Communicator sharding) {
    return create(sharding, null, null);
  }

  /**
   * An engine sharding over {@code sharding} (required) with an optional {@code dp} group
   * above it; {@code options} may be null. INVALID_ARGUMENT, UNIMPLEMENTED (CUDA).
   */
  public static Engine create(Communicator sharding, Communicator dp, Options options) {
    Objects.requireNonNull(sharding, "sharding");
    hps_engine_options_t opts = HpshardNative.hps_engine_options_init(
        HpshardNativeConstants.HPS_SWIG_ENGINE_OPTIONS_STRUCT_SIZE);
    try {
      if (options != null) options.applyTo(opts);
      return new Engine(HpshardNative.hps_engine_create(sharding.handle(),
          dp == null ? null : dp.handle(), opts), sharding, dp);
    } finally {
      opts.delete();
    }
  }

  /**
   * The struct_size hps_engine_options_init records for {@code structSize} bytes; sizes below
   * the first version of the struct throw INVALID_ARGUMENT.
   */
  public static long optionsStructSize(long structSize) {
    hps_engine_options_t o = HpshardNative.hps_engine_options_init(structSize);
    try {
      return o.getStruct_size();
    } finally {
      o.delete();
    }
  }

  /** The library's default learning rate (hps_engine_options_init). */
  public static float defaultLearningRate() {
    hps_engine_options_t o = HpshardNative.hps_engine_options_init(
        HpshardNativeConstants.HPS_SWIG_ENGINE_OPTIONS_STRUCT_SIZE);
    try {
      return o.getLearning_rate();
    } finally {
      o.delete();
    }
  }

  public boolean isClosed() {
    synchronized (state) {
      return state.handle == null;
    }
  }

  SWIGTYPE_p_hps_engine handle() {
    synchronized (state) {
      if (state.handle == null) throw new IllegalStateException("hpshard engine is closed");
      return state.handle;
    }
  }

  /** A trainable FLOAT32 parameter of {@code unit} 0. */
  public int addParam(String name, long[] shape) {
    return addParam(name, shape, DType.FLOAT32, false, false, true, false, 0);
  }

  /**
   * Registers a parameter before {@link #seal()}; its index (registration order). Every rank
   * registers the same parameters in the same order. INVALID_ARGUMENT, ALREADY_EXISTS
   * (name), FAILED_PRECONDITION (sealed), UNIMPLEMENTED (a dtype other than FLOAT32).
   */
  public int addParam(String name, long[] shape, DType dtype, boolean frozen,
      boolean distributed, boolean clip, boolean sharedNotFirst, int unit) {
    return addParam(name, shape, dtype, (frozen ? FROZEN : 0) | (distributed ? DISTRIBUTED : 0)
        | (clip ? 0 : NO_CLIP) | (sharedNotFirst ? SHARED_NOT_FIRST : 0), unit);
  }

  /** As above with raw hps_param_flag_t bits. */
  public int addParam(String name, long[] shape, DType dtype, long flags, int unit) {
    Objects.requireNonNull(name, "name");
    Objects.requireNonNull(shape, "shape");
    Objects.requireNonNull(dtype, "dtype");
    long[] copy = shape.clone();
    synchronized (state) {
      int index = (int) HpshardNative.hps_engine_add_param(handle(), name, copy, dtype.code(),
          flags, unit);
      while (shapes.size() <= index) {
        shapes.add(new long[0]);
        names.add("");
        elementBytes.add(4);
      }
      shapes.set(index, copy);
      names.set(index, name);
      elementBytes.set(index, (int) Hpshard.dtypeSize(dtype));
      return index;
    }
  }

  /** The number of registered parameters. */
  public int numParams() {
    synchronized (state) {
      return shapes.size();
    }
  }

  /** The shape a parameter was registered with. */
  public long[] shape(int index) {
    return shapeOf(index).clone();
  }

  /** The name a parameter was registered with. */
  public String name(int index) {
    synchronized (state) {
      shapeOf(index);
      return names.get(index);
    }
  }

  private long[] shapeOf(int index) {
    synchronized (state) {
      if (index < 0 || index >= shapes.size()) {
        throw new IndexOutOfBoundsException("no parameter " + index + " (the engine has "
            + shapes.size() + ")");
      }
      return shapes.get(index);
    }
  }

  /** Elements of a parameter. */
  public long numel(int index) {
    long n = 1;
    for (long d : shapeOf(index)) n *= d;
    return n;
  }

  /**
   * Lays the parameters out and allocates the (zero-filled) buffers. Collective over the
   * sharding and dp groups: ranks that registered different parameters get INVALID_ARGUMENT.
   */
  public void seal() {
    HpshardNative.hps_engine_seal(handle());
  }

  /** Collective: every rank's parameters become its groups' source rank's (set-up only). */
  public void broadcastParameters() {
    HpshardNative.hps_engine_broadcast_parameters(handle());
  }

  /**
   * The device of the sharding communicator (hps_engine_device), where the parameters,
   * gradients and loss scale live. Only on the CPU are {@link #param}, {@link #grad},
   * {@link #lossScale()} and {@link #skippedSteps()} available.
   */
  public Device device() {
    return device;
  }

  /** For the package's tests: the guard's decision without a GPU. */
  void setDeviceForTest(Device device) {
    this.device = Objects.requireNonNull(device, "device");
  }

  /**
   * Refuses a host view of memory on {@code device} unless it is the CPU: a ByteBuffer over a
   * CUDA device pointer would read device memory on the host.
   */
  static void requireHostMemory(Device device, String what, String raw) {
    requireHostMemory(device, what, raw, "the engine's");
  }

  /** The same for memory that {@code owner} (e.g. "the clip's") keeps. */
  static void requireHostMemory(Device device, String what, String raw, String owner) {
    if (!device.isHost()) {
      throw new HpsException(hps_status_t.HPS_STATUS_FAILED_PRECONDITION, what
          + ": " + owner + " memory is on " + device + ", not the host; it has no host view "
          + "there. Use " + raw + " (a device address) with that device's tools");
    }
  }

  private ByteBuffer view(long address, int index) {
    long element;
    synchronized (state) {
      element = elementBytes.get(index);
    }
    long bytes = numel(index) * element;  // float32: 4; float16 / bfloat16 bit patterns: 2
    if (bytes > Integer.MAX_VALUE) {
      throw new UnsupportedOperationException("parameter " + index + " exceeds 2 GiB");
    }
    return HpshardNative.hps_swig_direct_buffer(address, bytes).order(ByteOrder.nativeOrder());
  }

  /**
   * The parameter's float32 elements: a direct ByteBuffer (native order) OVER the engine's
   * memory, invalid once the engine is closed.
   */
  public ByteBuffer param(int index) {
    requireHostMemory(device, "Engine.param", "Engine.paramAddress");
    return view(HpshardNative.hps_engine_param(handle(), index), index);
  }

  /**
   * The gradient's float32 elements (zero at every step's start; backward adds into it): a
   * direct ByteBuffer (native order) OVER the engine's memory, invalid once the engine is
   * closed. FAILED_PRECONDITION (frozen, not sealed).
   */
  public ByteBuffer grad(int index) {
    requireHostMemory(device, "Engine.grad", "Engine.gradAddress");
    return view(HpshardNative.hps_engine_grad(handle(), index), index);
  }

  /**
   * The address of parameter {@code index}'s view (hps_engine_param), on the engine's
   * {@link #device()} (a CUDA device pointer on a CUDA engine), for that device's own tools.
   * Valid as the view is.
   */
  public long paramAddress(int index) {
    return HpshardNative.hps_engine_param(handle(), index);
  }

  /**
   * The address of parameter {@code index}'s gradient view (hps_engine_grad), on the engine's
   * {@link #device()}; see {@link #paramAddress}.
   */
  public long gradAddress(int index) {
    return HpshardNative.hps_engine_grad(handle(), index);
  }

  /**
   * Before the forward of {@code unit}: waits for the last step's all-gather of its
   * parameters (a dependency wait, not a host sync). NOT_FOUND (no such unit).
   */
  public void waitParameters(int unit) {
    HpshardNative.hps_engine_wait_parameters(handle(), unit);
  }

  /**
   * After the forward or the backward of {@code unit}: stage 3 frees its full parameters;
   * stage 2 does nothing. NOT_FOUND, FAILED_PRECONDITION.
   */
  public void releaseParameters(int unit) {
    HpshardNative.hps_engine_release_parameters(handle(), unit);
  }

  /** Parameter {@code index}'s gradient, written by this thread, is complete. */
  public void gradReady(int index) {
    gradReady(index, null);
  }

  /**
   * Parameter {@code index}'s gradient is complete for this micro-batch; {@code ready}: the
   * stream it was produced on (kept reachable until {@link #synchronize()}), or null.
   * FAILED_PRECONDITION (checked in twice, frozen), OUT_OF_RANGE.
   */
  public void gradReady(int index, Stream ready) {
    synchronized (state) {
      HpshardNative.hps_engine_grad_ready(handle(), index, ready == null ? null : ready.handle());
      if (ready != null) state.keep.add(ready);
    }
  }

  /**
   * Enqueues the optimizer step and the all-gathers; returns at once (no host sync).
   * FAILED_PRECONDITION (a gradient has not checked in).
   */
  public void step() {
    HpshardNative.hps_engine_step(handle());
  }

  /** Blocks until everything in flight has finished (one host sync). */
  public void synchronize() {
    HpshardNative.hps_engine_synchronize(handle());
    synchronized (state) {
      state.keep.clear();
    }
  }

  /**
   * A new float[] holding the full value of parameter {@code index} (float16 / bfloat16
   * parameters give their float32 master weights), for saving or evaluation. Collective over
   * the sharding group: every rank calls it with the same index; it blocks (one host sync)
   * until the copy is done. OUT_OF_RANGE (no such parameter), FAILED_PRECONDITION (not
   * sealed; stage 3: before {@link #broadcastParameters()}).
   */
  public float[] gatherParameter(int index) {
    long count;
    synchronized (state) {
      // An unknown index gets an empty buffer: the library refuses it (OUT_OF_RANGE).
      count = index >= 0 && index < shapes.size() ? numel(index) : 0;
    }
    if (count * 4 > Integer.MAX_VALUE) {
      throw new UnsupportedOperationException("parameter " + index + " exceeds 2 GiB");
    }
    ByteBuffer out = ByteBuffer.allocateDirect((int) Math.max(4, count * 4))
        .order(ByteOrder.nativeOrder());
    HpshardNative.hps_engine_gather_parameter(handle(), index, out, count);
    float[] values = new float[(int) count];
    out.asFloatBuffer().get(values);
    return values;
  }

  /** Bytes this rank holds: parameters, gradients and optimizer state. */
  public long residentBytes() {
    return HpshardNative.hps_engine_resident_bytes(handle());
  }

  /** {begin, end}: the element offsets of parameter {@code index} this rank's shard holds. */
  public long[] shardRange(int index) {
    return HpshardNative.hps_engine_shard_range(handle(), index);
  }

  /**
   * The current loss scale (1 without dynamic loss scaling), read from the engine's memory:
   * multiply the loss by it before backward. Read it after the step's
   * {@link #waitParameters}, when the last update has landed.
   */
  public float lossScale() {
    requireHostMemory(device, "Engine.lossScale", "Engine.lossScaleAddresses");
    long address = HpshardNative.hps_engine_loss_scale(handle())[0];
    return HpshardNative.hps_swig_direct_buffer(address, 4).order(ByteOrder.nativeOrder())
        .getFloat(0);
  }

  /**
   * The number of steps skipped for non-finite gradients, under the same rule as
   * {@link #lossScale()}.
   */
  public long skippedSteps() {
    requireHostMemory(device, "Engine.skippedSteps", "Engine.lossScaleAddresses");
    long address = HpshardNative.hps_engine_loss_scale(handle())[1];
    return HpshardNative.hps_swig_direct_buffer(address, 8).order(ByteOrder.nativeOrder())
        .getLong(0);
  }

  /**
   * {scale, skippedSteps}: the addresses of the float32 loss scale and the int64 skipped-step
   * count (hps_engine_loss_scale), on the engine's {@link #device()}; valid until the engine
   * is closed, read under the rule of {@link #lossScale()}.
   */
  public long[] lossScaleAddresses() {
    return HpshardNative.hps_engine_loss_scale(handle());
  }

  /** {count, nanoseconds}: dependency waits so far (process-wide) and the time blocked. */
  public static long[] dependencyWaitStats() {
    return HpshardNative.hps_dependency_wait_stats();
  }

  /** Finishes what is in flight and destroys the engine; nothing when already closed. */
  @Override
  public void close() {
    cleanable.clean();
  }

  @Override
  public String toString() {
    return "Engine[" + numParams() + " parameters" + (isClosed() ? ", closed]" : "]");
  }
}
