package org.hpshard;

import java.util.concurrent.atomic.AtomicBoolean;

/**
 * Run by ctest under -Xcomp (java_reachability), not by JUnit: a communicator whose last use
 * is a blocking split() while another thread runs the GC. Compiled code may find the Java
 * object unreachable during the native call; its Cleaner must not destroy the handle under
 * that call (it did: the split failed on both ranks, "rank 0 destroyed its communicator
 * before joining"; Checkpoint.load crashed the JVM the same way). Exit 0: every split of
 * every round succeeded.
 */
public final class CleanerUnderCallMain {
  private CleanerUnderCallMain() {}

  private static Communicator splitOnce(String url, int rank) throws InterruptedException {
    Store store = Store.open(url, rank);
    Communicator world =
        Communicator.create(store, rank, 2, new Communicator.Options().timeoutMs(20000));
    if (rank == 1) Thread.sleep(300); // rank 0 waits inside split() meanwhile
    return world.split(new int[] {0, 1}, "sub"); // the last use of `world` (and `store`)
  }

  public static void main(String[] args) throws Exception {
    int rounds = Integer.parseInt(args[0]);
    AtomicBoolean stop = new AtomicBoolean();
    Thread gc = new Thread(() -> {
      while (!stop.get()) {
        System.gc();
        try {
          Thread.sleep(2);
        } catch (InterruptedException e) {
          return;
        }
      }
    });
    gc.setDaemon(true);
    gc.start();
    int failed = 0;
    for (int k = 0; k < rounds; k++) {
      String url = "memory://cleaner-under-call-" + ProcessHandle.current().pid() + "-" + k;
      Communicator[] sub = new Communicator[2];
      Throwable[] error = new Throwable[2];
      Thread[] ranks = new Thread[2];
      for (int r = 0; r < 2; r++) {
        final int rank = r;
        ranks[r] = new Thread(() -> {
          try {
            sub[rank] = splitOnce(url, rank);
          } catch (Throwable t) {
            error[rank] = t;
          }
        });
        ranks[r].start();
      }
      for (Thread t : ranks) t.join();
      for (int r = 0; r < 2; r++) {
        if (error[r] != null) {
          failed++;
          System.out.println("round " + k + " rank " + r + ": split threw " + error[r]);
        }
      }
      for (Communicator c : sub) {
        if (c != null) c.close();
      }
    }
    stop.set(true);
    System.out.println(rounds + " rounds, " + failed + " failed splits");
    System.exit(failed == 0 ? 0 : 1);
  }
}
