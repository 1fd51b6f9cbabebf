package org.hpshard;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.Map;
import java.util.UUID;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

/**
 * Checkpoints (Checkpoint) and the engine's bucket cap: a tiny model trained over
 * thread-ranks, saved in the background, loaded into fresh engines of the same topology
 * (resuming bitwise) and of another stage and sharding degree; inspect, verify, the saved
 * engine options, safetensors export and import, partial loads, bad input.
 */
class CheckpointTest {
  static final int INVALID_ARGUMENT = 1;
  static final int OUT_OF_RANGE = 2;
  static final int NOT_FOUND = 3;
  static final int ALREADY_EXISTS = 4;
  static final int FAILED_PRECONDITION = 5;

  static final String[] NAMES = {"w0", "b0", "w1", "b1"};
  static final long[][] SHAPES = {{40, 5}, {5}, {5, 3}, {3}};
  static final int[] UNITS = {0, 0, 1, 1};

  static int numel(int k) {
    int n = 1;
    for (long d : SHAPES[k]) n *= (int) d;
    return n;
  }

  static float initial(int k, int i) {
    return (float) (0.4 * Math.sin(i * 0.61 + k));
  }

  /** The data's part of every rank's gradient: the same on every rank and any topology. */
  static float target(int k, int i, int step) {
    return (float) Math.cos(i * 0.23 + 1.3 * step + k);
  }

  static Engine build(Communicator c, Engine.Options options, float fill, int[] index) {
    Engine engine = Engine.create(c, null, options);
    for (int k = 0; k < NAMES.length; k++) {
      index[k] = engine.addParam(NAMES[k], SHAPES[k], DType.FLOAT32, false, false, true, false,
          UNITS[k]);
    }
    engine.seal();
    for (int k = 0; k < NAMES.length; k++) {
      ByteBuffer p = engine.param(index[k]);
      for (int i = 0; i < numel(k); i++) {
        p.putFloat(4 * i, c.rank() != 0 ? 0f : Float.isNaN(fill) ? initial(k, i) : fill);
      }
    }
    engine.broadcastParameters();
    return engine;
  }

  static Engine.Options adamw(int stage) {
    return new Engine.Options().stage(stage).optimizer(Optimizer.ADAMW).learningRate(0.02f)
        .weightDecay(0.01f);
  }

  /** Steps first .. first+steps-1: gradients 0.3 * p + target, checked in one by one. */
  static void train(Engine engine, int[] index, int first, int steps) {
    for (int step = first; step < first + steps; step++) {
      engine.waitParameters(0);
      engine.waitParameters(1);
      for (int k = NAMES.length - 1; k >= 0; k--) {
        ByteBuffer p = engine.param(index[k]);
        ByteBuffer g = engine.grad(index[k]);
        for (int i = 0; i < numel(k); i++) {
          g.putFloat(4 * i, g.getFloat(4 * i) + 0.3f * p.getFloat(4 * i) + target(k, i, step));
        }
        engine.gradReady(index[k]);
      }
      engine.releaseParameters(1);
      engine.releaseParameters(0);
      engine.step();
    }
  }

  static float[][] gathered(Engine engine, int[] index) {
    float[][] out = new float[NAMES.length][];
    for (int k = 0; k < NAMES.length; k++) out[k] = engine.gatherParameter(index[k]);
    return out;
  }

  static void assertClose(float[][] want, float[][] got, String what) {
    for (int k = 0; k < want.length; k++) {
      for (int i = 0; i < want[k].length; i++) {
        assertTrue(Math.abs(want[k][i] - got[k][i]) <= 1e-6 * Math.abs(want[k][i]) + 1e-7,
            what + " " + NAMES[k] + "[" + i + "]: " + got[k][i] + " vs " + want[k][i]);
      }
    }
  }

