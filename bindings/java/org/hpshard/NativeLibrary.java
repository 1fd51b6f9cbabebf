package org.hpshard;

/**
 * Loads the JNI library (libhpshard_jni.so) once per class loader.
 *
 * <p>If the system property {@code hpshard.jni.path} is set, the library is loaded from that
 * absolute path; otherwise {@code System.loadLibrary("hpshard_jni")} searches
 * {@code java.library.path} (Debian's libhpshard-java installs it in /usr/lib/jni, which is
 * there), and then the directory the RPM package installs it in, which Fedora's JNI rule
 * puts outside that path ({@link #PACKAGED_PATHS}). The generated JNI class calls
 * {@link #load()} in its static initializer, so nothing else needs to.
 */
public final class NativeLibrary {
  /** System property naming the JNI library by absolute path. */
  public static final String PATH_PROPERTY = "hpshard.jni.path";
  /** Library name for System.loadLibrary. */
  public static final String LIBRARY_NAME = "hpshard_jni";
  /** Where packages install the library outside java.library.path (RPM: %{_libdir}/hpshard). */
  public static final String[] PACKAGED_PATHS = {"/usr/lib64/hpshard/libhpshard_jni.so"};

  private NativeLibrary() {}

  /** Initialised (and the library loaded) on first use, exactly once. */
  private static final class Holder {
    static final String LOADED_FROM = loadOnce();

    private static String loadOnce() {
      String path = System.getProperty(PATH_PROPERTY);
      if (path != null && !path.isEmpty()) {
        System.load(path);
        return path;
      }
      try {
        System.loadLibrary(LIBRARY_NAME);
        return System.mapLibraryName(LIBRARY_NAME);
      } catch (UnsatisfiedLinkError notOnThePath) {
        for (String packaged : PACKAGED_PATHS) {
          if (new java.io.File(packaged).isFile()) {
            System.load(packaged);
            return packaged;
          }
        }
        throw notOnThePath;
      }
    }
  }

  /** Loads the library if not loaded yet; returns where it was loaded from. */
  public static String load() {
    return Holder.LOADED_FROM;
  }
}
