package org.hpshard;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.util.UUID;
import org.junit.jupiter.api.Test;

/**
 * DLPack views through the Java binding: Tensor objects that keep the engine's memory
 * alive, ByteBuffers that keep their view alive, views that refuse to be used once their
 * engine is closed (never a crash), collectives and Clip.addTensor over Tensors.
 */
class TensorTest {
  static final int FAILED_PRECONDITION = 5;
  static final int INVALID_ARGUMENT = 1;

  static Communicator one(Store store) {
    return Communicator.create(store, 0, 1, new Communicator.Options().timeoutMs(20000));
  }

  static Store store(String tag) {
    return Store.open("memory://java-tensor-" + tag + "-" + UUID.randomUUID(), 0, 10000);
  }

  @Test
  void viewsDescribeTheMemoryAndWriteThrough() {
    try (Store s = store("through"); Communicator c = one(s);
        Engine engine = Engine.create(c, null, new Engine.Options().learningRate(0.5f))) {
      int w = engine.addParam("w", new long[] {2, 3});
      int h = engine.addParam("h", new long[] {4}, DType.BFLOAT16, 0, 0);
      engine.seal();
      try (Tensor p = engine.paramTensor(w); Tensor ph = engine.paramTensor(h)) {
        assertArrayEquals(new long[] {2, 3}, p.shape());
        assertEquals(DType.FLOAT32, p.dtype());
        assertEquals(DType.BFLOAT16, ph.dtype());
        assertEquals(new Device(DeviceType.CPU, 0), p.device());
        assertEquals(engine.paramAddress(w), p.address());
        ByteBuffer b = p.byteBuffer();
        assertEquals(24, b.capacity());
        for (int i = 0; i < 6; ++i) b.putFloat(4 * i, 1f);
        engine.broadcastParameters();
        engine.waitParameters(0);
        ByteBuffer g = engine.grad(w);
        for (int i = 0; i < 6; ++i) g.putFloat(4 * i, i);
        engine.gradReady(w);
        engine.gradReady(h);
        engine.step();
        engine.waitParameters(0);
        float[] stepped = engine.gatherParameter(w);
        for (int i = 0; i < 6; ++i) {
          assertEquals(1f - 0.5f * i, stepped[i], 1e-6f);
          assertEquals(1f - 0.5f * i, b.getFloat(4 * i), 1e-6f); // the very memory
        }
      }
    }
  }

  @Test
  void viewsOutliveTheEngineAndRefuseUseAfterClose() throws Exception {
    Store s = store("close");
    Communicator c = one(s);
    Engine engine = Engine.create(c);
    int w = engine.addParam("w", new long[] {1 << 16});
    engine.seal();
    ByteBuffer kept = engine.param(w); // its Tensor is reachable only through the buffer
    for (int i = 0; i < 1 << 16; ++i) kept.putFloat(4 * i, 7f);
    Tensor grad = engine.gradTensor(w);
    c.close(); // closes the engine first
    s.close();
    assertTrue(engine.isClosed());
    engine = null;
    for (int i = 0; i < 3; ++i) {
      System.gc();
      Thread.sleep(20);
    }
    // The memory is the engine's, kept alive by the view the buffer holds.
    double sum = 0;
    for (int i = 0; i < 1 << 16; ++i) {
      kept.putFloat(4 * i, kept.getFloat(4 * i) + 1f);
      sum += kept.getFloat(4 * i);
    }
    assertEquals(8.0 * (1 << 16), sum);
    IllegalStateException e = assertThrows(IllegalStateException.class, grad::byteBuffer);
    assertTrue(e.getMessage().contains("closed"), e.getMessage());
    assertThrows(IllegalStateException.class, grad::address);
    grad.close();
    grad.close(); // harmless
  }

  @Test
  void closingATensorLeavesItsBuffersValidMemory() throws Exception {
    Store s = store("tensor-close");
    Communicator c = one(s);
    Engine engine = Engine.create(c);
    int w = engine.addParam("w", new long[] {1 << 16});
    engine.seal();
    Tensor t = engine.paramTensor(w);
    ByteBuffer b = t.byteBuffer();
    ByteBuffer slice = b.slice(); // a buffer derived from it keeps the memory too
    t.close(); // the Tensor's use ends; the memory stays while a buffer over it is reachable
    assertThrows(IllegalStateException.class, t::byteBuffer);
    t = null; // only the buffers keep the view now
    engine.close();
    c.close();
    s.close();
    b = null;
    for (int i = 0; i < 3; ++i) {
      System.gc();
      Thread.sleep(20);
    }
    for (int i = 0; i < 1 << 16; ++i) slice.putFloat(4 * i, i);
    double sum = 0;
    for (int i = 0; i < 1 << 16; ++i) sum += slice.getFloat(4 * i);
    assertEquals((double) (1 << 16) * ((1 << 16) - 1) / 2, sum);
  }

