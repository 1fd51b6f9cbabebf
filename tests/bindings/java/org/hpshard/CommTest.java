package org.hpshard;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.UUID;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import org.hpshard.internal.CommHandle;
import org.hpshard.internal.HpshardNative;
import org.hpshard.internal.hps_comm_options_t;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.function.Executable;

/** Stores, communicators, work, topology and hybrid groups; ranks are threads. */
class CommTest {
  static final int INVALID_ARGUMENT = 1;
  static final int OUT_OF_RANGE = 2;
  static final int NOT_FOUND = 3;
  static final int TIMEOUT = 8;
  static final int ABORTED = 9;
  static final int WORLD = 4;
  static final long JOIN_MS = 60000;

  interface RankBody<T> {
    T run(int rank, String url) throws Exception;
  }

  /** Runs body on n thread-ranks over a fresh memory:// store, bounded by JOIN_MS. */
  static <T> List<T> runRanks(int n, RankBody<T> body) throws Exception {
    String url = "memory://java-" + UUID.randomUUID();
    List<T> results = new ArrayList<>();
    List<AtomicReference<Throwable>> errors = new ArrayList<>();
    List<AtomicReference<T>> outs = new ArrayList<>();
    Thread[] threads = new Thread[n];
    for (int r = 0; r < n; r++) {
      final int rank = r;
      AtomicReference<Throwable> err = new AtomicReference<>();
      AtomicReference<T> out = new AtomicReference<>();
      errors.add(err);
      outs.add(out);
      threads[r] = new Thread(() -> {
        try {
          out.set(body.run(rank, url));
        } catch (Throwable t) {
          err.set(t);
        }
      }, "rank" + r);
      threads[r].setDaemon(true);
      threads[r].start();
    }
    long deadline = System.currentTimeMillis() + JOIN_MS;
    for (Thread t : threads) t.join(Math.max(1, deadline - System.currentTimeMillis()));
    for (Thread t : threads) {
      if (t.isAlive()) fail(t.getName() + " still running after " + JOIN_MS + " ms");
    }
    for (int r = 0; r < n; r++) {
      if (errors.get(r).get() != null) {
        throw new AssertionError("rank " + r + " failed", errors.get(r).get());
      }
      results.add(outs.get(r).get());
    }
    return results;
  }

  static Communicator world(Store store, int rank, int size) {
    return Communicator.create(store, rank, size,
        new Communicator.Options().timeoutMs(20000).name("java-world").checkArguments(true));
  }

  static ByteBuffer direct(int bytes) {
    return ByteBuffer.allocateDirect(bytes).order(ByteOrder.nativeOrder());
  }

  static ByteBuffer floats(float... v) {
    ByteBuffer b = direct(v.length * 4);
    for (int i = 0; i < v.length; i++) b.putFloat(i * 4, v[i]);
    return b;
  }

  static ByteBuffer longs(long... v) {
    ByteBuffer b = direct(v.length * 8);
    for (int i = 0; i < v.length; i++) b.putLong(i * 8, v[i]);
    return b;
  }

  static int status(Executable call) {
    return assertThrows(HpsException.class, call).status();
  }

  static long value(int rank, int i) {
    return (((i * 7L + rank * 13L) % 17) - 8) * 4; // multiples of 4: exact averages
  }

