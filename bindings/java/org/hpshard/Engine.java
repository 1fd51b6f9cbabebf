package org.hpshard;

import java.lang.ref.Reference;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.List;
import java.util.Objects;
import org.hpshard.internal.EngineHandle;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.hps_engine_options_t;
import org.hpshard.internal.hps_param_flag_t;

/**
 * ZeRO-style sharded data parallelism (hps_engine_t) for a framework that keeps its own
 * forward and backward: register the parameters, {@link #seal()}, write the parameters into
 * the {@link #param} views, add gradients into the {@link #grad} views, check each in with
 * {@link #gradReady}, then {@link #step()}.
 *
 * <p>{@link #paramTensor} and {@link #gradTensor} are DLPack views ({@link Tensor}) of the
 * engine's memory, on its {@link #device()}; {@link #param} and {@link #grad} return DIRECT
 * ByteBuffers in native byte order OVER that memory (the parameter's dtype; no copy). The
 * library refuses host views of device memory (CUDA): they, {@link #lossScale()} and
 * {@link #skippedSteps()} then throw HpsException FAILED_PRECONDITION, and
 * {@link #paramAddress}, {@link #gradAddress} and {@link #lossScaleAddresses()} give the
 * device addresses. A view keeps the engine's memory alive: a buffer taken before
 * {@link #close()} stays valid memory (no longer updated), and a {@link Tensor} of a closed
 * engine refuses to be used. With stage 3 a parameter view is valid only between
 * {@link #waitParameters} and {@link #releaseParameters} of its unit: a buffer kept past the
 * release is memory the engine reuses for the next unit it gathers, so a write through it
 * changes that unit's parameters (HPS_DEBUG_VIEWS=1 makes it fault instead). The engine keeps its communicators reachable, and
 * closing one of them closes the engine first. {@link #close()} finishes what is in flight
 * and destroys it exactly once; it throws the HpsException that work ended with (with uneven
 * data, the collectives of a last step whose peers had left), unless a call on the engine that
 * runs or waits for its work has thrown already, and so does the communicator's close() that
 * closes the engine (after closing everything). One thread at a time per engine; a close,
 * the engine's or its communicator's, may come from another thread: it waits for the call
 * under way to return, and the training thread's next call throws IllegalStateException.
 */
public final class Engine extends Handle<EngineHandle> {
  /** hps_param_flag_t bits, for {@link #addParam(String, long[], DType, long, int)}. */
  public static final int FROZEN = hps_param_flag_t.HPS_PARAM_FROZEN;
  public static final int DISTRIBUTED = hps_param_flag_t.HPS_PARAM_DISTRIBUTED;
  public static final int NO_CLIP = hps_param_flag_t.HPS_PARAM_NO_CLIP;
  public static final int SHARED_NOT_FIRST = hps_param_flag_t.HPS_PARAM_SHARED_NOT_FIRST;
  /** The optimizer's weight decay skips the parameter (biases, norms). */
  public static final int NO_WEIGHT_DECAY = hps_param_flag_t.HPS_PARAM_NO_WEIGHT_DECAY;

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
    private Stream computeStream;
    private Long bucketBytes;

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
      this.alignmentBytes = Hpshard.unsignedBytes("alignmentBytes", alignmentBytes);
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

    /**
     * The framework's compute stream, on the engine's device (default none: the legacy
     * default stream on CUDA); the engine keeps it alive. A CPU engine's framework computes
     * on the calling thread, whose calls order the engine's work: a CPU stream is checked
     * and kept, not used.
     */
    public Options computeStream(Stream computeStream) {
      this.computeStream = computeStream;
      return this;
    }

    /**
     * > 0: a flat buffer (bucket) of a unit's parameters of one dtype holds at most this many
     * bytes, so one unit is reduced in several collectives overlapping its backward
     * ({@link Engine#paramBucket}); 0 (default): one bucket per unit and dtype.
     */
    public Options bucketBytes(long bucketBytes) {
      this.bucketBytes = Hpshard.unsignedBytes("bucketBytes", bucketBytes);
      return this;
    }