  /**
   * A Tensor and its engine closed while a receive into the Tensor is pending: the Work
   * held the Tensor object only, so the close freed the view and the engine's memory, the
   * next engine's parameter took the same 64 MiB and the receive overwrote it. The Work now
   * pins the view: the memory stays until the receive is over, and nothing else is touched.
   */
  @Test
  void aPendingOperationKeepsTheMemoryOfAClosedTensor() throws Exception {
    final int n = 16 << 20; // 64 MiB of float32: mapped on its own, unmapped when freed
    String url = "memory://java-tensor-pending-" + UUID.randomUUID();
    java.util.concurrent.CountDownLatch closed = new java.util.concurrent.CountDownLatch(1);
    java.util.concurrent.atomic.AtomicReference<Throwable> peerError =
        new java.util.concurrent.atomic.AtomicReference<>();
    Thread peer = new Thread(() -> {
      try (Store ps = Store.open(url, 1, 10000);
          Communicator pc =
              Communicator.create(ps, 1, 2, new Communicator.Options().timeoutMs(20000))) {
        closed.await();
        ByteBuffer data = ByteBuffer.allocateDirect(n * 4).order(java.nio.ByteOrder.nativeOrder());
        for (int i = 0; i < n; i++) data.putFloat(i * 4, 7f);
        pc.send(data, DType.FLOAT32, 0).await();
      } catch (Throwable t) {
        peerError.set(t);
      }
    });
    peer.start();
    try (Store s = Store.open(url, 0, 10000);
        Communicator c =
            Communicator.create(s, 0, 2, new Communicator.Options().timeoutMs(20000));
        Store es = store("pending-a"); Communicator ec = one(es);
        Store es2 = store("pending-b"); Communicator ec2 = one(es2)) {
      Engine first = Engine.create(ec);
      first.addParam("w", new long[] {n});
      first.seal();
      Tensor t = first.paramTensor(0);
      long address = t.address();
      Work w = c.recv(t, 1, null);
      t.close();
      first.close();
      try (Engine second = Engine.create(ec2)) {
        second.addParam("other", new long[] {n});
        second.seal();
        try (Tensor other = second.paramTensor(0)) {
          ByteBuffer p2 = other.byteBuffer();
          for (int i = 0; i < n; i++) p2.putFloat(i * 4, 0f);
          boolean reused = other.address() == address;
          closed.countDown();
          w.await();
          w.close();
          // The first engine's memory was still the receive's.
          assertTrue(!reused, "the pending receive's memory was reused");
          assertEquals(0f, p2.getFloat(0));
          assertEquals(0f, p2.getFloat((n - 1) * 4));
        }
      }
    } finally {
      closed.countDown();
      peer.join(60000);
    }
    assertEquals(null, peerError.get());
  }

  @Test
  void stageThreeViewsExistWhileTheUnitIsGathered() {
    try (Store s = store("stage3"); Communicator c = one(s);
        Engine engine = Engine.create(c, null, new Engine.Options().stage(3))) {
      engine.addParam("a", new long[] {4}, DType.FLOAT32, 0, 0);
      engine.addParam("b", new long[] {4}, DType.FLOAT32, 0, 1);
      engine.seal();
      engine.broadcastParameters();
      HpsException e = assertThrows(HpsException.class, () -> engine.paramTensor(1));
      assertEquals(FAILED_PRECONDITION, e.status());
      engine.waitParameters(1);
      try (Tensor t = engine.paramTensor(1)) {
        assertEquals(16, t.byteBuffer().capacity());
      }
      engine.releaseParameters(1);
      assertEquals(FAILED_PRECONDITION, assertThrows(HpsException.class,
          () -> engine.paramTensor(1)).status());
    }
  }

  @Test
  void collectivesAndClipTakeTensors() {
    try (Store s = store("coll"); Communicator c = one(s); Engine engine = Engine.create(c);
        Stream stream = new Stream()) {
      int w = engine.addParam("w", new long[] {2});
      int v = engine.addParam("v", new long[] {2});
      int odd = engine.addParam("odd", new long[] {3});
      engine.seal();
      try (Tensor g = engine.gradTensor(w); Tensor out = engine.gradTensor(v);
          Tensor three = engine.gradTensor(odd)) {
        g.byteBuffer().putFloat(0, 3f).putFloat(4, 4f);
        c.allReduce(g, out, ReduceOp.SUM, null).await();
        assertEquals(4f, out.byteBuffer().getFloat(4));
        c.broadcast(out, 0, stream).await();
        c.allGather(g, out, null).await();
        c.reduceScatter(g, out, ReduceOp.SUM, null).await();
        c.reduce(g, out, ReduceOp.MAX, 0, null).await();
        HpsException e = assertThrows(HpsException.class,
            () -> c.allReduce(g, three, ReduceOp.SUM, null));
        assertEquals(INVALID_ARGUMENT, e.status());
        assertTrue(e.getMessage().contains("send has 2 elements, recv 3"), e.getMessage());
        assertThrows(NullPointerException.class, () -> c.allReduce(g, null, ReduceOp.SUM, null));
        try (Clip clip = new Clip(c, null, null, 1.0, false)) {
          clip.addTensor(g, 0);
          clip.seal();
          clip.run(stream);
          stream.synchronize();
          assertEquals(0.6f, g.byteBuffer().getFloat(0), 1e-6f);
          assertEquals(0.2f, clip.coefficientTensor().byteBuffer().getFloat(0), 1e-6f);
        }
      }
    }
  }

  @Test
  void computeStreamOption() {
    try (Store s = store("compute"); Communicator c = one(s); Stream compute = new Stream();
        Engine engine = Engine.create(c, null, new Engine.Options().computeStream(compute))) {
      engine.addParam("w", new long[] {2});
      engine.seal();
      assertEquals(1f, engine.lossScale());
      try (Tensor k = engine.skippedStepsTensor()) {
        assertEquals(DType.INT64, k.dtype());
        assertEquals(0, k.byteBuffer().getLong(0));
      }
    }
  }
}
