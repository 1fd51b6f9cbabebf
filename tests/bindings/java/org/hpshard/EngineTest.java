package org.hpshard;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.ByteArrayOutputStream;
import java.io.PrintStream;
import java.lang.ref.WeakReference;
import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.List;
import java.util.UUID;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import org.hpshard.internal.ClipHandle;
import org.hpshard.internal.EngineHandle;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.hps_engine_options_t;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.function.Executable;

/** Hybrid clipping (Clip) and the sharded training engine (Engine); ranks are threads. */
class EngineTest {
  static final int INVALID_ARGUMENT = 1;
  static final int OUT_OF_RANGE = 2;
  static final int NOT_FOUND = 3;
  static final int ALREADY_EXISTS = 4;
  static final int FAILED_PRECONDITION = 5;
  static final int UNIMPLEMENTED = 6;

  static int status(Executable call) {
    return assertThrows(HpsException.class, call).status();
  }

  static Communicator comm(Store store, int rank, int size) {
    return Communicator.create(store, rank, size, new Communicator.Options().timeoutMs(20000));
  }

  // ---- clip ------------------------------------------------------------------------------
  @Test
  void clipOptionsAndNullHandles() {
    assertEquals(1.0, Clip.defaultMaxNorm());
    assertEquals(HpshardNative.clipOptionsStructSize(),
        Clip.optionsStructSize(HpshardNative.clipOptionsStructSize()));
    assertEquals(INVALID_ARGUMENT, status(() -> Clip.optionsStructSize(3)));
    // A clip without communicators is fine; bad options are refused by the library.
    ClipHandle h = ClipHandle.create(null, null, null, null);
    h.delete();
    assertEquals(INVALID_ARGUMENT, status(() -> new Clip(0.0)));
    assertEquals(1, Clip.DISTRIBUTED);
    assertEquals(2, Clip.NO_CLIP);
    assertEquals(4, Clip.SHARED_NOT_FIRST);
  }

  @Test
  void clipSingleRank() {
    ByteBuffer grads = CommTest.floats(3f, 4f);
    ByteBuffer frozen = CommTest.floats(100f, 100f);
    ByteBuffer norm = CommTest.floats(-1f);
    Clip kept;
    try (Clip clip = new Clip(1.0); Stream stream = new Stream()) {
      kept = clip;
      assertEquals(1.0, clip.maxNorm());
      clip.addTensor(grads, DType.FLOAT32);
      clip.addTensor(frozen, DType.FLOAT32, false, false, false);
      clip.addTensor(CommTest.direct(8), DType.FLOAT64, false, true, true);
      assertEquals(FAILED_PRECONDITION, status(() -> clip.run(stream, norm, true)));
      clip.seal();
      assertEquals(FAILED_PRECONDITION, status(clip::seal));
      assertEquals(FAILED_PRECONDITION, status(() -> clip.addTensor(grads, DType.FLOAT32)));
      Hpshard.hostSyncReset();
      clip.run(stream, norm, true);
      assertEquals(0, Hpshard.hostSyncCountThread());
      stream.synchronize();
      assertEquals(5.0f, norm.getFloat(0), 1e-6f);
      float coef = (float) (1.0 / (5.0 + 1e-6));
      assertEquals(3f * coef, grads.getFloat(0), 1e-6f);
      assertEquals(4f * coef, grads.getFloat(4), 1e-6f);
      assertEquals(100f, frozen.getFloat(0));
      assertEquals(100f, frozen.getFloat(4));
      ByteBuffer c = clip.coefficient();
      assertTrue(c.isDirect() && c.isReadOnly());
      assertEquals(coef, c.getFloat(0), 1e-6f);
      assertNotEquals(0, clip.coefficientAddress());
      try (Tensor t = clip.coefficientTensor()) {
        assertEquals(DType.FLOAT32, t.dtype());
        assertArrayEquals(new long[] {1}, t.shape());
        assertEquals(new Device(DeviceType.CPU, 0), t.device());
        assertEquals(clip.coefficientAddress(), t.address());
      }
      clip.run(stream); // no norm out
      stream.synchronize();
    }
    assertTrue(kept.isClosed());
    kept.close(); // harmless
  }

  @Test
  void clipBadInput() {
    assertEquals(INVALID_ARGUMENT, status(() -> new Clip(0.0)));
    try (Clip clip = new Clip(1.0); Stream stream = new Stream()) {
      ByteBuffer ints = CommTest.direct(8);
      assertEquals(INVALID_ARGUMENT, status(() -> clip.addTensor(ints, DType.INT32)));
      assertEquals(INVALID_ARGUMENT,
          status(() -> clip.addTensor(CommTest.floats(1f, 2f), DType.FLOAT32, 64)));
      assertThrows(IllegalArgumentException.class,
          () -> clip.addTensor(ByteBuffer.allocate(8), DType.FLOAT32));
      assertThrows(IllegalArgumentException.class,
          () -> clip.addTensor(CommTest.direct(6), DType.FLOAT32));
      assertEquals(FAILED_PRECONDITION, status(() -> clip.run(stream))); // before seal
      assertThrows(IllegalArgumentException.class, () -> clip.run(stream, CommTest.direct(2), true));
      // Bits above 32 would be cut off on the way to the C uint32_t: refused, not dropped.
      assertThrows(IllegalArgumentException.class,
          () -> clip.addTensor(CommTest.floats(1f, 2f), DType.FLOAT32, 1L << 32));
      assertThrows(IllegalArgumentException.class,
          () -> clip.addTensor(CommTest.floats(1f, 2f), DType.FLOAT32, -1L));
      // The norm is written in native order: a buffer of the other order would read garbage.
      ByteBuffer other = ByteBuffer.allocateDirect(4).order(
          java.nio.ByteOrder.nativeOrder() == java.nio.ByteOrder.BIG_ENDIAN
              ? java.nio.ByteOrder.LITTLE_ENDIAN : java.nio.ByteOrder.BIG_ENDIAN);
      clip.addTensor(CommTest.floats(3f, 4f), DType.FLOAT32);
      clip.seal();
      assertThrows(IllegalArgumentException.class, () -> clip.run(stream, other, false));
    }
  }