    /** The stage (null: the library's default). */
    public Integer stage() {
      return stage;
    }

    /** The optimizer (null: the library's default). */
    public Optimizer optimizer() {
      return optimizer;
    }

    /** The learning rate (null: the library's default). */
    public Float learningRate() {
      return learningRate;
    }

    /** The weight decay (null: the library's default). */
    public Float weightDecay() {
      return weightDecay;
    }

    /** The bucket cap (null: the library's default). */
    public Long bucketBytes() {
      return bucketBytes;
    }

    /** SGD's momentum (null: the library's default). */
    public Float momentum() {
      return momentum;
    }

    /** Nesterov momentum (null: the library's default). */
    public Boolean nesterov() {
      return nesterov;
    }

    /** AdamW's beta1 (null: the library's default). */
    public Float beta1() {
      return beta1;
    }

    /** AdamW's beta2 (null: the library's default). */
    public Float beta2() {
      return beta2;
    }

    /** AdamW's epsilon (null: the library's default). */
    public Float eps() {
      return eps;
    }

    /** The clip's max norm (null: the library's default). */
    public Double clipMaxNorm() {
      return clipMaxNorm;
    }

    /** Deterministic clipping (null: the library's default). */
    public Boolean deterministicClip() {
      return deterministicClip;
    }

    /** The micro-batches per step (null: the library's default). */
    public Integer accumulationSteps() {
      return accumulationSteps;
    }

    /** The shard alignment (null: the library's default). */
    public Long alignmentBytes() {
      return alignmentBytes;
    }

    /** The stage-3 prefetch window (null: the library's default). */
    public Integer prefetchWindow() {
      return prefetchWindow;
    }

    /** Dynamic loss scaling (null: the library's default). */
    public Boolean dynamicLossScaling() {
      return dynamicLossScaling;
    }

    /** The initial loss scale (null: the library's default). */
    public Float initialLossScale() {
      return initialLossScale;
    }

    /** The loss scale's growth factor (null: the library's default). */
    public Float growthFactor() {
      return growthFactor;
    }

    /** The loss scale's backoff factor (null: the library's default). */
    public Float backoffFactor() {
      return backoffFactor;
    }

    /** The good steps before growth (null: the library's default). */
    public Integer growthInterval() {
      return growthInterval;
    }