  @Test
  void saveThenResumeInTheSameAndAnotherTopology(@TempDir Path tmp) throws Exception {
    Path root = tmp.resolve("ckpt");
    List<float[][][]> first = CommTest.runRanks(2, (r, url) -> {
      int[] index = new int[NAMES.length];
      try (Store store = Store.open(url, r, 10000); Communicator c = CommTest.world(store, r, 2);
          Engine engine = build(c, adamw(2), Float.NaN, index);
          Checkpoint ckpt = Checkpoint.create(engine, c, root,
              new Checkpoint.Options().keepLast(2))) {
        train(engine, index, 0, 3);
        float[][] atSave = gathered(engine, index);
        Hpshard.hostSyncReset();
        Work work = ckpt.save("step-3", Map.of("step", "3", "loader", "epoch 0 batch 7"));
        train(engine, index, 3, 2); // overlaps the writing
        assertEquals(0, Hpshard.hostSyncCountThread(), "host syncs after the save");
        work.await();
        assertTrue(work.test());
        assertEquals(ALREADY_EXISTS, EngineTest.status(() -> ckpt.save("step-3")));
        return new float[][][] {atSave, gathered(engine, index)};
      }
    });
    float[][] atSave = first.get(0)[0];
    float[][] fin = first.get(0)[1];
    assertArrayEquals(atSave, first.get(1)[0]);
    assertNotEquals(initial(0, 0), atSave[0][0]);

    CheckpointInfo info = Checkpoint.inspect(root);
    assertEquals("step-3", info.name());
    assertEquals(32, info.id().length());
    assertEquals(List.of(1, 0, 1, 0),
        List.of(info.mp(), info.mpRank(), info.pp(), info.ppRank()));
    assertEquals(List.of(1, 2, 2, 1, 2, 2),
        List.of(info.formatVersion(), info.stage(), info.sharding(), info.dp(), info.world(),
            info.files()));
    assertEquals(3 * NAMES.length + 4, info.tensors());
    long elements = 0;
    for (int k = 0; k < NAMES.length; k++) elements += numel(k);
    assertEquals(3 * 4 * elements + 4 + 4 + 8 + 8, info.bytes());
    assertTrue(info.createdUnixNs() > 0);
    Checkpoint.verify(root);
    Engine.Options saved = Checkpoint.readEngineOptions(root);
    assertEquals(Optimizer.ADAMW, saved.optimizer());
    assertEquals(2, saved.stage());
    assertEquals(0.02f, saved.learningRate());
    assertEquals(0L, saved.bucketBytes());
    // Every option the checkpoint holds reads back (the library's defaults where unset).
    assertEquals(List.of(0.9f, 0.999f, 1e-8f), List.of(saved.beta1(), saved.beta2(), saved.eps()));
    assertEquals(List.of(0f, false), List.of(saved.momentum(), saved.nesterov()));
    assertEquals(List.of(1, 2), List.of(saved.accumulationSteps(), saved.prefetchWindow()));
    assertEquals(List.of(false, 65536f, 2f, 0.5f, 2000), List.of(saved.dynamicLossScaling(),
        saved.initialLossScale(), saved.growthFactor(), saved.backoffFactor(),
        saved.growthInterval()));
    assertTrue(saved.clipMaxNorm() >= 0 && saved.alignmentBytes() > 0);
    assertEquals(false, saved.deterministicClip());

    // Same topology: bitwise. Stage 3 over 4 ranks: the same parameters, the same training.
    for (int[] topology : new int[][] {{2, 2}, {3, 4}}) {
      int stage = topology[0];
      List<float[][][]> resumed = CommTest.runRanks(topology[1], (r, url) -> {
        int[] index = new int[NAMES.length];
        try (Store store = Store.open(url, r, 10000);
            Communicator c = CommTest.world(store, r, topology[1]);
            Engine engine = build(c, Checkpoint.readEngineOptions(root).stage(stage), 7f, index);
            Checkpoint ckpt = Checkpoint.create(engine, c, root)) {
          assertEquals(NOT_FOUND, EngineTest.status(() -> ckpt.metadata("step")));
          ckpt.load();
          int step = Integer.parseInt(ckpt.metadata("step"));
          assertEquals("epoch 0 batch 7", ckpt.metadata("loader"));
          float[][] loaded = gathered(engine, index);
          train(engine, index, step, 2);
          return new float[][][] {loaded, gathered(engine, index)};
        }
      });
      for (float[][][] r : resumed) {
        assertArrayEquals(atSave, r[0]);
        if (stage == 2) {
          assertArrayEquals(fin, r[1]);
        } else {
          assertClose(fin, r[1], "stage 3, 4 ranks");
        }
      }
    }
  }

  static Communicator single(Store store) {
    return Communicator.create(store, 0, 1, new Communicator.Options().timeoutMs(20000));
  }