  static float clipMpRank(int r, String url, boolean mismatched) {
    float[] w = {1f, 2f, 3f, 4f};
    ByteBuffer wPart = CommTest.floats(w[2 * r], w[2 * r + 1]);
    ByteBuffer b = CommTest.floats(5f, 6f);
    ByteBuffer norm = CommTest.floats(-1f);
    Clip clip;
    try (Store store = Store.open(url, r, 10000); Communicator mp = comm(store, r, 2);
        Stream stream = new Stream()) {
      clip = new Clip(null, mp, null, 100.0, true);
      clip.addTensor(wPart, DType.FLOAT32, !(mismatched && r == 1), true, false);
      clip.addTensor(b, DType.FLOAT32);
      if (mismatched) {
        HpsException e = assertThrows(HpsException.class, clip::seal);
        assertEquals(INVALID_ARGUMENT, e.status());
        assertTrue(e.getMessage().contains("mp"), e.getMessage());
        assertEquals(FAILED_PRECONDITION, status(() -> clip.run(stream, norm, true)));
      } else {
        clip.seal();
        clip.run(stream, norm, true);
        stream.synchronize();
      }
      assertFalse(clip.isClosed());
    }
    assertTrue(clip.isClosed()); // closing the communicator closed the clip first
    return norm.getFloat(0);
  }

  @Test
  void clipTwoRanksMpGroup() throws Exception {
    List<Float> norms = CommTest.runRanks(2, (r, url) -> clipMpRank(r, url, false));
    assertEquals((float) Math.sqrt(91.0), norms.get(0), 1e-5f);
    assertEquals(norms.get(0), norms.get(1));
    CommTest.runRanks(2, (r, url) -> clipMpRank(r, url, true));
  }

  // ---- engine ------------------------------------------------------------------------------
  /**
   * Two ranks as mp 2 (sharding 1): w is DISTRIBUTED (rank r holds w[2r], w[2r+1] of
   * [1, 2, 3, 4]), b replicated ([5, 6] on both). With the mp group given to the engine its
   * clip norm is sqrt(91) on both ranks, so after one SGD step at lr 1 every parameter is
   * -grad / sqrt(91); a rank's own norm would give another coefficient. Also the refusals.
   */
  static float[] engineMpRank(int r, String url) {
    try (Store store = Store.open(url, r, 10000);
        Communicator world = comm(store, r, 2);
        Topology topo = new Topology(1, 1, 1, 1, 2, 2)) {
      Communicator sharding;
      Communicator mp;
      try (HybridGroup hg = HybridGroup.create(world, topo)) {
        sharding = hg.comm(Group.SHARDING);
        mp = hg.comm(Group.MP);
      }
      try (sharding; mp;
          Engine engine = Engine.create(sharding, null,
              new Engine.Options().learningRate(1f).clipMaxNorm(1.0))) {
        assertEquals(INVALID_ARGUMENT, status(() -> engine.setModelParallelGroups(sharding, null)));
        assertEquals(INVALID_ARGUMENT, status(() -> engine.setModelParallelGroups(mp, mp)));
        engine.setModelParallelGroups(mp, null);
        int w = engine.addParam("w", new long[] {2}, DType.FLOAT32, false, true, true, false, 0);
        int b = engine.addParam("b", new long[] {2});
        engine.seal();
        assertEquals(FAILED_PRECONDITION, status(() -> engine.setModelParallelGroups(mp, null)));
        engine.broadcastParameters();
        engine.waitParameters(0);
        engine.grad(w).asFloatBuffer().put(new float[] {1f + 2 * r, 2f + 2 * r});
        engine.grad(b).asFloatBuffer().put(new float[] {5f, 6f});
        engine.gradReady(w);
        engine.gradReady(b);
        engine.releaseParameters(0);
        engine.step();
        float[] ws = engine.gatherParameter(w);
        float[] bs = engine.gatherParameter(b);
        return new float[] {ws[0], ws[1], bs[0], bs[1]};
      }
    }
  }

  @Test
  void engineClipSpansTheMpGroup() throws Exception {
    List<float[]> got = CommTest.runRanks(2, EngineTest::engineMpRank);
    double coef = 1.0 / (Math.sqrt(91.0) + 1e-6);
    for (int r = 0; r < 2; ++r) {
      float[] expect = {(float) (-(1 + 2 * r) * coef), (float) (-(2 + 2 * r) * coef),
          (float) (-5 * coef), (float) (-6 * coef)};
      assertArrayEquals(expect, got.get(r), 1e-6f);
    }
  }

