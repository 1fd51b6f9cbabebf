import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.UUID;
import org.hpshard.Communicator;
import org.hpshard.DType;
import org.hpshard.Engine;
import org.hpshard.Hpshard;
import org.hpshard.ReduceOp;
import org.hpshard.Store;

/**
 * A small version of the main job (examples/c/train_mlp.c) through the Java binding: a 2-layer
 * MLP whose forward and backward are written here over the engine's parameter and gradient
 * views (direct ByteBuffers), trained with stage 2 over 2 thread-ranks of this process beside
 * an unsharded single-process reference. Prints both losses and the host syncs per step;
 * exits non-zero when they differ by more than 1e-4 relative or a step synced.
 *
 * <pre>java -cp ... TrainMlp [--steps N]</pre>
 */
public final class TrainMlp {
  static final int IN = 8, HIDDEN = 16, OUT = 1, BATCH = 32, RANKS = 2;
  static final float LR = 0.05f, MOMENTUM = 0.9f;
  static final String[] NAMES = {"layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias"};
  static final int[] SIZES = {IN * HIDDEN, HIDDEN, HIDDEN * OUT, OUT};
  static final long[][] SHAPES = {{IN, HIDDEN}, {HIDDEN}, {HIDDEN, OUT}, {OUT}};
  static final int[] UNITS = {0, 0, 1, 1};

  /** Parameters and gradients: views (ByteBuffer) or plain arrays, one interface. */
  interface Tensor {
    float get(int i);

    void set(int i, float v);

    default void add(int i, float v) {
      set(i, get(i) + v);
    }
  }

  static Tensor of(ByteBuffer b) {
    return new Tensor() {
      public float get(int i) {
        return b.getFloat(4 * i);
      }

      public void set(int i, float v) {
        b.putFloat(4 * i, v);
      }
    };
  }

  static Tensor of(float[] a) {
    return new Tensor() {
      public float get(int i) {
        return a[i];
      }

      public void set(int i, float v) {
        a[i] = v;
      }
    };
  }

  static void sample(int j, float[] x, float[] y) {
    double t = 0.1 * Math.sin(j);
    for (int k = 0; k < IN; k++) {
      x[k] = (float) Math.sin(0.37 * j + 0.91 * k);
      t += x[k] * ((k % 3) - 1) * 0.5;
    }
    y[0] = (float) Math.tanh(t);
  }

  static float initial(int p, int i) {
    if (p % 2 == 1) return 0f; // biases
    return (float) (0.3 * Math.sin(1.7 * i + NAMES[p].length()) / Math.sqrt(SHAPES[p][0]));
  }

  /** Adds the gradient of the mean loss over samples [first, first + count) into g; returns it. */
  static double forwardBackward(Tensor[] p, Tensor[] g, int step, int first, int count) {
    float[] x = new float[IN], y = new float[1], h = new float[HIDDEN], dh = new float[HIDDEN];
    double loss = 0;
    for (int s = first; s < first + count; s++) {
      sample(step * BATCH + s, x, y);
      for (int o = 0; o < HIDDEN; o++) {
        float z = p[1].get(o);
        for (int i = 0; i < IN; i++) z += x[i] * p[0].get(i * HIDDEN + o);
        h[o] = (float) Math.tanh(z);
      }
      float out = p[3].get(0);
      for (int i = 0; i < HIDDEN; i++) out += h[i] * p[2].get(i);
      float diff = out - y[0];
      loss += 0.5 * diff * diff / count;
      float dOut = diff / count;
      g[3].add(0, dOut);
      for (int i = 0; i < HIDDEN; i++) {
        g[2].add(i, h[i] * dOut);
        dh[i] = p[2].get(i) * dOut * (1f - h[i] * h[i]);
      }
      for (int o = 0; o < HIDDEN; o++) {
        g[1].add(o, dh[o]);
        for (int i = 0; i < IN; i++) g[0].add(i * HIDDEN + o, x[i] * dh[o]);
      }
    }
    return loss;
  }

  /** Unsharded SGD with momentum (torch.optim.SGD rules), the full batch, one process. */
  static final class Reference {
    final float[][] p = new float[4][], g = new float[4][], buf = new float[4][];
    int steps;

    Reference() {
      for (int k = 0; k < 4; k++) {
        p[k] = new float[SIZES[k]];
        g[k] = new float[SIZES[k]];
        buf[k] = new float[SIZES[k]];
        for (int i = 0; i < SIZES[k]; i++) p[k][i] = initial(k, i);
      }
    }

    double step(int step) {
      Tensor[] pt = new Tensor[4], gt = new Tensor[4];
      for (int k = 0; k < 4; k++) {
        pt[k] = of(p[k]);
        gt[k] = of(g[k]);
      }
      double loss = forwardBackward(pt, gt, step, 0, BATCH);
      steps++;
      for (int k = 0; k < 4; k++) {
        for (int i = 0; i < SIZES[k]; i++) {
          buf[k][i] = steps == 1 ? g[k][i] : MOMENTUM * buf[k][i] + g[k][i];
          p[k][i] -= LR * buf[k][i];
          g[k][i] = 0;
        }
      }
      return loss;
    }
  }