  @Test
  void safetensorsPartialLoadsAndBadInput(@TempDir Path tmp) throws Exception {
    int[] index = new int[NAMES.length];
    try (Store store = Store.open("memory://java-ckpt-" + UUID.randomUUID(), 0, 10000);
        Communicator c = single(store)) {
      float[][] saved;
      try (Engine engine = build(c, adamw(2), Float.NaN, index);
          Checkpoint ckpt = Checkpoint.create(engine, c, tmp)) {
        train(engine, index, 0, 1);
        saved = gathered(engine, index);
        for (String name : new String[] {"../escape", ".hidden", "", "a/b"}) {
          assertEquals(INVALID_ARGUMENT, EngineTest.status(() -> ckpt.save(name)), name);
        }
        assertThrows(NullPointerException.class,
            () -> ckpt.save("n", java.util.Collections.singletonMap("k", null)));
        ckpt.save("one", Map.of("step", "1")).await();
        assertEquals(NOT_FOUND, EngineTest.status(() -> ckpt.load("absent", false)));
        // In the middle of a step: refused.
        engine.waitParameters(0);
        engine.waitParameters(1);
        engine.gradReady(index[3]);
        assertEquals(FAILED_PRECONDITION, EngineTest.status(ckpt::load));
        for (int k = 2; k >= 0; k--) engine.gradReady(index[k]);
        engine.releaseParameters(1);
        engine.releaseParameters(0);
        engine.step();
        float[][] after = gathered(engine, index);
        // A flipped byte: verify names the file; a load changes nothing.
        Path data = tmp.resolve("one").resolve("rank-00000.bin");
        byte[] blob = Files.readAllBytes(data);
        blob[200] ^= 0x40;
        Files.write(data, blob);
        HpsException e = assertThrows(HpsException.class, () -> Checkpoint.verify(tmp));
        assertEquals(INVALID_ARGUMENT, e.status());
        assertTrue(e.getMessage().contains("rank-00000.bin"), e.getMessage());
        assertEquals(INVALID_ARGUMENT, EngineTest.status(() -> ckpt.load("one", false)));
        assertArrayEquals(after, gathered(engine, index));
        blob[200] ^= 0x40;
        Files.write(data, blob);
        Checkpoint.verify(tmp.resolve("one"));
        // The parameters as safetensors, imported into a fresh engine.
        Path model = tmp.resolve("model.safetensors");
        Checkpoint.exportSafetensors(tmp.resolve("one"), model, true);
        int[] fresh = new int[NAMES.length];
        try (Engine other = build(c, adamw(3), -1f, fresh);
            Checkpoint imported = Checkpoint.create(other, c, tmp.resolve("other"))) {
          imported.importSafetensors(model, false);
          assertArrayEquals(saved, gathered(other, fresh));
          assertEquals("1", imported.metadata("step"));
          assertEquals(NOT_FOUND,
              EngineTest.status(() -> imported.importSafetensors(tmp.resolve("absent"), false)));
        }
        // Partial: an engine without b1 refuses the checkpoint, unless partial.
        try (Engine smaller = Engine.create(c, null, adamw(2))) {
          int[] idx = new int[3];
          for (int k = 0; k < 3; k++) {
            idx[k] = smaller.addParam(NAMES[k], SHAPES[k], DType.FLOAT32, false, false, true,
                false, UNITS[k]);
          }
          smaller.seal();
          smaller.broadcastParameters();
          try (Checkpoint partial = Checkpoint.create(smaller, c, tmp)) {
            HpsException refused =
                assertThrows(HpsException.class, () -> partial.load("one", false));
            assertEquals(INVALID_ARGUMENT, refused.status());
            assertTrue(refused.getMessage().contains("b1"), refused.getMessage());
            assertEquals(0f, smaller.gatherParameter(idx[0])[0]);
            partial.load("one", true);
            for (int k = 0; k < 3; k++) assertArrayEquals(saved[k], smaller.gatherParameter(idx[k]));
          }
        }
      }
      assertEquals(NOT_FOUND, EngineTest.status(() -> Checkpoint.inspect(tmp.resolve("none"))));
      assertEquals(NOT_FOUND,
          EngineTest.status(() -> Checkpoint.readEngineOptions(tmp.resolve("none"))));
      assertEquals(NOT_FOUND, EngineTest.status(
          () -> Checkpoint.exportSafetensors(tmp.resolve("none"), tmp.resolve("x"), false)));
      assertEquals(INVALID_ARGUMENT, EngineTest.status(() -> CheckpointInfo.structSize(8)));
      assertTrue(CheckpointInfo.structSize() >= 297);
    }
  }

  /**
   * Strings cross as standard UTF-8 both ways (JNI's own conversions use "modified UTF-8": a
   * character outside the BMP became two encoded surrogates, refused as invalid UTF-8, and
   * came back mangled in messages); a NUL or an unpaired surrogate has no C string form and
   * is refused, not changed.
   */
  @Test
  void stringsCrossAsUtf8(@TempDir Path tmp) throws Exception {
    String smile = "w\uD83D\uDE00"; // "w" and U+1F600
    try (Store store = Store.open("memory://java-utf8-" + UUID.randomUUID(), 0, 10000);
        Communicator c = single(store);
        Engine engine = Engine.create(c, null, adamw(2))) {
      int index = engine.addParam(smile, new long[] {3}, DType.FLOAT32, false, false, true, false, 0);
      assertThrows(IllegalArgumentException.class,
          () -> engine.addParam("a\0b", new long[] {3}, DType.FLOAT32, false, false, true, false, 0));
      assertThrows(IllegalArgumentException.class,
          () -> engine.addParam("a\uD83D", new long[] {3}, DType.FLOAT32, false, false, true, false, 0));
      HpsException twice = assertThrows(HpsException.class,
          () -> engine.addParam(smile, new long[] {3}, DType.FLOAT32, false, false, true, false, 0));
      assertTrue(twice.getMessage().contains(smile), twice.getMessage());
      engine.seal();
      engine.broadcastParameters();
      Path root = tmp.resolve("ck\uD83D\uDE00");
      try (Checkpoint ckpt = Checkpoint.create(engine, c, root)) {
        ckpt.save("a", Map.of("note", "x\uD83D\uDE00y")).await();
        assertTrue(Files.isDirectory(root.resolve("a")), root.toString());
        ckpt.load("a", false);
        assertEquals("x\uD83D\uDE00y", ckpt.metadata("note"));
      }
      assertEquals(0, index);
      assertThrows(IllegalArgumentException.class, () -> store.set("k\0", new byte[] {1}));
      store.set("k\uD83D\uDE00", new byte[] {1});
      assertTrue(store.check("k\uD83D\uDE00"));
    }
  }