  @Test
  void engineOptionsAndNullHandles() {
    hps_engine_options_t o =
        HpshardNative.engineOptionsInit(HpshardNative.engineOptionsStructSize());
    try {
      assertEquals(2, o.getStage());
      assertEquals(Optimizer.SGD, Optimizer.fromCode(o.getOptimizer()));
      assertEquals(1, o.getAccumulation_steps());
      assertTrue(o.getAlignment_bytes() > 0 && o.getPrefetch_window() >= 1);
    } finally {
      o.delete();
    }
    assertEquals(0.01f, Engine.defaultLearningRate(), 1e-7f);
    assertEquals(INVALID_ARGUMENT, status(() -> Engine.optionsStructSize(3)));
    // An older caller's struct size (0.1.0's, before compute_stream) is accepted.
    assertEquals(96, Engine.optionsStructSize(96));
    assertEquals(INVALID_ARGUMENT, status(() -> EngineHandle.create(null, null, null)));
    long[] waits = Engine.dependencyWaitStats();
    assertEquals(2, waits.length);
    assertTrue(waits[0] >= 0 && waits[1] >= 0);
    assertEquals(1, Optimizer.ADAMW.code());
    assertEquals(8, Engine.SHARED_NOT_FIRST);
    assertEquals(16, Engine.NO_WEIGHT_DECAY);
    // Unsigned byte counts: a negative one reached the library as 2^64 - 1 (bucketBytes(-1)
    // was taken as "no cap"); it is refused by name.
    for (Executable negative :
        new Executable[] {() -> new Engine.Options().bucketBytes(-1),
            () -> new Engine.Options().alignmentBytes(-256),
            () -> new Checkpoint.Options().chunkBytes(-1)}) {
      IllegalArgumentException e = assertThrows(IllegalArgumentException.class, negative);
      assertTrue(
          e.getMessage().matches("(bucket|alignment|chunk)Bytes is negative \\(-\\d+\\)"),
          e.getMessage());
    }
    assertEquals(0L, new Engine.Options().bucketBytes(0).bucketBytes());
  }

  @Test
  void noWeightDecayParametersAreNotDecayed() throws Exception {
    String url = "memory://java-wd-" + UUID.randomUUID();
    try (Store store = Store.open(url, 0, 10000); Communicator c = comm(store, 0, 1);
        Engine engine = Engine.create(c, null,
            new Engine.Options().learningRate(0.5f).weightDecay(0.5f))) {
      int w = engine.addParam("w", new long[] {2});
      int b = engine.addParam("b", new long[] {2}, DType.FLOAT32, Engine.NO_WEIGHT_DECAY, 0);
      // Bits above 32 (FROZEN | 1 << 32) are refused, not cut off to FROZEN.
      assertThrows(IllegalArgumentException.class, () -> engine.addParam("x", new long[] {2},
          DType.FLOAT32, (1L << 32) | Engine.FROZEN, 0));
      assertEquals(2, engine.numParams());
      engine.seal();
      for (int i : new int[] {w, b}) {
        ByteBuffer p = engine.param(i);
        for (int k = 0; k < 2; k++) p.putFloat(4 * k, 2f);
      }
      engine.broadcastParameters();
      engine.waitParameters(0);
      for (int i : new int[] {w, b}) {
        ByteBuffer g = engine.grad(i);
        for (int k = 0; k < 2; k++) g.putFloat(4 * k, 1f);
        engine.gradReady(i);
      }
      engine.releaseParameters(0);
      engine.step();
      // SGD: w - lr (g + wd w) = 2 - 0.5 (1 + 1) and b - lr g = 2 - 0.5, exactly.
      assertArrayEquals(new float[] {1f, 1f}, engine.gatherParameter(w));
      assertArrayEquals(new float[] {1.5f, 1.5f}, engine.gatherParameter(b));
    }
  }

  /** gradNorm: the clip's norm of the last step (0 before it), refused without clipping. */
  @Test
  void gradNormIsTheClipsNormAndNeedsClipping() throws Exception {
    String url = "memory://java-norm-" + UUID.randomUUID();
    try (Store store = Store.open(url, 0, 10000); Communicator c = comm(store, 0, 1)) {
      try (Engine plain = Engine.create(c)) {
        plain.addParam("w", new long[] {2});
        plain.seal();
        assertEquals(FAILED_PRECONDITION,
            assertThrows(HpsException.class, plain::gradNorm).status());
      }
      try (Engine engine =
               Engine.create(c, null, new Engine.Options().clipMaxNorm(1.0).learningRate(0.1f))) {
        int w = engine.addParam("w", new long[] {2});
        engine.seal();
        engine.broadcastParameters();
        assertEquals(0f, engine.gradNorm());
        assertTrue(engine.gradNormAddress() != 0);
        engine.waitParameters(0);
        ByteBuffer g = engine.grad(w);
        g.putFloat(0, 6f);
        g.putFloat(4, 8f);
        engine.gradReady(w);
        engine.releaseParameters(0);
        engine.step();
        engine.synchronize();
        assertEquals(10f, engine.gradNorm());
        try (Tensor t = engine.gradNormTensor()) {
          assertEquals(engine.gradNormAddress(), t.address());
        }
      }
    }
  }