    /** Every field of a native options struct (compute_stream aside). */
    static Options fromNative(hps_engine_options_t o) {
      Options r = new Options();
      r.stage = o.getStage();
      r.optimizer = Optimizer.fromCode(o.getOptimizer());
      r.learningRate = o.getLearning_rate();
      r.momentum = o.getMomentum();
      r.weightDecay = o.getWeight_decay();
      r.nesterov = o.getNesterov() != 0;
      r.beta1 = o.getBeta1();
      r.beta2 = o.getBeta2();
      r.eps = o.getEpsilon();
      r.clipMaxNorm = o.getClip_max_norm();
      r.deterministicClip = o.getDeterministic_clip() != 0;
      r.accumulationSteps = o.getAccumulation_steps();
      r.alignmentBytes = o.getAlignment_bytes();
      r.prefetchWindow = o.getPrefetch_window();
      r.dynamicLossScaling = o.getDynamic_loss_scaling() != 0;
      r.initialLossScale = o.getInitial_loss_scale();
      r.growthFactor = o.getGrowth_factor();
      r.backoffFactor = o.getBackoff_factor();
      r.growthInterval = o.getGrowth_interval();
      r.bucketBytes = o.getBucket_bytes();
      return r;
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
      if (computeStream != null) o.setComputeStream(computeStream.h());
      if (bucketBytes != null) o.setBucket_bytes(bucketBytes);
    }
  }

  private final List<long[]> shapes = new ArrayList<>();
  private final List<String> names = new ArrayList<>();
  private final Device device; // fixed at creation

  /**
   * Closing finishes the work in flight first (hps_engine_synchronize) and keeps its failure
   * (the collectives of a last step whose peers had left: its update is missing) for
   * {@link Handle#close()} to throw, unless a call on the engine that runs or waits for its
   * work (step, synchronize, ...; any thread) has thrown already
   * (hps_engine_failures_returned): then the program has been told. A program ending without a close
   * leaves the engine to the JVM's exit, which destroys nothing.
   */
  static final class EngineState extends State<EngineHandle> {
    EngineState(EngineHandle handle) {
      super(handle, EngineHandle::delete);
    }

    @Override
    void beforeDestroy(EngineHandle p) {
      if (p.failuresReturned() != 0) return;
      try {
        p.synchronize();
      } catch (HpsException e) {
        fail(e);
      }
    }
  }

  private Engine(EngineHandle handle, Communicator sharding, Communicator dp) {
    super(new EngineState(handle), "engine");
    this.device = Device.fromNative(handle.device());
    dependOn(sharding);
    dependOn(dp);
  }

  /** An engine over {@code sharding} with the library's default options. */
  public static Engine create(Communicator sharding) {
    return create(sharding, null, null);
  }

  /**
   * An engine sharding over {@code sharding} (required) with an optional {@code dp} group
   * above it; {@code options} may be null. INVALID_ARGUMENT, UNIMPLEMENTED (CUDA communicators
   * in a build without CUDA).
   */
  public static Engine create(Communicator sharding, Communicator dp, Options options) {
    try {
      Objects.requireNonNull(sharding, "sharding");
      hps_engine_options_t opts =
          HpshardNative.engineOptionsInit(HpshardNative.engineOptionsStructSize());
      try {
        if (options != null) options.applyTo(opts);
        return new Engine(EngineHandle.create(sharding.h(), dp == null ? null : dp.h(), opts),
            sharding, dp);
      } finally {
        opts.delete();
      }
    } finally {
      Reference.reachabilityFence(sharding);
      Reference.reachabilityFence(dp);
      Reference.reachabilityFence(options); // its compute stream
    }
  }

  /**
   * The struct_size hps_engine_options_init records for {@code structSize} bytes; sizes below
   * the first version of the struct, or ending inside one of its fields, throw
   * INVALID_ARGUMENT.
   */
  public static long optionsStructSize(long structSize) {
    hps_engine_options_t o = HpshardNative.engineOptionsInit(structSize);
    try {
      return o.getStruct_size();
    } finally {
      o.delete();
    }
  }

  /** The library's default learning rate (hps_engine_options_init). */
  public static float defaultLearningRate() {
    hps_engine_options_t o =
        HpshardNative.engineOptionsInit(HpshardNative.engineOptionsStructSize());
    try {
      return o.getLearning_rate();
    } finally {
      o.delete();
    }
  }

  /** A trainable FLOAT32 parameter of {@code unit} 0. */
  public int addParam(String name, long[] shape) {
    return addParam(name, shape, DType.FLOAT32, false, false, true, false, 0);
  }

  /**
   * Registers a parameter before {@link #seal()}; its index (registration order). Every rank
   * registers the same parameters in the same order. INVALID_ARGUMENT, ALREADY_EXISTS
   * (name), FAILED_PRECONDITION (sealed), UNIMPLEMENTED (a dtype other than FLOAT32, FLOAT16
   * or BFLOAT16).
   */
  public int addParam(String name, long[] shape, DType dtype, boolean frozen,
      boolean distributed, boolean clip, boolean sharedNotFirst, int unit) {
    return addParam(name, shape, dtype, (frozen ? FROZEN : 0) | (distributed ? DISTRIBUTED : 0)
        | (clip ? 0 : NO_CLIP) | (sharedNotFirst ? SHARED_NOT_FIRST : 0), unit);
  }

  /** As above with raw hps_param_flag_t bits. */
  public int addParam(String name, long[] shape, DType dtype, long flags, int unit) {
    final EngineHandle nh = enter();
    try {
      Objects.requireNonNull(name, "name");
      Objects.requireNonNull(shape, "shape");
      Objects.requireNonNull(dtype, "dtype");
      if (flags < 0 || flags > 0xFFFFFFFFL) {
        throw new IllegalArgumentException(
            "Engine.addParam: flags " + flags + " are not 32-bit hps_param_flag_t bits");
      }
      long[] copy = shape.clone();
      synchronized (state) {
        int index = (int) nh.addParam(name, copy, dtype.code(), flags, unit);
        while (shapes.size() <= index) {
          shapes.add(new long[0]);
          names.add("");
        }
        shapes.set(index, copy);
        names.set(index, name);
        return index;
      }
    } finally {
      leave();
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
   * In a hybrid topology with tensor ({@code mp}) or pipeline ({@code pp}) parallelism,
   * before {@link #seal()}: this rank's mp and pp groups (either may be null). The clip norm
   * then sums DISTRIBUTED gradients over mp and every counted gradient over pp, and a
   * non-finite gradient on any rank of the sharding, dp, mp or pp groups skips the step on
   * all of them; without it both span the sharding and dp groups only. Every rank calls it
   * alike; {@link #seal()} is then collective over these groups too and checks that each
   * group's members share every other coordinate. INVALID_ARGUMENT (another device, the
   * engine's sharding or dp communicator, mp and pp the same, a hybrid group's communicator
   * of another axis), FAILED_PRECONDITION (sealed).
   */
  public void setModelParallelGroups(Communicator mp, Communicator pp) {
    final EngineHandle nh = enter();
    try {
      nh.setModelParallelGroups(mp == null ? null : mp.h(), pp == null ? null : pp.h());
      dependOn(mp);
      dependOn(pp);
    } finally {
      leave();
      Reference.reachabilityFence(mp);
      Reference.reachabilityFence(pp);
    }
  }

  /**
   * Lays the parameters out and allocates the (zero-filled) buffers. Collective over the
   * sharding and dp groups (and those of {@link #setModelParallelGroups}): ranks that
   * registered different parameters get INVALID_ARGUMENT. From here on the engine's
   * communicators fail together: an operation that fails on one ends the others
   * (hps_engine_seal).
   */
  public void seal() {
    final EngineHandle nh = enter();
    try {
      nh.seal();
    } finally {
      leave();
    }
  }

  /** Collective: every rank's parameters become its groups' source rank's (set-up only). */
  public void broadcastParameters() {
    final EngineHandle nh = enter();
    try {
      nh.broadcastParameters();
    } finally {
      leave();
    }
  }

  /**
   * The device of the sharding communicator (hps_engine_device), where the parameters,
   * gradients and loss scale live. Only on the CPU are {@link #param}, {@link #grad},
   * {@link #lossScale()} and {@link #skippedSteps()} available.
   */
  public Device device() {
    return device;
  }

  /**
   * Parameter {@code index} as a DLPack view (hps_engine_param_dlpack; the parameter's dtype
   * and shape, on {@link #device()}). Stage 3: only while its unit is gathered.
   */
  public Tensor paramTensor(int index) {
    final EngineHandle nh = enter();
    try {
      return new Tensor(nh.paramDlpack(index), this, "Engine.param(" + index + ")");
    } finally {
      leave();
    }
  }

  /** Parameter {@code index}'s gradient as a DLPack view (hps_engine_grad_dlpack). */
  public Tensor gradTensor(int index) {
    final EngineHandle nh = enter();
    try {
      return new Tensor(nh.gradDlpack(index), this, "Engine.grad(" + index + ")");
    } finally {
      leave();
    }
  }

  /**
   * The parameter's elements: a direct ByteBuffer (native order) OVER the engine's memory;
   * it keeps that memory alive. FAILED_PRECONDITION off the host (see {@link #paramAddress}).
   */
  public ByteBuffer param(int index) {
    return paramTensor(index).byteBuffer();
  }

  /**
   * The gradient's elements (zero at every step's start; backward adds into it): a direct
   * ByteBuffer (native order) OVER the engine's memory; it keeps that memory alive.
   * FAILED_PRECONDITION (frozen, not sealed, off the host).
   */
  public ByteBuffer grad(int index) {
    return gradTensor(index).byteBuffer();
  }

  /**
   * The address of parameter {@code index}'s view (hps_engine_param), on the engine's
   * {@link #device()} (a CUDA device pointer on a CUDA engine), for that device's own tools.
   * Valid as the view is.
   */
  public long paramAddress(int index) {
    final EngineHandle nh = enter();
    try {
      return nh.param(index);
    } finally {
      leave();
    }
  }

  /**
   * The address of parameter {@code index}'s gradient view (hps_engine_grad), on the engine's
   * {@link #device()}; see {@link #paramAddress}.
   */
  public long gradAddress(int index) {
    final EngineHandle nh = enter();
    try {
      return nh.grad(index);
    } finally {
      leave();
    }
  }

  /**
   * Before the forward of {@code unit}: waits for the last step's all-gather of its
   * parameters (a dependency wait, not a host sync). NOT_FOUND (no such unit).
   */
  public void waitParameters(int unit) {
    final EngineHandle nh = enter();
    try {
      nh.waitParameters(unit);
    } finally {
      leave();
    }
  }

  /**
   * After the forward or the backward of {@code unit}: stage 3 frees its full parameters;
   * stage 2 moves nothing. At both stages the unit is then out of use: a checkpoint's load is
   * refused while a unit is between its wait and its release (stage 2: or the step). NOT_FOUND, FAILED_PRECONDITION
   * (stage 3: gradients taken in this backward that have not all checked in).
   */
  public void releaseParameters(int unit) {
    final EngineHandle nh = enter();
    try {
      nh.releaseParameters(unit);
    } finally {
      leave();
    }
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
    final EngineHandle nh = enter();
    try {
      synchronized (state) {
        nh.gradReady(index, ready == null ? null : ready.h());
        keep(ready);
      }
    } finally {
      leave();
      Reference.reachabilityFence(ready);
    }
  }

  /**
   * Enqueues the optimizer step and the all-gathers; returns at once (no host sync).
   * FAILED_PRECONDITION (a gradient has not checked in).
   */
  public void step() {
    final EngineHandle nh = enter();
    try {
      nh.step();
    } finally {
      leave();
    }
  }

  /**
   * The learning rate of the steps enqueued from now on (a schedule sets it before each
   * step, the same on every rank); no host sync. INVALID_ARGUMENT when negative or not
   * finite.
   */
  public void setLearningRate(float learningRate) {
    final EngineHandle nh = enter();
    try {
      nh.setLearningRate(learningRate);
    } finally {
      leave();
    }
  }

  /**
   * Blocks until everything in flight has finished (each wait it makes counts as a host sync:
   * one per stream or collective it waits for).
   */
  public void synchronize() {
    final EngineHandle nh = enter();
    try {
      nh.synchronize();
      releaseKept();
    } finally {
      leave();
    }
  }

  /**
   * A new float[] holding the full value of parameter {@code index} (float16 / bfloat16
   * parameters give their float32 master weights), for saving or evaluation. Collective over
   * the sharding group: every rank calls it with the same index; it blocks until the copy is
   * done (first finishing everything in flight, as {@link #synchronize()}: each wait counts as
   * a host sync). OUT_OF_RANGE (no such parameter), FAILED_PRECONDITION (not
   * sealed; stage 3: before {@link #broadcastParameters()}).
   */
  public float[] gatherParameter(int index) {
    final EngineHandle nh = enter();
    try {
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
      nh.gatherParameter(index, out, count);
      float[] values = new float[(int) count];
      out.asFloatBuffer().get(values);
      return values;
    } finally {
      leave();
    }
  }

  /**
   * Bytes this rank holds: parameters, gradients and optimizer state, and at stage 3 the full
   * buffers of gathered units and those kept pooled for the next gather.
   */
  public long residentBytes() {
    final EngineHandle nh = enter();
    try {
      return nh.residentBytes();
    } finally {
      leave();
    }
  }

  /** {begin, end}: the element offsets of parameter {@code index} this rank's shard holds. */
  public long[] shardRange(int index) {
    final EngineHandle nh = enter();
    try {
      return nh.shardRange(index);
    } finally {
      leave();
    }
  }

  /**
   * The flat buffer (bucket) holding parameter {@code index}, numbered from 0 across the
   * engine, the same on every rank: a bucket's gradients are reduced by one collective, started
   * when all of its parameters have checked in ({@link Options#bucketBytes}).
   * FAILED_PRECONDITION (not sealed), OUT_OF_RANGE.
   */
  public long paramBucket(int index) {
    final EngineHandle nh = enter();
    try {
      return nh.paramBucket(index);
    } finally {
      leave();
    }
  }

  /**
   * The current loss scale (1 without dynamic loss scaling), read from the engine's memory:
   * multiply the loss by it before backward. Read it after the step's
   * {@link #waitParameters}, when the last update has landed.
   */
  public float lossScale() {
    try (Tensor t = lossScaleTensor()) {
      return t.byteBuffer().getFloat(0);
    }
  }

  /**
   * The number of steps skipped for non-finite gradients, under the same rule as
   * {@link #lossScale()}.
   */
  public long skippedSteps() {
    try (Tensor t = skippedStepsTensor()) {
      return t.byteBuffer().getLong(0);
    }
  }

  /**
   * With clipping: the global norm of the last step's unscaled mean gradients, the one the
   * clip used (hps_engine_grad_norm; 0 before the first step; Inf or NaN for a step with a
   * non-finite gradient that counts), read under the rule of {@link #lossScale()}. Throws
   * FAILED_PRECONDITION without clipping (the engine computes the norm only to clip).
   */
  public float gradNorm() {
    try (Tensor t = gradNormTensor()) {
      return t.byteBuffer().getFloat(0);
    }
  }

  /** The gradient norm as a DLPack view (float32, shape {1}; hps_engine_grad_norm_dlpack). */
  public Tensor gradNormTensor() {
    final EngineHandle nh = enter();
    try {
      return new Tensor(nh.gradNormDlpack(), this, "Engine.gradNorm");
    } finally {
      leave();
    }
  }

  /**
   * The address of the float32 gradient norm (hps_engine_grad_norm) on the engine's
   * {@link #device()}; valid until the engine is closed, read under the rule of
   * {@link #lossScale()}.
   */
  public long gradNormAddress() {
    final EngineHandle nh = enter();
    try {
      return nh.gradNorm();
    } finally {
      leave();
    }
  }

  /** The loss scale as a DLPack view (float32, shape {1}; hps_engine_loss_scale_dlpack). */
  public Tensor lossScaleTensor() {
    final EngineHandle nh = enter();
    try {
      return new Tensor(nh.lossScaleDlpack(), this, "Engine.lossScale");
    } finally {
      leave();
    }
  }

  /** The skipped-step count as a DLPack view (int64, shape {1}). */
  public Tensor skippedStepsTensor() {
    final EngineHandle nh = enter();
    try {
      return new Tensor(nh.skippedStepsDlpack(), this, "Engine.skippedSteps");
    } finally {
      leave();
    }
  }

  /**
   * {scale, skippedSteps}: the addresses of the float32 loss scale and the int64 skipped-step
   * count (hps_engine_loss_scale), on the engine's {@link #device()}; valid until the engine
   * is closed, read under the rule of {@link #lossScale()}.
   */
  public long[] lossScaleAddresses() {
    final EngineHandle nh = enter();
    try {
      return nh.lossScale();
    } finally {
      leave();
    }
  }

  /** {count, nanoseconds}: dependency waits so far (process-wide) and the time blocked. */
  public static long[] dependencyWaitStats() {
    return HpshardNative.dependencyWaitStats();
  }

  @Override
  public String toString() {
    return "Engine[" + numParams() + " parameters" + (isClosed() ? ", closed]" : "]");
  }
}