  /**
   * A close on another thread while a load runs (a misuse: one thread at a time) waits for
   * the load to return; it freed the native checkpoint under the load (the JVM crashed,
   * SIGSEGV). Saves from two threads take turns (the process aborted).
   */
  @Test
  void aCloseOnAnotherThreadWaitsForTheLoadUnderWay(@TempDir Path tmp) throws Exception {
    try (Store store = Store.open("memory://java-ckpt-" + UUID.randomUUID(), 0, 10000);
        Communicator c = single(store);
        Engine engine = Engine.create(c, null, adamw(2))) {
      engine.addParam("w", new long[] {1 << 21}, DType.FLOAT32, false, false, true, false, 0);
      engine.seal();
      engine.broadcastParameters();
      try (Checkpoint ckpt = Checkpoint.create(engine, c, tmp)) {
        Work[] works = new Work[2];
        Thread[] savers = new Thread[2];
        for (int t = 0; t < 2; t++) {
          final int which = t;
          savers[t] = new Thread(() -> works[which] = ckpt.save("s" + which));
          savers[t].start();
        }
        for (Thread t : savers) t.join();
        for (Work w : works) w.await();
      }
      for (int delayMs : new int[] {0, 2, 10}) {
        Checkpoint ckpt = Checkpoint.create(engine, c, tmp);
        String[] outcome = new String[1];
        Thread loader = new Thread(() -> {
          try {
            ckpt.load("s0", false);
            outcome[0] = "loaded";
          } catch (IllegalStateException e) { // the close came first
            outcome[0] = "closed";
          }
        });
        loader.start();
        Thread.sleep(delayMs);
        ckpt.close();
        loader.join();
        assertTrue(outcome[0] != null, "the load neither ran nor was refused");
        assertTrue(ckpt.isClosed());
      }
      Checkpoint.verify(tmp.resolve("s1"));
    }
  }

  @Test
  void closingTheEngineClosesItsCheckpointFirst(@TempDir Path tmp) {
    int[] index = new int[NAMES.length];
    try (Store store = Store.open("memory://java-ckpt-" + UUID.randomUUID(), 0, 10000);
        Communicator c = single(store)) {
      Engine engine = build(c, adamw(2), Float.NaN, index);
      Checkpoint ckpt = Checkpoint.create(engine, c, tmp);
      train(engine, index, 0, 1);
      Work work = ckpt.save("s");
      engine.close(); // the checkpoint first, which waits for the save
      assertTrue(ckpt.isClosed());
      work.await();
      Checkpoint.verify(tmp.resolve("s"));
      assertThrows(IllegalStateException.class, () -> ckpt.load());
    }
  }

  @Test
  void bucketBytesCutsUnitsAndTrainsTheSame() throws Exception {
    // w0 (800 bytes) fills a 1024-byte bucket: b0 starts the next one.
    List<float[][][]> results = CommTest.runRanks(2, (r, url) -> {
      float[][][] out = new float[2][][];
      try (Store store = Store.open(url, r, 10000); Communicator c = CommTest.world(store, r, 2)) {
        for (int capped = 0; capped < 2; capped++) {
          int[] index = new int[NAMES.length];
          Engine.Options options = adamw(2).bucketBytes(capped == 1 ? 1024 : 0);
          try (Engine engine = build(c, options, Float.NaN, index)) {
            long w0 = engine.paramBucket(index[0]);
            long b0 = engine.paramBucket(index[1]);
            assertEquals(capped == 1, w0 != b0);
            assertNotEquals(engine.paramBucket(index[0]), engine.paramBucket(index[2]));
            assertEquals(OUT_OF_RANGE, EngineTest.status(() -> engine.paramBucket(99)));
            train(engine, index, 0, 3);
            out[capped] = gathered(engine, index);
          }
        }
      }
      return out;
    });
    for (float[][][] r : results) assertArrayEquals(r[0], r[1]);
  }
}