  @Test
  void learningRateScheduleAppliesToTheNextSteps() throws Exception {
    String url = "memory://java-lr-" + UUID.randomUUID();
    try (Store store = Store.open(url, 0, 10000); Communicator c = comm(store, 0, 1);
        Engine engine = Engine.create(c)) {
      int w = engine.addParam("w", new long[] {3});
      assertEquals(INVALID_ARGUMENT, status(() -> engine.setLearningRate(-1f)));
      assertEquals(INVALID_ARGUMENT, status(() -> engine.setLearningRate(Float.NaN)));
      engine.seal();
      engine.broadcastParameters();
      for (float rate : new float[] {0.5f, 0.25f, 0f}) {
        engine.setLearningRate(rate);
        engine.waitParameters(0);
        ByteBuffer g = engine.grad(w);
        for (int i = 0; i < 3; i++) g.putFloat(4 * i, 1f);
        engine.gradReady(w);
        engine.releaseParameters(0);
        engine.step();
      }
      // SGD from zero with a gradient of 1: -(0.5 + 0.25 + 0), exactly.
      assertArrayEquals(new float[] {-0.75f, -0.75f, -0.75f}, engine.gatherParameter(w));
    }
  }

  @Test
  void engineSingleRankViewsAndErrors() throws Exception {
    String url = "memory://java-engine1-" + UUID.randomUUID();
    try (Store store = Store.open(url, 0, 10000); Communicator c = comm(store, 0, 1)) {
      assertEquals(INVALID_ARGUMENT,
          status(() -> Engine.create(c, null, new Engine.Options().stage(4))));
      Engine kept;
      try (Engine engine = Engine.create(c, null, new Engine.Options().learningRate(0.5f))) {
        kept = engine;
        int w = engine.addParam("w", new long[] {2, 3});
        int b = engine.addParam("b", new long[] {3}, DType.FLOAT32, false, false, true, false, 1);
        int f = engine.addParam("frozen", new long[] {2}, DType.FLOAT32, true, false, true, false, 1);
        assertEquals(0, w);
        assertEquals(2, f);
        assertEquals("b", engine.name(b));
        assertArrayEquals(new long[] {2, 3}, engine.shape(w));
        assertEquals(ALREADY_EXISTS, status(() -> engine.addParam("w", new long[] {1})));
        assertEquals(UNIMPLEMENTED, status(() -> engine.addParam("h", new long[] {2},
            DType.FLOAT64, false, false, true, false, 0)));
        assertEquals(FAILED_PRECONDITION, status(() -> engine.param(w)));
        assertEquals(FAILED_PRECONDITION, status(engine::step));
        engine.seal();
        ByteBuffer p = engine.param(w);
        assertTrue(p.isDirect());
        assertEquals(24, p.capacity());
        for (int i = 0; i < 6; i++) {
          assertEquals(0f, p.getFloat(4 * i));
          p.putFloat(4 * i, i);
        }
        assertEquals(5f, engine.param(w).getFloat(20)); // a view, not a copy
        assertEquals(FAILED_PRECONDITION, status(() -> engine.grad(f)));
        assertEquals(OUT_OF_RANGE, status(() -> engine.param(99)));
        // A negative index is named as given, not as the size_t it would wrap to.
        for (Executable call : new Executable[] {() -> engine.param(-1),
                 () -> engine.grad(-1), () -> engine.gradReady(-1), () -> engine.shardRange(-1),
                 () -> engine.gatherParameter(-1), () -> engine.paramBucket(-1)}) {
          IndexOutOfBoundsException e = assertThrows(IndexOutOfBoundsException.class, call);
          assertTrue(e.getMessage().contains("no parameter -1"), e.getMessage());
        }
        assertArrayEquals(new long[] {0, 6}, engine.shardRange(w));
        assertTrue(engine.residentBytes() > 0);
        assertEquals(NOT_FOUND, status(() -> engine.waitParameters(7)));
        assertEquals(NOT_FOUND, status(() -> engine.releaseParameters(7)));
        engine.waitParameters(0);
        engine.waitParameters(1);
        ByteBuffer gw = engine.grad(w);
        ByteBuffer gb = engine.grad(b);
        for (int i = 0; i < 6; i++) gw.putFloat(4 * i, gw.getFloat(4 * i) + 1f);
        for (int i = 0; i < 3; i++) gb.putFloat(4 * i, gb.getFloat(4 * i) + 2f);
        assertEquals(FAILED_PRECONDITION, status(() -> engine.gradReady(f)));
        assertEquals(OUT_OF_RANGE, status(() -> engine.gradReady(99)));
        try (Stream ready = new Stream()) {
          engine.gradReady(w, ready);
          engine.gradReady(b);
          engine.releaseParameters(1);
          engine.releaseParameters(0);
          engine.step();
          engine.synchronize();
        }
        engine.waitParameters(0);
        engine.waitParameters(1);
        for (int i = 0; i < 6; i++) assertEquals(i - 0.5f, engine.param(w).getFloat(4 * i), 1e-6f);
        assertEquals(-1f, engine.param(b).getFloat(0), 1e-6f);
      }
      assertTrue(kept.isClosed());
      kept.close(); // harmless
      Engine dependent = Engine.create(c);
      c.close();
      assertTrue(dependent.isClosed()); // closing the communicator closed the engine first
      assertThrows(IllegalStateException.class, dependent::seal);
    }
  }