  /**
   * Rank 0 queues an all-reduce rank 1 never joins, then closes: the close waits for the
   * operation (8 s timeout) and abort() from a watchdog thread ends that wait at once. After
   * the close, abort() throws IllegalStateException.
   */
  @Test
  void abortFromAnotherThreadEndsACloseWaitingOnAStuckOperation() throws Exception {
    CountDownLatch closed = new CountDownLatch(1);
    List<Long> out = runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r, 10000);
          Communicator comm = Communicator.create(store, r, 2,
              new Communicator.Options().timeoutMs(8000))) {
        if (r == 1) {
          assertTrue(closed.await(30, TimeUnit.SECONDS));
          return 0L;
        }
        ByteBuffer buf = floats(1f, 2f);
        Work work = comm.allReduce(buf, buf, DType.FLOAT32, ReduceOp.SUM);
        Thread watchdog = new Thread(() -> {
          try {
            Thread.sleep(300);
          } catch (InterruptedException e) {
            return;
          }
          comm.abort();
        });
        watchdog.start();
        long start = System.nanoTime();
        comm.close();
        long closeMs = (System.nanoTime() - start) / 1_000_000;
        watchdog.join();
        assertEquals(9, assertThrows(HpsException.class, work::await).status()); // ABORTED
        assertThrows(IllegalStateException.class, comm::abort);
        closed.countDown();
        return closeMs;
      }
    });
    assertTrue(out.get(0) < 4000, "close took " + out.get(0) + " ms, the 8 s timeout");
  }

  @Test
  void allReduceOpsAndDtypes() throws Exception {
    int n = 16;
    List<List<double[]>> res = runRanks(WORLD, (r, url) -> {
      List<double[]> out = new ArrayList<>();
      try (Store store = Store.open(url, r, 10000); Communicator comm = world(store, r, WORLD)) {
        assertEquals(r, comm.rank());
        assertEquals(WORLD, comm.size());
        for (DType dtype : new DType[] {DType.FLOAT32, DType.INT64}) {
          for (ReduceOp op : ReduceOp.values()) {
            ByteBuffer send = direct(n * (int) dtype.size());
            ByteBuffer recv = direct(n * (int) dtype.size());
            for (int i = 0; i < n; i++) {
              if (dtype == DType.FLOAT32) send.putFloat(i * 4, value(r, i));
              else send.putLong(i * 8, value(r, i));
            }
            try (Work w = comm.allReduce(send, recv, dtype, op)) {
              w.await();
              assertTrue(w.test());
            }
            double[] got = new double[n];
            for (int i = 0; i < n; i++) {
              got[i] = dtype == DType.FLOAT32 ? recv.getFloat(i * 4) : recv.getLong(i * 8);
            }
            out.add(got);
          }
        }
      }
      return out;
    });
    int k = 0;
    for (DType dtype : new DType[] {DType.FLOAT32, DType.INT64}) {
      for (ReduceOp op : ReduceOp.values()) {
        double[] ref = new double[n];
        for (int i = 0; i < n; i++) {
          long sum = 0, max = Long.MIN_VALUE, min = Long.MAX_VALUE;
          for (int q = 0; q < WORLD; q++) {
            sum += value(q, i);
            max = Math.max(max, value(q, i));
            min = Math.min(min, value(q, i));
          }
          ref[i] = switch (op) {
            case SUM -> sum;
            case AVG -> sum / WORLD;
            case MAX -> max;
            case MIN -> min;
          };
        }
        for (int r = 0; r < WORLD; r++) assertArrayEquals(ref, res.get(r).get(k), dtype + " " + op);
        k++;
      }
    }
  }

  @Test
  void collectives() throws Exception {
    runRanks(WORLD, (r, url) -> {
      try (Store store = Store.open(url, r); Communicator comm = world(store, r, WORLD)) {
        ByteBuffer send = floats(r * 100f, r * 100f + 1);
        ByteBuffer gathered = direct(2 * WORLD * 4);
        comm.allGather(send, gathered, DType.FLOAT32).await();
        for (int q = 0; q < WORLD; q++) {
          assertEquals(q * 100f, gathered.getFloat(q * 8));
          assertEquals(q * 100f + 1, gathered.getFloat(q * 8 + 4));
        }
        long[] big = new long[2 * WORLD];
        for (int i = 0; i < big.length; i++) big[i] = (i + 1L) * (r + 1);
        ByteBuffer scattered = direct(16);
        comm.reduceScatter(longs(big), scattered, DType.INT64, ReduceOp.SUM).await();
        assertEquals((2L * r + 1) * 10, scattered.getLong(0));
        assertEquals((2L * r + 2) * 10, scattered.getLong(8));

        ByteBuffer v = direct(4);
        v.putInt(0, r == 2 ? 77 : 0);
        comm.broadcast(v, DType.INT32, 2).await();
        assertEquals(77, v.getInt(0));

        ByteBuffer reduced = r == 1 ? direct(8) : null;
        comm.reduce(longs(r + 1), reduced, DType.INT64, ReduceOp.MAX, 1).await();
        if (r == 1) assertEquals(WORLD, reduced.getLong(0));

        ByteBuffer got = longs(-1);
        try (Work s = comm.send(longs(r * 10L), DType.INT64, (r + 1) % WORLD);
            Work rv = comm.recv(got, DType.INT64, (r + WORLD - 1) % WORLD);
            Stream stream = new Stream()) {
          rv.waitStream(stream);
          stream.synchronize();
          assertEquals(((r + WORLD - 1) % WORLD) * 10L, got.getLong(0));
          s.await();
        }
        try (Work b = comm.barrier()) {
          b.await();
        }
      }
      return null;
    });
  }

  /** What rank 0 does with a receive from rank 1 while it is pending. */
  interface PendingReceive {
    /** `release` lets rank 1 send 42 into `got`. */
    void run(Work rv, ByteBuffer got, CountDownLatch release) throws Exception;
  }

  /** Two ranks: rank 0 runs `body` on its receive; rank 1 sends once released. */
  static void withPendingReceive(PendingReceive body) throws Exception {
    CountDownLatch pending = new CountDownLatch(1);
    runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r, 10000); Communicator comm = world(store, r, 2)) {
        if (r == 0) {
          ByteBuffer got = longs(-1);
          try (Work rv = comm.recv(got, DType.INT64, 1)) {
            body.run(rv, got, pending);
          }
        } else {
          assertTrue(pending.await(JOIN_MS, TimeUnit.MILLISECONDS));
          comm.send(longs(42L), DType.INT64, 0).await();
        }
      }
      return null;
    });
  }

  /** A timed await says false while a receive is pending, then true once it finished. */
  @Test
  void timedAwaitSaysWhetherTheOperationFinished() throws Exception {
    withPendingReceive((rv, got, release) -> {
      long start = System.nanoTime();
      assertFalse(rv.await(20, TimeUnit.MILLISECONDS));
      assertTrue(System.nanoTime() - start >= TimeUnit.MILLISECONDS.toNanos(15));
      assertEquals(-1L, got.getLong(0));
      release.countDown();
      assertTrue(rv.await(60, TimeUnit.SECONDS));
      assertEquals(42L, got.getLong(0));
    });
  }

  /**
   * An interrupt ends awaitInterruptibly with InterruptedException while the receive is
   * pending (await() would wait for the communicator's timeout); the work still holds the
   * receive, which completes once the peer sends.
   */
  @Test
  void anInterruptEndsAnInterruptibleAwaitAndTheWorkGoesOn() throws Exception {
    withPendingReceive((rv, got, release) -> {
      Thread.currentThread().interrupt();
      assertThrows(InterruptedException.class, rv::awaitInterruptibly);
      assertFalse(Thread.currentThread().isInterrupted());
      Thread waiter = Thread.currentThread();
      Thread interrupter = new Thread(() -> {
        try {
          Thread.sleep(100);
        } catch (InterruptedException e) {
          return;
        }
        waiter.interrupt();
      });
      long start = System.nanoTime();
      interrupter.start();
      assertThrows(InterruptedException.class, rv::awaitInterruptibly);
      long waited = System.nanoTime() - start;
      interrupter.join();
      assertFalse(Thread.currentThread().isInterrupted());
      assertTrue(waited >= TimeUnit.MILLISECONDS.toNanos(90), "waited " + waited);
      assertTrue(waited < TimeUnit.SECONDS.toNanos(5), "waited " + waited);
      assertEquals(-1L, got.getLong(0));
      assertFalse(rv.test());
      release.countDown();
      rv.awaitInterruptibly();
      assertEquals(42L, got.getLong(0));
    });
  }

  /**
   * Store.abort from another thread ends a Communicator creation waiting for a rank that
   * never comes (it waited for the 20 s timeout); every later call on the store throws
   * ABORTED.
   */
  @Test
  void storeAbortEndsARendezvousWaitingForARankThatNeverComes() throws Exception {
    try (Store store = Store.open("memory://java-abort-" + UUID.randomUUID(), 0, 10000)) {
      AtomicReference<Throwable> failure = new AtomicReference<>();
      Thread rank = new Thread(() -> {
        try (Communicator comm = world(store, 0, 2)) {
          failure.set(new AssertionError("created without rank 1"));
        } catch (Throwable t) {
          failure.set(t);
        }
      });
      long start = System.nanoTime();
      rank.start();
      Thread.sleep(300);
      store.abort();
      rank.join(JOIN_MS);
      assertFalse(rank.isAlive());
      assertTrue(System.nanoTime() - start < TimeUnit.SECONDS.toNanos(3));
      HpsException e = assertInstanceOf(HpsException.class, failure.get());
      assertEquals(ABORTED, e.status(), e.getMessage());
      HpsException later = assertThrows(HpsException.class, () -> store.set("k", "v"));
      assertEquals(ABORTED, later.status());
    }
  }

  @Test
  void split() throws Exception {
    List<Long> sums = runRanks(WORLD, (r, url) -> {
      try (Store store = Store.open(url, r); Communicator comm = world(store, r, WORLD)) {
        Communicator evens = comm.split(new int[] {0, 2}, "even");
        Communicator odds = comm.split(new int[] {1, 3}, "odd");
        assertEquals(r % 2 == 0, evens != null);
        assertEquals(r % 2 == 1, odds != null);
        try (Communicator sub = evens != null ? evens : odds) {
          assertEquals(2, sub.size());
          assertEquals(r / 2, sub.rank());
          ByteBuffer total = direct(8);
          sub.allReduce(longs(r), total, DType.INT64, ReduceOp.SUM).await();
          return total.getLong(0);
        }
      }
    });
    assertEquals(Arrays.asList(2L, 4L, 2L, 4L), sums);
  }

  @Test
  void hybridGroupDp2Sharding2() throws Exception {
    List<long[]> res = runRanks(WORLD, (r, url) -> {
      try (Store store = Store.open(url, r);
          Communicator comm = world(store, r, WORLD);
          Topology topo = new Topology(2, 1, 2, 1, 1, WORLD)) {
        Communicator sharding;
        Communicator dp;
        try (HybridGroup hg = HybridGroup.create(comm, topo)) {
          sharding = hg.comm(Group.SHARDING);
          dp = hg.comm(Group.DP);
        }
        try (sharding; dp) {
          ByteBuffer s = direct(8);
          ByteBuffer d = direct(8);
          sharding.allReduce(longs(1L << r), s, DType.INT64, ReduceOp.SUM).await();
          dp.allReduce(longs(1L << r), d, DType.INT64, ReduceOp.SUM).await();
          long expect = 0;
          for (int q : topo.groupRanks(Group.SHARDING, r)) expect += 1L << q;
          return new long[] {s.getLong(0), d.getLong(0), expect};
        }
      }
    });
    long[] shard = {3, 3, 12, 12};
    long[] dpSums = {5, 10, 5, 10};
    for (int r = 0; r < WORLD; r++) {
      assertEquals(shard[r], res.get(r)[0]);
      assertEquals(dpSums[r], res.get(r)[1]);
      assertEquals(shard[r], res.get(r)[2]);
    }
  }

  /**
   * A store is used from several threads at once: closing it while another thread waits in
   * get (or creates a communicator over it) freed the native store under that wait (an
   * INTERNAL error, then the JVM crashed). The close now waits for the wait to end; abort()
   * ends it at once. The cleaner's destroy (an unreachable Store) waits the same way.
   */
  @Test
  void closingAStoreWaitsForCallsUnderWayOnOtherThreads() throws Exception {
    for (int mode = 0; mode < 3; mode++) {
      final boolean abortFirst = mode == 1, abortDuring = mode == 2;
      Store store = Store.open("memory://java-close-" + UUID.randomUUID(), 0);
      AtomicReference<Throwable> error = new AtomicReference<>();
      CountDownLatch entered = new CountDownLatch(1);
      Thread getter = new Thread(() -> {
        try {
          entered.countDown();
          store.get("never", 1500);
        } catch (Throwable t) {
          error.set(t);
        }
      });
      Thread creator = new Thread(() -> {
        try {
          // rank 1 never comes
          Communicator.create(store, 0, 2, new Communicator.Options().timeoutMs(1500)).close();
        } catch (Throwable t) {
          // TIMEOUT or ABORTED, checked through the getter's
        }
      });
      getter.start();
      creator.start();
      assertTrue(entered.await(10, TimeUnit.SECONDS));
      Thread.sleep(300);
      long start = System.nanoTime();
      if (abortFirst) store.abort();
      // From another thread while the close waits: it ends the calls (it threw: closed).
      Thread watchdog = new Thread(() -> {
        try {
          Thread.sleep(300);
          store.abort();
        } catch (Throwable t) {
          error.compareAndSet(null, t);
        }
      });
      if (abortDuring) watchdog.start();
      store.close();
      long tookMs = (System.nanoTime() - start) / 1_000_000;
      if (abortDuring) {
        watchdog.join(JOIN_MS);
        assertTrue(tookMs < 1200, "close returned after " + tookMs + " ms");
      }
      getter.join(JOIN_MS);
      assertFalse(getter.isAlive());
      HpsException e = assertInstanceOf(HpsException.class, error.get());
      assertEquals(mode == 0 ? TIMEOUT : ABORTED, e.status(), e.getMessage());
      if (mode == 0) assertTrue(tookMs >= 800, "close returned after " + tookMs + " ms");
      assertTrue(store.isClosed());
      assertThrows(IllegalStateException.class, () -> store.get("k", 10));
      creator.join(JOIN_MS);
      assertFalse(creator.isAlive());
    }
  }

  @Test
  void closingWorldClosesItsHybridGroups() throws Exception {
    runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r); Topology topo = new Topology(1, 1, 2, 1, 1, 2)) {
        Communicator comm = world(store, r, 2);
        HybridGroup hg = HybridGroup.create(comm, topo);
        comm.close();
        assertTrue(hg.isClosed());
        hg.close();
      }
      return null;
    });
  }

  @Test
  void badInputIsRefusedWithNothingSent() throws Exception {
    List<Long> sums = runRanks(WORLD, (r, url) -> {
      try (Store store = Store.open(url, r); Communicator comm = world(store, r, WORLD)) {
        ByteBuffer send = direct(32);
        ByteBuffer small = direct(32 * WORLD - 4);
        HpsException e = assertThrows(HpsException.class,
            () -> comm.allGather(send, small, DType.FLOAT32));
        assertEquals(INVALID_ARGUMENT, e.status());
        assertTrue(e.getMessage().contains("needs 32"), e.getMessage());
        ByteBuffer recv = direct(32);
        assertEquals(INVALID_ARGUMENT,
            status(() -> comm.h().allReduce(send, recv, 8, DType.FLOAT32.code(), 9, null)));
        assertEquals(OUT_OF_RANGE, status(() -> comm.broadcast(recv, DType.FLOAT32, WORLD)));
        assertEquals(INVALID_ARGUMENT, status(() -> comm.setTimeout(0)));
        // wrong size / kind of buffer: refused by the binding
        assertThrows(IllegalArgumentException.class,
            () -> comm.allReduce(send, direct(36), DType.FLOAT32, ReduceOp.SUM));
        assertThrows(IllegalArgumentException.class,
            () -> comm.allReduce(send, direct(30), DType.INT64, ReduceOp.SUM));
        assertThrows(IllegalArgumentException.class,
            () -> comm.allReduce(send, ByteBuffer.allocate(32), DType.FLOAT32, ReduceOp.SUM));
        assertThrows(IllegalArgumentException.class, () -> comm.allReduce(
            send, direct(32).asReadOnlyBuffer(), DType.FLOAT32, ReduceOp.SUM));
        java.nio.ByteOrder other = java.nio.ByteOrder.nativeOrder() == java.nio.ByteOrder.BIG_ENDIAN
            ? java.nio.ByteOrder.LITTLE_ENDIAN : java.nio.ByteOrder.BIG_ENDIAN;
        IllegalArgumentException order = assertThrows(IllegalArgumentException.class,
            () -> comm.allReduce(send, direct(32).order(other), DType.FLOAT32, ReduceOp.SUM));
        assertTrue(order.getMessage().contains("native order"), order.getMessage());
        assertThrows(IllegalArgumentException.class,
            () -> comm.h().allReduce(send, recv, 9, DType.FLOAT32.code(), 0, null));
        assertThrows(IllegalArgumentException.class,
            () -> comm.h().recv(direct(8).asReadOnlyBuffer(), 1, DType.INT64.code(), 0, null));
        assertThrows(NullPointerException.class,
            () -> comm.allReduce(send, recv, null, ReduceOp.SUM));
        ByteBuffer total = direct(8);
        comm.allReduce(longs(r), total, DType.INT64, ReduceOp.SUM).await();
        return total.getLong(0);
      }
    });
    assertEquals(Arrays.asList(6L, 6L, 6L, 6L), sums);
  }

  @Test
  void waitTimeoutWhenARankNeverJoins() throws Exception {
    CountDownLatch finished = new CountDownLatch(1);
    List<Integer> res = runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r); Communicator comm = world(store, r, 2)) {
        comm.setTimeout(200);
        if (r == 1) {
          assertTrue(finished.await(JOIN_MS, TimeUnit.MILLISECONDS));
          return null;
        }
        try (Work w = comm.allReduce(floats(1, 2), direct(8), DType.FLOAT32, ReduceOp.SUM)) {
          return status(w::await);
        } finally {
          finished.countDown();
        }
      }
    });
    assertEquals(TIMEOUT, res.get(0));
  }

  @Test
  void abortFromAnotherThread() throws Exception {
    CountDownLatch finished = new CountDownLatch(1);
    List<Integer> res = runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r); Communicator comm = world(store, r, 2)) {
        if (r == 1) {
          assertTrue(finished.await(JOIN_MS, TimeUnit.MILLISECONDS));
          return null;
        }
        Thread aborter = new Thread(() -> {
          try {
            Thread.sleep(100);
          } catch (InterruptedException e) {
            return;
          }
          comm.abort();
        });
        try (Work w = comm.allReduce(floats(1, 2), direct(8), DType.FLOAT32, ReduceOp.SUM)) {
          aborter.start();
          return status(w::await);
        } finally {
          finished.countDown();
          aborter.join(JOIN_MS);
        }
      }
    });
    assertEquals(ABORTED, res.get(0));
  }

  @Test
  void store() {
    String url = "memory://java-store-" + UUID.randomUUID();
    try (Store a = Store.open(url, 0, 1000); Store b = Store.open(url, 1)) {
      byte[] binary = {'a', 0, 'b', 0, (byte) 0xff};
      a.set("k", binary);
      assertArrayEquals(binary, b.get("k", 1000));
      byte[] big = new byte[3000];
      for (int i = 0; i < big.length; i++) big[i] = (byte) i;
      a.set("big", big);
      assertArrayEquals(big, b.get("big"));
      a.set("empty", new byte[0]);
      assertEquals(0, b.get("empty").length);
      a.set("text", "héllo");
      assertEquals("héllo", new String(a.get("text"), java.nio.charset.StandardCharsets.UTF_8));
      assertEquals(5, a.add("n", 5));
      assertEquals(3, b.add("n", -2));
      assertTrue(a.check("k"));
      assertFalse(a.check("missing"));
      a.await("k", 1000);
      HpsException e = assertThrows(HpsException.class, () -> a.await("missing", 50));
      assertEquals(TIMEOUT, e.status());
      assertTrue(e.getMessage().contains("missing"));
      assertEquals(TIMEOUT, status(() -> a.get("missing", 50)));
      assertEquals(INVALID_ARGUMENT, status(() -> a.get("k", 0)));
      assertThrows(NullPointerException.class, () -> a.set("k", (byte[]) null));
      a.close();
      assertTrue(a.isClosed());
      assertThrows(IllegalStateException.class, () -> a.get("k"));
    }
    assertEquals(INVALID_ARGUMENT, status(() -> Store.open("gopher://x", 0)));
  }

  @Test
  void rendezvousFromEnv() {
    // The JVM cannot set environment variables: without any, NOT_FOUND; with some, a value.
    String[] vars = {"HPS_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"};
    boolean any = false;
    for (String v : vars) any |= System.getenv(v) != null;
    if (any) {
      try {
        RendezvousInfo info = RendezvousInfo.fromEnv();
        assertTrue(info.worldSize() > info.rank() && info.rank() >= 0);
        assertNotNull(info.source());
      } catch (HpsException e) {
        assertEquals(INVALID_ARGUMENT, e.status());
      }
    } else {
      assertEquals(NOT_FOUND, status(RendezvousInfo::fromEnv));
    }
    assertEquals(HpshardNative.rendezvousStructSize(), RendezvousInfo.structSize());
    assertEquals(INVALID_ARGUMENT, status(() -> RendezvousInfo.structSize(3)));
  }

  @Test
  void commOptionsStruct() {
    hps_comm_options_t o = HpshardNative.commOptionsInit(HpshardNative.commOptionsStructSize());
    try {
      assertTrue(o.getTimeout_ms() > 0);
      o.setName("x".repeat(1000));
      assertEquals("x".repeat(1000), o.getName());
      o.setName(null);
      assertNull(o.getName());
    } finally {
      o.delete();
    }
    assertEquals(INVALID_ARGUMENT, status(() -> HpshardNative.commOptionsInit(3)));
  }

  static int formula(int[] c, int[] deg) {
    return (((c[0] * deg[1] + c[1]) * deg[2] + c[2]) * deg[3] + c[3]) * deg[4] + c[4];
  }

  @Test
  void topologyMatchesTheRankFormula() {
    int[][] shapes = {{2, 2, 2, 1, 1}, {1, 2, 1, 2, 2}, {3, 1, 2, 1, 2}, {2, 3, 1, 1, 2}};
    Group[] axes = {Group.DP, Group.PP, Group.SHARDING, Group.SEP, Group.MP};
    for (int[] deg : shapes) {
      int world = deg[0] * deg[1] * deg[2] * deg[3] * deg[4];
      try (Topology t = new Topology(deg[0], deg[1], deg[2], deg[3], deg[4], world)) {
        for (int k = 0; k < 5; k++) assertEquals(deg[k], t.degree(axes[k]));
        for (int rank = 0; rank < world; rank++) {
          int[] c = new int[5];
          for (int k = 0; k < 5; k++) c[k] = t.coordinate(rank, axes[k]);
          assertEquals(rank, formula(c, deg));
          assertEquals(rank, t.rankOf(c[0], c[1], c[2], c[3], c[4]));
          for (int k = 0; k < 5; k++) {
            int[] expect = new int[deg[k]];
            for (int v = 0; v < deg[k]; v++) {
              int[] cv = c.clone();
              cv[k] = v;
              expect[v] = formula(cv, deg);
            }
            Arrays.sort(expect);
            assertArrayEquals(expect, t.groupRanks(axes[k], rank));
          }
          int[] prev = c.clone();
          int[] next = c.clone();
          prev[1] = (c[1] + deg[1] - 1) % deg[1];
          next[1] = (c[1] + 1) % deg[1];
          assertEquals(new Topology.PipelineNeighbors(formula(prev, deg), formula(next, deg)),
              t.pipelineNeighbors(rank));
          assertEquals(world / deg[0], t.groupRanks(Group.CHECK, rank).length);
          assertEquals(world / deg[2], t.groupRanks(Group.SHARDING_CHECK, rank).length);
        }
      }
    }
  }

  @Test
  void topologyBadInput() {
    try (Topology t = new Topology(1, 1, 100, 1, 1, 100)) {
      int[] all = new int[100];
      for (int i = 0; i < 100; i++) all[i] = i;
      assertArrayEquals(all, t.groupRanks(Group.SHARDING, 42));
      assertEquals(OUT_OF_RANGE, status(() -> t.coordinate(100, Group.DP)));
      assertEquals(OUT_OF_RANGE, status(() -> t.rankOf(0, 0, 100, 0, 0)));
      assertEquals(INVALID_ARGUMENT, status(() -> t.degree(Group.CHECK)));
      assertEquals(OUT_OF_RANGE, status(() -> t.groupRanks(Group.DP, 100)));
      assertEquals(INVALID_ARGUMENT,
          status(() -> t.h().groupRanks(9, 0)));
    }
    try (Topology t = new Topology(1, 1, 2, 1, 2, 4, "mp,sharding,dp,pp,sep")) {
      assertArrayEquals(new int[] {0, 1}, t.groupRanks(Group.SHARDING, 0));
    }
    assertEquals(INVALID_ARGUMENT, status(() -> new Topology(2, 2, 1, 1, 1, 8)));
    Topology t = new Topology(1, 1, 1, 1, 1, 1);
    t.close();
    t.close();
    assertThrows(IllegalStateException.class, () -> t.degree(Group.DP));
  }

  // ---- device and transport --------------------------------------------------------------
  /**
   * What a group of {@code size} thread-ranks of this process uses: shared memory, unless it
   * is a single rank or HPS_COMM_SHM=0 (a non-zero integer keeps it on).
   */
  static String expectedTransport(int size) {
    String shm = System.getenv("HPS_COMM_SHM");
    if (size < 2 || (shm != null && !shm.isBlank() && Long.parseLong(shm.strip()) == 0)) {
      return "tcp";
    }
    return "shm";
  }

  @Test
  void deviceAndTransportOfCpuCommunicators() throws Exception {
    // A NULL store reaches the library, which refuses it.
    assertEquals(INVALID_ARGUMENT,
        status(() -> CommHandle.create(null, 0, 1, DeviceType.CPU.code(), 0, null)));
    List<String> transports = runRanks(2, (r, url) -> {
      try (Store store = Store.open(url, r, 10000); Communicator comm = world(store, r, 2)) {
        assertArrayEquals(new long[] {DeviceType.CPU.code(), 0}, comm.h().device());
        assertEquals(new Device(DeviceType.CPU, 0), comm.device());
        assertTrue(comm.device().isHost());
        assertEquals("cpu:0", comm.device().toString());
        assertEquals(expectedTransport(2), comm.transport());
        return comm.transport();
      }
    });
    assertEquals(List.of(expectedTransport(2), expectedTransport(2)), transports);
    try (Store store = Store.open("memory://java-single-" + UUID.randomUUID(), 0, 10000);
        Communicator comm = world(store, 0, 1)) {
      assertEquals(new Device(DeviceType.CPU, 0), comm.device());
      assertEquals("tcp", comm.transport()); // a group of one has no peer to share memory with
    }
  }
}
