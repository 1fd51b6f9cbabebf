import java.nio.ByteBuffer;
import org.hpshard.Communicator;
import org.hpshard.Engine;
import org.hpshard.Hpshard;
import org.hpshard.NativeLibrary;
import org.hpshard.Store;

/** The Java consumer of an installed libhpshard-java: a one-rank engine step. */
public final class Consumer {
  public static void main(String[] args) {
    try (Store store = Store.open("memory://package-java", 0);
        Communicator comm = Communicator.create(store, 0, 1);
        Engine engine = Engine.create(comm, null, new Engine.Options().learningRate(0.5f))) {
      int w = engine.addParam("w", new long[] {2});
      engine.seal();
      engine.param(w).putFloat(0, 1f).putFloat(4, 1f);
      engine.broadcastParameters();
      engine.waitParameters(0);
      ByteBuffer g = engine.grad(w);
      g.putFloat(0, 2f).putFloat(4, 4f);
      engine.gradReady(w);
      engine.step();
      float[] got = engine.gatherParameter(w);
      if (got[0] != 0f || got[1] != -1f) {
        throw new AssertionError("stepped to " + got[0] + ", " + got[1]);
      }
    }
    System.out.println("java consumer: hpshard " + Hpshard.version() + ", JNI from "
        + NativeLibrary.load());
  }
}