  static final String[] NAMES = {"layer0.weight", "layer0.bias", "layer1.weight"};
  static final long[][] SHAPES = {{3, 4}, {4}, {4, 2}};
  static final int[] UNITS = {0, 0, 1};
  static final float LR = 0.1f;
  static final int STEPS = 3;

  static int numel(int k) {
    int n = 1;
    for (long d : SHAPES[k]) n *= (int) d;
    return n;
  }

  static float initial(int k, int i) {
    return (float) Math.sin(i * 0.7 + NAMES[k].length());
  }

  static float gradient(int k, int i, int step, int rank) {
    return (float) (Math.cos(i * 0.3 + step * 1.1 + rank * 0.5 + NAMES[k].length()) * (rank + 1));
  }

  @Test
  void engineTwoRanksSgdMatchesUnshardedReference() throws Exception {
    List<float[][]> results = CommTest.runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r, 10000); Communicator c = comm(store, r, 2);
          Engine engine = Engine.create(c, null, new Engine.Options().learningRate(LR))) {
        int[] index = new int[NAMES.length];
        for (int k = 0; k < NAMES.length; k++) {
          index[k] = engine.addParam(NAMES[k], SHAPES[k], DType.FLOAT32, false, false, true,
              false, UNITS[k]);
        }
        engine.seal();
        for (int k = 0; k < NAMES.length; k++) {
          ByteBuffer p = engine.param(index[k]);
          for (int i = 0; i < numel(k); i++) p.putFloat(4 * i, r == 0 ? initial(k, i) : 0f);
        }
        engine.broadcastParameters();
        for (int k = 0; k < NAMES.length; k++) {
          assertEquals(initial(k, 1), engine.param(index[k]).getFloat(4));
        }
        for (int step = 0; step < STEPS; step++) {
          Hpshard.hostSyncReset();
          engine.waitParameters(0);
          engine.waitParameters(1);
          for (int k = NAMES.length - 1; k >= 0; k--) { // backward order
            ByteBuffer g = engine.grad(index[k]);
            for (int i = 0; i < numel(k); i++) {
              assertEquals(0f, g.getFloat(4 * i)); // zero at every step's start
              g.putFloat(4 * i, g.getFloat(4 * i) + gradient(k, i, step, r));
            }
            engine.gradReady(index[k]);
          }
          engine.releaseParameters(1);
          engine.releaseParameters(0);
          engine.step();
          assertEquals(0, Hpshard.hostSyncCountThread(), "host syncs in step " + step);
        }
        engine.synchronize();
        engine.waitParameters(0);
        engine.waitParameters(1);
        float[][] out = new float[NAMES.length][];
        for (int k = 0; k < NAMES.length; k++) {
          ByteBuffer p = engine.param(index[k]);
          out[k] = new float[numel(k)];
          for (int i = 0; i < numel(k); i++) out[k][i] = p.getFloat(4 * i);
          long[] range = engine.shardRange(index[k]);
          assertTrue(0 <= range[0] && range[0] <= range[1] && range[1] <= numel(k));
        }
        return out;
      }
    });
    for (int k = 0; k < NAMES.length; k++) {
      for (int i = 0; i < numel(k); i++) {
        float ref = initial(k, i);
        for (int step = 0; step < STEPS; step++) {
          float mean = (gradient(k, i, step, 0) + gradient(k, i, step, 1)) / 2f;
          ref = ref - LR * mean;
        }
        for (int r = 0; r < 2; r++) {
          float got = results.get(r)[k][i];
          assertTrue(Math.abs(got - ref) <= 1e-6 * Math.abs(ref) + 1e-7,
              "rank " + r + " " + NAMES[k] + "[" + i + "]: " + got + " vs " + ref);
        }
      }
    }
  }

  static final int LS_STEPS = 5;
  static final int LS_N = 5;

  static float lsGradient(int i, int step, int rank) {
    return (float) (Math.cos(i * 0.4 + step * 0.9 + rank * 0.3) * (rank + 1));
  }

  static float lsInitial(int i) {
    return -1f + 0.5f * i;
  }

  static final class LossScaleResult {
    final float[] scales = new float[LS_STEPS];
    long skipped;
    final float[] params = new float[LS_N];
  }

  @Test
  void engineTwoRanksDynamicLossScaling() throws Exception {
    List<LossScaleResult> results = CommTest.runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r, 10000); Communicator c = comm(store, r, 2)) {
        assertEquals(INVALID_ARGUMENT, status(() -> Engine.create(c, null,
            new Engine.Options().dynamicLossScaling(true).backoffFactor(1.5f))));
        try (Engine engine = Engine.create(c, null, new Engine.Options().learningRate(LR)
            .dynamicLossScaling(true).initialLossScale(1024f).growthInterval(2))) {
          int w = engine.addParam("w", new long[] {LS_N});
          engine.seal();
          ByteBuffer p = engine.param(w);
          for (int i = 0; i < LS_N; i++) p.putFloat(4 * i, r == 0 ? lsInitial(i) : 0f);
          engine.broadcastParameters();
          LossScaleResult out = new LossScaleResult();
          for (int step = 0; step < LS_STEPS; step++) {
            engine.waitParameters(0);
            float scale = engine.lossScale();
            out.scales[step] = scale;
            ByteBuffer g = engine.grad(w);
            for (int i = 0; i < LS_N; i++) {
              g.putFloat(4 * i, g.getFloat(4 * i) + lsGradient(i, step, r) * scale);
            }
            if (step == 1 && r == 1) g.putFloat(0, Float.POSITIVE_INFINITY);
            engine.gradReady(w);
            engine.releaseParameters(0);
            engine.step();
          }
          engine.waitParameters(0);
          out.skipped = engine.skippedSteps();
          engine.synchronize();
          for (int i = 0; i < LS_N; i++) out.params[i] = engine.param(w).getFloat(4 * i);
          return out;
        }
      }
    });
    float[] ref = new float[LS_N];
    for (int i = 0; i < LS_N; i++) {
      ref[i] = lsInitial(i);
      for (int step = 0; step < LS_STEPS; step++) {
        if (step == 1) continue; // skipped on every rank
        float mean = (lsGradient(i, step, 0) + lsGradient(i, step, 1)) / 2f;
        ref[i] = ref[i] - LR * mean;
      }
    }
    for (int r = 0; r < 2; r++) {
      LossScaleResult res = results.get(r);
      assertArrayEquals(new float[] {1024f, 1024f, 512f, 512f, 1024f}, res.scales, "rank " + r);
      assertEquals(1, res.skipped, "rank " + r);
      for (int i = 0; i < LS_N; i++) {
        float got = res.params[i];
        assertTrue(Math.abs(got - ref[i]) <= 1e-6 * Math.abs(ref[i]) + 1e-7,
            "rank " + r + " w[" + i + "]: " + got + " vs " + ref[i]);
      }
    }
  }

  @Test
  void engineTwoRanksGatherParameter() throws Exception {
    float[] initial = new float[5];
    for (int i = 0; i < 5; i++) initial[i] = 0.5f + 1.25f * i;
    List<float[]> results = CommTest.runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r, 10000); Communicator c = comm(store, r, 2);
          Engine engine = Engine.create(c)) {
        int w = engine.addParam("w", new long[] {5});
        assertEquals(FAILED_PRECONDITION, status(() -> engine.gatherParameter(w)));
        engine.seal();
        ByteBuffer p = engine.param(w);
        for (int i = 0; i < 5; i++) p.putFloat(4 * i, r == 0 ? initial[i] : 0f);
        engine.broadcastParameters();
        float[] got = engine.gatherParameter(w);
        assertEquals(OUT_OF_RANGE, status(() -> engine.gatherParameter(3)));
        return got;
      }
    });
    for (int r = 0; r < 2; r++) {
      assertArrayEquals(initial, results.get(r), "rank " + r);
    }
  }

  @Test
  void engineTwoRanksBadInput() throws Exception {
    CommTest.runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r, 10000); Communicator c = comm(store, r, 2)) {
        try (Engine bad = Engine.create(c)) {
          bad.addParam("w", new long[] {r == 0 ? 4 : 5});
          assertEquals(INVALID_ARGUMENT, status(bad::seal));
        }
        try (Engine engine = Engine.create(c)) {
          assertEquals(UNIMPLEMENTED, status(() -> engine.addParam("h", new long[] {2},
              DType.FLOAT64, false, false, true, false, 0)));
          int a = engine.addParam("a", new long[] {4});
          int a2 = engine.addParam("a2", new long[] {3});
          int b = engine.addParam("b", new long[] {2}, DType.FLOAT32, false, false, true, false, 1);
          engine.seal();
          engine.broadcastParameters();
          assertEquals(FAILED_PRECONDITION, status(engine::step)); // before backward
          assertEquals(NOT_FOUND, status(() -> engine.waitParameters(5)));
          engine.waitParameters(0);
          engine.waitParameters(1);
          engine.grad(a).putFloat(0, 1f);
          engine.gradReady(a);
          assertEquals(FAILED_PRECONDITION, status(() -> engine.gradReady(a))); // twice
          engine.gradReady(a2);
          assertEquals(FAILED_PRECONDITION, status(engine::step)); // b not checked in
          engine.gradReady(b);
          engine.step();
          engine.synchronize();
        }
        return true;
      }
    });
  }

  // ---- the engine's device and the host-view guard ----------------------------------------
  @Test
  void engineDeviceIsTheShardingCommunicators() throws Exception {
    List<Device> devices = CommTest.runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r, 10000); Communicator c = comm(store, r, 2);
          Engine engine = Engine.create(c)) {
        assertEquals(c.device(), engine.device());
        assertArrayEquals(new long[] {DeviceType.CPU.code(), 0}, engine.h().device());
        return engine.device();
      }
    });
    assertEquals(List.of(new Device(DeviceType.CPU, 0), new Device(DeviceType.CPU, 0)), devices);
  }

  /**
   * A TensorHandle over a DLManagedTensor written by hand into {@code scratch} (host memory
   * of an engine's gradient): a tensor of another framework, on device type {@code type}
   * (DLPack: 1 CPU, 2 CUDA) over the host memory at {@code data}. No GPU is needed to show
   * where the library draws the line.
   */
  static org.hpshard.internal.TensorHandle fakeTensor(ByteBuffer scratch, long scratchAddress,
      long data, int type) throws Exception {
    // LP64 layout of DLManagedTensor: DLTensor {data, device {type, id}, ndim, dtype {code,
    // bits, lanes}, shape, strides, byte_offset}, manager_ctx, deleter; then shape[1].
    scratch.order(java.nio.ByteOrder.nativeOrder());
    scratch.putLong(0, data).putInt(8, type).putInt(12, 0).putInt(16, 1);
    scratch.put(20, (byte) 2).put(21, (byte) 32).putShort(22, (short) 1); // float32
    scratch.putLong(24, scratchAddress + 64).putLong(32, 0).putLong(40, 0);
    scratch.putLong(48, 0).putLong(56, 0).putLong(64, 2); // no deleter; shape {2}
    java.lang.reflect.Constructor<org.hpshard.internal.TensorHandle> c =
        org.hpshard.internal.TensorHandle.class.getDeclaredConstructor(long.class, boolean.class);
    c.setAccessible(true);
    return c.newInstance(scratchAddress, false);
  }

  @Test
  void hostViewsAskTheLibrarysPolicy() throws Exception {
    // A CUDA engine cannot be created without a GPU: a view that says it is on CUDA shows
    // that the binding's host views and collectives ask the library (the memory is host
    // memory here, so nothing would crash without that: a missing check fails the test).
    try (Store store = Store.open("memory://java-guard-" + UUID.randomUUID(), 0, 10000);
        Communicator c = comm(store, 0, 1);
        Engine engine = Engine.create(c, null, new Engine.Options().dynamicLossScaling(true))) {
      int w = engine.addParam("w", new long[] {2});
      int scratch = engine.addParam("scratch", new long[] {32});
      engine.seal();
      assertEquals(8, engine.param(w).capacity()); // on the CPU: views
      assertEquals(65536f, engine.lossScale());
      assertEquals(0, engine.skippedSteps());
      ByteBuffer memory = engine.grad(scratch);
      try (Tensor cuda = new Tensor(fakeTensor(memory, engine.gradAddress(scratch),
               engine.paramAddress(w), 2), engine, "Engine.param(0)")) {
        assertEquals(new Device(DeviceType.CUDA, 0), cuda.device());
        HpsException e = assertThrows(HpsException.class, cuda::byteBuffer);
        assertEquals(FAILED_PRECONDITION, e.status());
        assertTrue(e.getMessage().contains("cuda:0"), e.getMessage());
        assertTrue(e.getMessage().contains("Engine.param(0)"), e.getMessage());
        assertEquals(engine.paramAddress(w), cuda.address()); // the address stays available
        e = assertThrows(HpsException.class, () -> c.allReduce(cuda, cuda, ReduceOp.SUM, null));
        assertEquals(INVALID_ARGUMENT, e.status());
        assertTrue(e.getMessage().contains("on cuda:0 but the operation runs on cpu:0"),
            e.getMessage());
      }
      long[] addresses = engine.lossScaleAddresses();
      assertNotEquals(0, addresses[0]);
      assertNotEquals(0, addresses[1]);
    }
  }

  /**
   * Rank 1 leaves after its last batch; rank 0 has one more, whose step's collectives fail
   * asynchronously (nothing in the step waits). close() returned and the update was missing
   * unseen; it throws that failure now, from the engine's close and from the communicator's
   * close that closes the engine, and not once a call on the engine has thrown it (on this
   * thread or another: "seen elsewhere" threw it again). Another handle's error tells nothing
   * ("unrelated" silenced it).
   */
  @Test
  void closeThrowsTheFailureOfALastStepWhosePeerLeft() throws Exception {
    for (int stage : new int[] {2, 3}) {
      for (String how :
          new String[] {"engine", "communicator", "seen", "seen elsewhere", "unrelated"}) {
        CountDownLatch stepped = new CountDownLatch(1);
        List<String> outcome = CommTest.runRanks(2, (rank, url) -> {
          Store store = Store.open(url, rank, 10000);
          Communicator world = CommTest.world(store, rank, 2);
          Engine engine = trainUneven(world, rank, stage);
          if (rank == 1) {
            assertTrue(stepped.await(60, TimeUnit.SECONDS));
            world.close(); // its engine goes with it
            store.close();
            return "left";
          }
          stepped.countDown();
          if (how.equals("seen")) {
            HpsException e = assertThrows(HpsException.class, engine::synchronize);
            assertEquals("ABORTED", e.statusName(), e.getMessage());
          } else if (how.equals("seen elsewhere")) {
            List<String> thrown = new ArrayList<>();
            Thread waiter = new Thread(() -> {
              try {
                engine.synchronize();
              } catch (HpsException e) {
                thrown.add(e.statusName());
              }
            });
            waiter.start();
            waiter.join();
            assertEquals(List.of("ABORTED"), thrown);
          } else if (how.equals("unrelated")) {
            assertThrows(HpsException.class, () -> Store.open("nosuchscheme://x", 0, 1000));
          }
          String result = "closed";
          for (AutoCloseable h : how.equals("communicator")
                   ? List.<AutoCloseable>of(world) : List.<AutoCloseable>of(engine, world)) {
            try {
              h.close();
            } catch (HpsException e) {
              result = "close threw " + e.statusName();
            }
          }
          assertTrue(engine.isClosed() && world.isClosed(), how);
          store.close();
          return result;
        });
        String want = how.startsWith("seen") ? "closed" : "close threw ABORTED";
        assertEquals(List.of(want, "left"), outcome, how + ", stage " + stage);
      }
    }
  }

  /** An engine over {@code world} after 3 steps on rank 0 and 2 on the others. */
  private static Engine trainUneven(Communicator world, int rank, int stage) {
    Engine engine = Engine.create(world, null,
        new Engine.Options().learningRate(0.5f).stage(stage));
    int w = engine.addParam("w", new long[] {64});
    engine.seal();
    engine.broadcastParameters();
    for (int s = 0; s < (rank == 0 ? 3 : 2); s++) { // uneven data
      engine.waitParameters(0);
      ByteBuffer g = engine.grad(w);
      for (int k = 0; k < 64; k++) g.putFloat(4 * k, 1f);
      engine.gradReady(w);
      engine.releaseParameters(0);
      engine.step();
    }
    return engine;
  }

  /**
   * As above, with rank 0's engine left to the garbage collector: its Cleaner found the
   * failure and nobody was told (the communicator's close returned normally). It is written
   * to stderr now.
   */
  @Test
  void anEngineCollectedWithFailedWorkSaysSo() throws Exception {
    final String said = "hpshard: an engine garbage-collected without close() had failed work";
    ByteArrayOutputStream err = new ByteArrayOutputStream();
    PrintStream stderr = System.err;
    System.setErr(new PrintStream(err, true));
    try {
      CountDownLatch stepped = new CountDownLatch(1);
      List<String> outcome = CommTest.runRanks(2, (rank, url) -> {
        Store store = Store.open(url, rank, 10000);
        Communicator world = CommTest.world(store, rank, 2);
        Engine engine = trainUneven(world, rank, 2);
        if (rank == 1) {
          assertTrue(stepped.await(60, TimeUnit.SECONDS));
          world.close(); // its engine goes with it
          store.close();
          return "left";
        }
        WeakReference<Engine> collected = new WeakReference<>(engine);
        engine = null; // rank 0's last step is in flight; nothing refers to its engine
        stepped.countDown();
        long deadline = System.currentTimeMillis() + 30000;
        while (!err.toString().contains(said) && System.currentTimeMillis() < deadline) {
          System.gc();
          Thread.sleep(20);
        }
        world.close(); // nothing left to report
        store.close();
        return collected.get() == null ? "collected" : "still reachable";
      });
      assertEquals(List.of("collected", "left"), outcome);
    } finally {
      System.setErr(stderr);
    }
    assertTrue(err.toString().contains(said), err.toString());
  }

  /**
   * A close of the engine, or of the communicator it is made on (which closes it), on another
   * thread while one thread trains: the close waits for the call under way and the trainer's
   * next call throws IllegalStateException. Before every engine call was counted the engine
   * was freed under a running call (the JVM died with SIGSEGV in hps::Work::test, called from
   * waitParameters, in 4 of 6 stage-3 runs).
   */
  @Test
  void aCloseOnAnotherThreadWhileTrainingEndsTheTrainerCleanly() throws Exception {
    final int units = 8;
    final int n = 1 << 14;
    for (int round = 0; round < 12; ++round) {
      final int stage = 2 + round % 2;
      final boolean closeComm = (round / 2) % 2 == 0;
      try (Store store = Store.open("memory://close-race-" + UUID.randomUUID(), 0)) {
        Communicator c = comm(store, 0, 1);
        Engine e = Engine.create(c, null,
            new Engine.Options().stage(stage).optimizer(Optimizer.SGD).learningRate(1e-3f));
        for (int u = 0; u < units; ++u) e.addParam("w" + u, new long[] {n}, DType.FLOAT32, 0, u);
        e.seal();
        e.broadcastParameters();
        CountDownLatch trained = new CountDownLatch(1);
        Throwable[] ended = new Throwable[1];
        Thread trainer = new Thread(() -> {
          try {
            while (true) {
              for (int u = 0; u < units; ++u) {
                e.waitParameters(u);
                e.param(u).getFloat(0);
                e.releaseParameters(u);
              }
              for (int u = units - 1; u >= 0; --u) {
                e.waitParameters(u);
                ByteBuffer g = e.grad(u);
                for (int k = 0; k < n; k += 64) g.putFloat(4 * k, 1f);
                e.gradReady(u);
                e.releaseParameters(u);
              }
              e.step();
              trained.countDown();
            }
          } catch (Throwable x) {
            ended[0] = x;
          }
        });
        trainer.start();
        assertTrue(trained.await(60, TimeUnit.SECONDS));
        Thread.sleep(round * 7 % 50);
        if (closeComm) {
          c.close();
        } else {
          e.close();
        }
        trainer.join(60000);
        assertFalse(trainer.isAlive());
        assertTrue(ended[0] instanceof IllegalStateException,
            "stage " + stage + ": the trainer ended with " + ended[0]);
        assertTrue(e.isClosed());
        c.close();
      }
    }
  }
}
