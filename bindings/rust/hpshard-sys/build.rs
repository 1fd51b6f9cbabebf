// Link against libhpshard.so. The bindings themselves are pre-generated and checked
// in (src/bindings.rs, see regenerate.sh), so this script never runs bindgen.
//
// HPSHARD_LIB_DIR: the directory holding libhpshard.so (the CMake build passes
// $<TARGET_FILE_DIR:hpshard>). When unset, the system library directories are used
// (an installed libhpshard-dev).
use std::env;

fn main() {
    println!("cargo:rerun-if-env-changed=HPSHARD_LIB_DIR");
    println!("cargo:rerun-if-changed=build.rs");
    if let Some(dir) = env::var_os("HPSHARD_LIB_DIR") {
        if !dir.is_empty() {
            let dir = dir.to_string_lossy().into_owned();
            println!("cargo:rustc-link-search=native={}", dir);
            // For dependents' build scripts (DEP_HPSHARD_LIB_DIR).
            println!("cargo:lib_dir={}", dir);
        }
    }
    println!("cargo:rustc-link-lib=dylib=hpshard");
}