  static void rank(int rank, String url, int steps, List<String> failures) {
    try (Store store = Store.open(url, rank, 30000);
        Communicator world = Communicator.create(store, rank, RANKS,
            new Communicator.Options().timeoutMs(60000));
        Engine engine = Engine.create(world, null,
            new Engine.Options().learningRate(LR).momentum(MOMENTUM))) {
      int[] index = new int[4];
      for (int k = 0; k < 4; k++) {
        index[k] = engine.addParam(NAMES[k], SHAPES[k], DType.FLOAT32, false, false, true, false,
            UNITS[k]);
      }
      engine.seal();
      for (int k = 0; k < 4; k++) {
        Tensor t = of(engine.param(index[k])); // a view over the engine's memory
        for (int i = 0; i < SIZES[k]; i++) t.set(i, rank == 0 ? initial(k, i) : 0f);
      }
      engine.broadcastParameters(); // rank 0's initial values everywhere
      Reference ref = rank == 0 ? new Reference() : null;
      if (rank == 0) {
        System.out.printf("hpshard %s: stage 2 over %d thread-ranks, SGD+momentum, MLP %d-%d-%d,"
            + " batch %d; %d bytes resident on rank 0%n", Hpshard.version(), RANKS, IN, HIDDEN,
            OUT, BATCH, engine.residentBytes());
        System.out.printf("%5s  %14s  %14s  %10s  %s%n", "step", "loss (sharded)",
            "loss (1 rank)", "rel diff", "host syncs in step");
      }
      int perRank = BATCH / RANKS;
      ByteBuffer send = ByteBuffer.allocateDirect(8).order(java.nio.ByteOrder.nativeOrder());
      ByteBuffer total = ByteBuffer.allocateDirect(8).order(java.nio.ByteOrder.nativeOrder());
      for (int step = 0; step < steps; step++) {
        Hpshard.hostSyncReset();
        engine.waitParameters(0);
        engine.waitParameters(1);
        Tensor[] p = new Tensor[4], g = new Tensor[4];
        for (int k = 0; k < 4; k++) { // views, fetched after the wait (as stage 3 needs)
          p[k] = of(engine.param(index[k]));
          g[k] = of(engine.grad(index[k]));
        }
        double local = forwardBackward(p, g, step, rank * perRank, perRank);
        for (int k = 3; k >= 0; k--) engine.gradReady(index[k]); // backward order
        engine.releaseParameters(1);
        engine.releaseParameters(0);
        engine.step();
        long syncs = Hpshard.hostSyncCountThread();
        // Reporting only (outside the step): the global loss.
        send.putDouble(0, local);
        try (var w = world.allReduce(send, total, DType.FLOAT64, ReduceOp.SUM)) {
          w.await();
        }
        double global = total.getDouble(0) / RANKS;
        if (rank == 0) {
          double r = ref.step(step);
          double rel = Math.abs(global - r) / Math.max(Math.abs(r), 1e-30);
          System.out.printf("%5d  %14.8f  %14.8f  %10.2e  %d%n", step, global, r, rel, syncs);
          if (rel > 1e-4 || syncs != 0) {
            failures.add("step " + step + ": rel diff " + rel + ", " + syncs + " host syncs");
          }
        }
      }
      engine.synchronize();
      if (rank == 0) {
        long[] waits = Engine.dependencyWaitStats();
        System.out.printf("dependency waits: %d, %.3f ms%n", waits[0], waits[1] / 1e6);
      }
    }
  }

  public static void main(String[] args) throws Exception {
    int steps = 6;
    for (int a = 0; a < args.length; a++) {
      if (args[a].equals("--steps") && a + 1 < args.length) {
        steps = Integer.parseInt(args[++a]);
      } else {
        System.err.println("usage: TrainMlp [--steps N]");
        System.exit(2);
      }
    }
    String url = "memory://java-train-mlp-" + UUID.randomUUID();
    List<String> failures = Collections.synchronizedList(new ArrayList<>());
    final int n = steps;
    Thread[] threads = new Thread[RANKS];
    for (int r = 0; r < RANKS; r++) {
      final int rank = r;
      threads[r] = new Thread(() -> {
        try {
          rank(rank, url, n, failures);
        } catch (Throwable t) {
          failures.add("rank " + rank + ": " + t);
        }
      }, "rank" + r);
      threads[r].setDaemon(true);
      threads[r].start();
    }
    for (Thread t : threads) t.join(120000);
    for (Thread t : threads) {
      if (t.isAlive()) failures.add(t.getName() + " still running after 120 s");
    }
    if (!failures.isEmpty()) {
      for (String f : failures) System.err.println(f);
      System.err.println("sharded training diverged from the unsharded run, or a step synced");
      System.exit(1);
    }
    System.out.println("sharded and unsharded losses agree; no host sync in any step");
  }
}
