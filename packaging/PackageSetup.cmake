# CPack setup for hpshard: one .deb and one .rpm per install component.
#
#   component  Debian package           RPM package             contents
#   runtime    libhpshard<major>        libhpshard<major>       libhpshard.so.<major>, .so.<version>
#   dev        libhpshard-dev           libhpshard-devel        headers, libhpshard.so, .pc, CMake files
#   tools      hpshard-tools            hpshard-tools           hpshard-run, -bench, -ckpt, -trace
#   python     python3-hpshard          python3-hpshard         the module hpshard
#   java       libhpshard-java          libhpshard-java         hpshard.jar, the JNI library
#   rust_sys   librust-hpshard-sys-dev  rust-hpshard-sys-devel  the hpshard-sys crate, as source
#   rust       librust-hpshard-dev      rust-hpshard-devel      the hpshard crate, as source
#
# The runtime package holds the library only, so libraries of two SONAMEs install side by
# side. The build installs in the Debian layout (lib/, lib/jni, lib/python3/dist-packages,
# byte-compiled on install by the python package's maintainer scripts); the RPM packages
# get the Fedora/RHEL layout (lib64, the interpreter's site-packages with the module's
# bytecode in the package, ldconfig scriptlets) from rpm_layout.cmake. The crates go where Debian and Fedora put Rust library crates,
# share/cargo/registry/<crate>-<version>. python, java and the crates are packaged only
# when those components have install rules (the bindings were configured). No package
# depends on CUDA or NCCL: libhpshard links the CUDA runtime statically and loads the
# driver at run time.
#
#   cpack -G DEB   (or RPM) in the build directory; files land in CPACK_PACKAGE_DIRECTORY.

set(HPS_PACKAGE_MAINTAINER "hpshard maintainers <hpshard-maintainers@example.org>"
    CACHE STRING "Maintainer/vendor written into the .deb and .rpm packages")
set(HPS_PACKAGE_HOMEPAGE "" CACHE STRING "Homepage written into the packages (optional)")
set(HPS_PACKAGE_RELEASE 1 CACHE STRING "Package release (Debian revision / RPM release)")
set(HPS_PACKAGE_LICENSE "Apache-2.0" CACHE STRING "License tag of the RPM packages (LICENSE)")
mark_as_advanced(HPS_PACKAGE_MAINTAINER HPS_PACKAGE_HOMEPAGE HPS_PACKAGE_RELEASE
                 HPS_PACKAGE_LICENSE)

set(HPS_PKG_RUNTIME "libhpshard${PROJECT_VERSION_MAJOR}")
set(HPS_PKG_DEV_DEB "libhpshard-dev")
set(HPS_PKG_DEV_RPM "libhpshard-devel")
set(HPS_PKG_PYTHON "python3-hpshard")
set(HPS_PKG_JAVA "libhpshard-java")
set(HPS_PKG_TOOLS "hpshard-tools")
set(HPS_PKG_RUST_SYS_DEB "librust-hpshard-sys-dev")
set(HPS_PKG_RUST_SYS_RPM "rust-hpshard-sys-devel")
set(HPS_PKG_RUST_DEB "librust-hpshard-dev")
set(HPS_PKG_RUST_RPM "rust-hpshard-devel")
set(HPS_PKG_FULL_VERSION "${PROJECT_VERSION}-${HPS_PACKAGE_RELEASE}")

# ---- which components to package --------------------------------------------------
# packaging/ is added last by the top-level CMakeLists.txt, so every install rule of
# the project (bindings included) is known here.
get_cmake_property(_hps_all_components COMPONENTS)
set(_hps_components "")
foreach(c IN ITEMS runtime dev tools python java rust_sys rust)
  if(c IN_LIST _hps_all_components)
    list(APPEND _hps_components ${c})
  endif()
endforeach()
set(HPS_CPACK_COMPONENTS "${_hps_components}" CACHE INTERNAL "Components packaged by CPack")

# ---- the licence, in every package ---------------------------------------------------
# Debian: /usr/share/doc/<package>/copyright (policy 12.5; machine-readable, pointing at
# common-licenses). rpm_layout.cmake turns it into the RPM's %license file
# /usr/share/licenses/<package>/LICENSE, the full text (LICENSE at the top of the tree).
set(_hps_deb_names_runtime "${HPS_PKG_RUNTIME}")
set(_hps_deb_names_dev "${HPS_PKG_DEV_DEB}")
set(_hps_deb_names_tools "${HPS_PKG_TOOLS}")
set(_hps_deb_names_python "${HPS_PKG_PYTHON}")
set(_hps_deb_names_java "${HPS_PKG_JAVA}")
set(_hps_deb_names_rust_sys "${HPS_PKG_RUST_SYS_DEB}")
set(_hps_deb_names_rust "${HPS_PKG_RUST_DEB}")
set(_hps_rpm_names_runtime "${HPS_PKG_RUNTIME}")
set(_hps_rpm_names_dev "${HPS_PKG_DEV_RPM}")
set(_hps_rpm_names_tools "${HPS_PKG_TOOLS}")
set(_hps_rpm_names_python "${HPS_PKG_PYTHON}")
set(_hps_rpm_names_java "${HPS_PKG_JAVA}")
set(_hps_rpm_names_rust_sys "${HPS_PKG_RUST_SYS_RPM}")
set(_hps_rpm_names_rust "${HPS_PKG_RUST_RPM}")
set(_hps_doc_to_rpm "")
# Debian: /usr/share/doc/<package>/changelog.Debian.gz too (policy 12.7), compressed with
# gzip -9n (no name, no time stamp); dated SOURCE_DATE_EPOCH when set, else at configure
# time. The RPMs drop it (rpm_layout.cmake).
string(TIMESTAMP _hps_changelog_date "%a, %d %b %Y %H:%M:%S +0000" UTC)
set(_hps_changelog "${PROJECT_BINARY_DIR}/packaging/changelog.Debian")
file(WRITE "${_hps_changelog}"
     "hpshard (${HPS_PKG_FULL_VERSION}) unstable; urgency=medium\n\n"
     "  * Upstream release ${PROJECT_VERSION}.\n\n"
     " -- ${HPS_PACKAGE_MAINTAINER}  ${_hps_changelog_date}\n")
find_program(HPS_GZIP gzip)
mark_as_advanced(HPS_GZIP)
set(_hps_changelog_gz "")
if(HPS_GZIP)
  execute_process(COMMAND "${HPS_GZIP}" -9nf "${_hps_changelog}" RESULT_VARIABLE _hps_gz_rc)
  if(_hps_gz_rc EQUAL 0)
    set(_hps_changelog_gz "${_hps_changelog}.gz")
  endif()
endif()
foreach(c IN LISTS _hps_components)
  install(FILES "${CMAKE_CURRENT_LIST_DIR}/debian/copyright" ${_hps_changelog_gz}
          DESTINATION "${CMAKE_INSTALL_DATAROOTDIR}/doc/${_hps_deb_names_${c}}"
          COMPONENT ${c})
  list(APPEND _hps_doc_to_rpm "${_hps_deb_names_${c}}=${_hps_rpm_names_${c}}")
endforeach()
# The tools' guides, beside their licence: what hpshard-bench measures and how to read its
# figures (its help names benchmarks.md), and the checkpoint format hpshard-ckpt reads.
if("tools" IN_LIST _hps_components)
  install(FILES "${PROJECT_SOURCE_DIR}/docs/benchmarks.md" "${PROJECT_SOURCE_DIR}/docs/checkpoints.md"
          DESTINATION "${CMAKE_INSTALL_DATAROOTDIR}/doc/${_hps_deb_names_tools}" COMPONENT tools)
  install(FILES "${PROJECT_SOURCE_DIR}/docs/img/coll.png" "${PROJECT_SOURCE_DIR}/docs/img/clip.png"
                "${PROJECT_SOURCE_DIR}/docs/img/clip-avx512.png" "${PROJECT_SOURCE_DIR}/docs/img/step.png"
                "${PROJECT_SOURCE_DIR}/docs/img/scale.png"
          DESTINATION "${CMAKE_INSTALL_DATAROOTDIR}/doc/${_hps_deb_names_tools}/img" COMPONENT tools)
endif()

# ---- common ---------------------------------------------------------------------
set(CPACK_GENERATOR "DEB;RPM")
set(CPACK_SOURCE_GENERATOR "")
set(CPACK_PACKAGE_NAME "hpshard")
set(CPACK_PACKAGE_VENDOR "${HPS_PACKAGE_MAINTAINER}")
set(CPACK_PACKAGE_CONTACT "${HPS_PACKAGE_MAINTAINER}")
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_PACKAGE_VERSION_MAJOR "${PROJECT_VERSION_MAJOR}")
set(CPACK_PACKAGE_VERSION_MINOR "${PROJECT_VERSION_MINOR}")
set(CPACK_PACKAGE_VERSION_PATCH "${PROJECT_VERSION_PATCH}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
if(HPS_PACKAGE_HOMEPAGE)
  set(CPACK_PACKAGE_HOMEPAGE_URL "${HPS_PACKAGE_HOMEPAGE}")
endif()
set(CPACK_PACKAGING_INSTALL_PREFIX "/usr")
set(CPACK_PACKAGE_DIRECTORY "${PROJECT_BINARY_DIR}/packages")
set(CPACK_COMPONENTS_ALL ${_hps_components})
set(CPACK_COMPONENTS_GROUPING IGNORE)   # one package per component
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_RPM_COMPONENT_INSTALL ON)
set(CPACK_VERBATIM_VARIABLES ON)
set(CPACK_STRIP_FILES ON)              # as dh_strip / rpm's brp-strip would
set(CPACK_PACKAGE_RELOCATABLE OFF)     # hpshard.pc names the prefix (/usr)
set(CPACK_PROJECT_CONFIG_FILE "${CMAKE_CURRENT_LIST_DIR}/CPackProjectConfig.cmake")

# Debian: each package's Description starts with its own synopsis line (see
# CPackProjectConfig.cmake, which keeps CPack from prepending the project summary).
set(_hps_syn "hpshard sharded data-parallel training runtime")
# Extended descriptions: lines of at most 80 characters (Debian policy 3.4.1), each its own.
set(_hps_long "hpshard is a runtime for sharded data-parallel and hybrid-parallel training\nwith a stable C API.")
set(_hps_tools_text "This package contains the launcher hpshard-run, the benchmark hpshard-bench,\nthe checkpoint tool hpshard-ckpt and the timeline tool hpshard-trace.")
set(CPACK_COMPONENT_RUNTIME_DISPLAY_NAME "hpshard runtime library")
set(CPACK_COMPONENT_DEV_DISPLAY_NAME "hpshard development files")
set(CPACK_COMPONENT_PYTHON_DISPLAY_NAME "hpshard Python 3 binding")
set(CPACK_COMPONENT_JAVA_DISPLAY_NAME "hpshard Java binding")
set(CPACK_COMPONENT_TOOLS_DISPLAY_NAME "hpshard tools")
set(CPACK_COMPONENT_RUST_SYS_DISPLAY_NAME "hpshard-sys Rust crate")
set(CPACK_COMPONENT_RUST_DISPLAY_NAME "hpshard Rust crate")
set(CPACK_COMPONENT_DEV_DEPENDS runtime)
set(CPACK_COMPONENT_PYTHON_DEPENDS runtime)
set(CPACK_COMPONENT_JAVA_DEPENDS runtime)
set(CPACK_COMPONENT_TOOLS_DEPENDS runtime)
set(CPACK_COMPONENT_RUST_SYS_DEPENDS dev)
set(CPACK_COMPONENT_RUST_DEPENDS rust_sys)

# ---- Debian -----------------------------------------------------------------------
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)     # <name>_<version>-<release>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_RELEASE "${HPS_PACKAGE_RELEASE}")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${HPS_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_COMPRESSION_TYPE xz)
set(CPACK_DEBIAN_ENABLE_COMPONENT_DEPENDS OFF)  # explicit, versioned Depends below
if(HPS_PACKAGE_HOMEPAGE)
  set(CPACK_DEBIAN_PACKAGE_HOMEPAGE "${HPS_PACKAGE_HOMEPAGE}")
endif()

# A Debian package's own maintainer scripts (and triggers), named as dpkg wants them in the
# control archive: debian/PREFIX.FILE, or debian/PREFIX.FILE.in with its @VARIABLES@ (the
# caller's) filled in. CPack then writes none of its own for COMPONENT. Scripts 0755,
# triggers 0644 (strict permissions).
set(_hps_deb_sources "${CMAKE_CURRENT_LIST_DIR}/debian")
function(hps_deb_control component prefix)
  string(TOUPPER "${component}" upper)
  set(extra "")
  foreach(file IN LISTS ARGN)
    set(in "${_hps_deb_sources}/${prefix}.${file}")
    set(out "${PROJECT_BINARY_DIR}/packaging/debian-${component}/${file}")
    if(EXISTS "${in}.in")
      set(how @ONLY)
      string(APPEND in ".in")
    else()
      set(how COPYONLY)
    endif()
    configure_file("${in}" "${out}" ${how}
                   FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ
                                    GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
    list(APPEND extra "${out}")
  endforeach()
  set(CPACK_DEBIAN_${upper}_PACKAGE_CONTROL_EXTRA "${extra}" PARENT_SCOPE)
  set(CPACK_DEBIAN_${upper}_PACKAGE_CONTROL_STRICT_PERMISSION ON PARENT_SCOPE)
endfunction()

set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME "${HPS_PKG_RUNTIME}")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_RUNTIME_DESCRIPTION
    "${_hps_syn} - shared library\n${_hps_long}\nThis package contains the shared library libhpshard.so.${PROJECT_VERSION_MAJOR}.")
# Depends from dpkg-shlibdeps: libc6, libstdc++6, libgcc-s1, libgloo0 and libssl3 (libcrypto,
# the TCP store's HMAC); CUDA is linked statically.
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
# A shlibs file so that other packages' shlibdeps resolve it. (Only the runtime package holds
# a library with a SONAME; dev's .so is a symlink.)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
# The linker cache through the ldconfig trigger (Debian policy 8.1.1): CPack would call
# ldconfig from generated maintainer scripts, which these (that do nothing) replace.
hps_deb_control(runtime libhpshard triggers postinst postrm)

set(CPACK_DEBIAN_DEV_PACKAGE_NAME "${HPS_PKG_DEV_DEB}")
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
# hpshard.h includes <dlpack/dlpack.h>.
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS
    "${HPS_PKG_RUNTIME} (= ${HPS_PKG_FULL_VERSION}), libdlpack-dev")
set(CPACK_DEBIAN_DEV_DESCRIPTION
    "${_hps_syn} - development files\n${_hps_long}\nThis package contains the C headers, the libhpshard.so link, the pkg-config\nfile and the CMake package (hpshard::hpshard).")

set(CPACK_DEBIAN_TOOLS_PACKAGE_NAME "${HPS_PKG_TOOLS}")
set(CPACK_DEBIAN_TOOLS_PACKAGE_SECTION utils)
set(CPACK_DEBIAN_TOOLS_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_TOOLS_PACKAGE_DEPENDS "${HPS_PKG_RUNTIME} (= ${HPS_PKG_FULL_VERSION})")
# hpshard-bench's torch family and --plot run Python scripts (installed in share/hpshard/bench).
set(CPACK_DEBIAN_TOOLS_PACKAGE_SUGGESTS "${HPS_PKG_PYTHON}, python3-torch, python3-matplotlib")
set(CPACK_DEBIAN_TOOLS_DESCRIPTION
    "${_hps_syn} - tools\n${_hps_long}\n${_hps_tools_text}")
# The bench's Python scripts: a __pycache__ a run of them as root wrote beside them goes
# with the package (hpshard-bench writes none: it sets PYTHONDONTWRITEBYTECODE).
set(HPS_DEB_BENCH_PARENT "${CPACK_PACKAGING_INSTALL_PREFIX}/${CMAKE_INSTALL_DATADIR}/hpshard")
set(HPS_DEB_BENCH_DIR "${HPS_DEB_BENCH_PARENT}/bench")
hps_deb_control(tools hpshard-tools prerm postrm)

# The crates as Debian ships Rust library crates (dh-cargo's librust-<crate>-dev).
set(CPACK_DEBIAN_RUST_SYS_PACKAGE_NAME "${HPS_PKG_RUST_SYS_DEB}")
set(CPACK_DEBIAN_RUST_SYS_PACKAGE_SECTION rust)
set(CPACK_DEBIAN_RUST_SYS_PACKAGE_ARCHITECTURE all)
set(CPACK_DEBIAN_RUST_SYS_PACKAGE_DEPENDS "${HPS_PKG_DEV_DEB} (= ${HPS_PKG_FULL_VERSION})")
set(CPACK_DEBIAN_RUST_SYS_DESCRIPTION
    "${_hps_syn} - Rust FFI crate hpshard-sys\n${_hps_long}\nThis package contains the source of the Rust crate hpshard-sys (the raw\nbindings of hpshard.h) for offline cargo builds.")
set(CPACK_DEBIAN_RUST_PACKAGE_NAME "${HPS_PKG_RUST_DEB}")
set(CPACK_DEBIAN_RUST_PACKAGE_SECTION rust)
set(CPACK_DEBIAN_RUST_PACKAGE_ARCHITECTURE all)
set(CPACK_DEBIAN_RUST_PACKAGE_DEPENDS "${HPS_PKG_RUST_SYS_DEB} (= ${HPS_PKG_FULL_VERSION})")
set(CPACK_DEBIAN_RUST_DESCRIPTION
    "${_hps_syn} - Rust crate hpshard\n${_hps_long}\nThis package contains the source of the Rust crate hpshard (the safe wrapper)\nfor offline cargo builds.")

set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME "${HPS_PKG_PYTHON}")
set(CPACK_DEBIAN_PYTHON_PACKAGE_SECTION python)
# The extension module is built for one Python 3.X ABI (its .cpython-3X-*.so name), so
# the package is tied to that minor version, as dh_python3's python3:Depends would do.
set(_hps_py_deb "python3")
set(_hps_py_rpm "python3")
if("python" IN_LIST _hps_components)
  find_package(Python3 COMPONENTS Interpreter QUIET)   # the binding's Python3_EXECUTABLE
  if(Python3_FOUND)
    math(EXPR _hps_py_next "${Python3_VERSION_MINOR} + 1")
    set(_hps_py_mm "${Python3_VERSION_MAJOR}.${Python3_VERSION_MINOR}")
    set(_hps_py_deb "python3 (>= ${_hps_py_mm}), python3 (<< ${Python3_VERSION_MAJOR}.${_hps_py_next})")
    set(_hps_py_rpm "python(abi) = ${_hps_py_mm}")
  endif()
endif()
set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS
    "${HPS_PKG_RUNTIME} (= ${HPS_PKG_FULL_VERSION}), ${_hps_py_deb}, python3-numpy")
# The extension module's own Depends (libc6, libstdc++6) from dpkg-shlibdeps, which finds
# libhpshard.so.N in the build tree (its package is named in Depends above).
set(CPACK_DEBIAN_PYTHON_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS "${PROJECT_BINARY_DIR}/capi")
# hpshard.torch, the PyTorch adapter, needs it.
set(CPACK_DEBIAN_PYTHON_PACKAGE_SUGGESTS "python3-torch")
set(CPACK_DEBIAN_PYTHON_DESCRIPTION
    "${_hps_syn} - Python 3 binding\n${_hps_long}\nThis package contains the Python 3 module hpshard.")
# Byte-compiled on install, __pycache__ removed on remove and purge (dh_python3's way).
if("python" IN_LIST _hps_components)
  set(HPS_DEB_PYTHON_PACKAGE_DIR "${CPACK_PACKAGING_INSTALL_PREFIX}/${HPS_PYTHON_INSTALL_DIR}/hpshard")
  hps_deb_control(python python3-hpshard postinst prerm postrm)
endif()

set(CPACK_DEBIAN_JAVA_PACKAGE_NAME "${HPS_PKG_JAVA}")
set(CPACK_DEBIAN_JAVA_PACKAGE_SECTION java)
# A Java library depends on no runtime (Debian's Java policy); the JNI library's own
# Depends (libc6, libstdc++6) come from dpkg-shlibdeps.
set(CPACK_DEBIAN_JAVA_PACKAGE_DEPENDS "${HPS_PKG_RUNTIME} (= ${HPS_PKG_FULL_VERSION})")
set(CPACK_DEBIAN_JAVA_PACKAGE_SHLIBDEPS ON)
# No ldconfig: CPack calls it from scripts of its own for any library under usr/lib/*,
# /usr/lib/jni included, which the linker does not search; these do nothing instead.
hps_deb_control(java libhpshard-java postinst postrm)
set(CPACK_DEBIAN_JAVA_DESCRIPTION
    "${_hps_syn} - Java binding\n${_hps_long}\nThis package contains hpshard.jar and its JNI library.")

# ---- RPM --------------------------------------------------------------------------
set(CPACK_RPM_FILE_NAME RPM-DEFAULT)        # <name>-<version>-<release>.<arch>.rpm
set(CPACK_RPM_PACKAGE_RELEASE "${HPS_PACKAGE_RELEASE}")
set(CPACK_RPM_PACKAGE_LICENSE "${HPS_PACKAGE_LICENSE}")
set(CPACK_RPM_PACKAGE_VENDOR "${HPS_PACKAGE_MAINTAINER}")
if(HPS_PACKAGE_HOMEPAGE)
  set(CPACK_RPM_PACKAGE_URL "${HPS_PACKAGE_HOMEPAGE}")
endif()
set(CPACK_RPM_COMPRESSION_TYPE xz)
# rpm's dependency generators: Requires of the ELF files (glibc, libstdc++, and the
# JNI/Python modules' libhpshard.so.N, which the runtime package Provides).
set(CPACK_RPM_PACKAGE_AUTOREQ ON)
set(CPACK_RPM_PACKAGE_AUTOPROV ON)
# The Fedora/RHEL layout (rpm_layout.cmake moves the staged files there): %{_libdir}
# (lib64 on x86_64), Fedora's JNI directory %{_libdir}/hpshard, %{python3_sitearch}.
set(HPS_RPM_LIBDIR "lib64" CACHE STRING "The RPM packages' library directory (%{_libdir})")
mark_as_advanced(HPS_RPM_LIBDIR)
set(_hps_rpm_python_dir "${HPS_RPM_LIBDIR}/python3/site-packages")
if(Python3_FOUND)
  set(_hps_rpm_python_dir "${HPS_RPM_LIBDIR}/python${_hps_py_mm}/site-packages")
endif()
set(CPACK_PRE_BUILD_SCRIPTS "${CMAKE_CURRENT_LIST_DIR}/rpm_layout.cmake")
set(CPACK_HPS_LIBDIR "${CMAKE_INSTALL_LIBDIR}")
set(CPACK_HPS_RPM_LIBDIR "${HPS_RPM_LIBDIR}")
set(CPACK_HPS_PYTHON_DIR "${HPS_PYTHON_INSTALL_DIR}")
set(CPACK_HPS_RPM_PYTHON_DIR "${_hps_rpm_python_dir}")
set(CPACK_HPS_PYTHON_EXECUTABLE "")
if(Python3_FOUND)
  set(CPACK_HPS_PYTHON_EXECUTABLE "${Python3_EXECUTABLE}")  # the binding's, its bytecode
endif()
set(CPACK_HPS_DOC_TO_RPM "${_hps_doc_to_rpm}")
set(CPACK_HPS_DATAROOTDIR "${CMAKE_INSTALL_DATAROOTDIR}")
set(CPACK_HPS_LICENSE_FILE "${PROJECT_SOURCE_DIR}/LICENSE")
foreach(c IN LISTS _hps_components)  # the licence rpm_layout.cmake puts there
  string(TOUPPER "${c}" _hps_c)
  set(CPACK_RPM_${_hps_c}_USER_FILELIST
      "%license ${CPACK_PACKAGING_INSTALL_PREFIX}/share/licenses/${_hps_rpm_names_${c}}/LICENSE")
endforeach()
# Directories owned by the distribution (filesystem, pkgconf, cmake, python3, java, cargo).
set(_hps_p "${CPACK_PACKAGING_INSTALL_PREFIX}")
set(CPACK_RPM_EXCLUDE_FROM_AUTO_FILELIST_ADDITION
    "${_hps_p}/${HPS_RPM_LIBDIR}"
    "${_hps_p}/${HPS_RPM_LIBDIR}/cmake"
    "${_hps_p}/${HPS_RPM_LIBDIR}/pkgconfig"
    "${_hps_p}/${_hps_rpm_python_dir}"
    "${_hps_p}/${HPS_RPM_LIBDIR}/python${_hps_py_mm}"
    "${_hps_p}/share/java"
    "${_hps_p}/share/cargo"
    "${_hps_p}/share/cargo/registry"
    "${_hps_p}/share/licenses")

set(CPACK_RPM_RUNTIME_PACKAGE_NAME "${HPS_PKG_RUNTIME}")
set(CPACK_RPM_RUNTIME_PACKAGE_SUMMARY "${_hps_syn} - shared library")
set(CPACK_RPM_RUNTIME_PACKAGE_DESCRIPTION "${_hps_long} This package contains the shared library libhpshard.so.${PROJECT_VERSION_MAJOR}.")
set(CPACK_RPM_RUNTIME_PACKAGE_GROUP "System Environment/Libraries")
set(CPACK_RPM_RUNTIME_POST_INSTALL_SCRIPT_FILE "${CMAKE_CURRENT_LIST_DIR}/rpm/ldconfig.sh")
set(CPACK_RPM_RUNTIME_POST_UNINSTALL_SCRIPT_FILE "${CMAKE_CURRENT_LIST_DIR}/rpm/ldconfig.sh")

set(CPACK_RPM_DEV_PACKAGE_NAME "${HPS_PKG_DEV_RPM}")
set(CPACK_RPM_DEV_PACKAGE_SUMMARY "${_hps_syn} - development files")
set(CPACK_RPM_DEV_PACKAGE_DESCRIPTION "${_hps_long} This package contains the C headers, the libhpshard.so link, the pkg-config file and the CMake package (hpshard::hpshard).")
set(CPACK_RPM_DEV_PACKAGE_GROUP "Development/Libraries")
set(CPACK_RPM_DEV_PACKAGE_REQUIRES "${HPS_PKG_RUNTIME} = ${HPS_PKG_FULL_VERSION}, dlpack-devel")

set(CPACK_RPM_TOOLS_PACKAGE_NAME "${HPS_PKG_TOOLS}")
set(CPACK_RPM_TOOLS_PACKAGE_SUMMARY "${_hps_syn} - tools")
set(CPACK_RPM_TOOLS_PACKAGE_DESCRIPTION "${_hps_long} ${_hps_tools_text}")
set(CPACK_RPM_TOOLS_PACKAGE_REQUIRES "${HPS_PKG_RUNTIME} = ${HPS_PKG_FULL_VERSION}")

set(CPACK_RPM_RUST_SYS_PACKAGE_NAME "${HPS_PKG_RUST_SYS_RPM}")
set(CPACK_RPM_RUST_SYS_PACKAGE_SUMMARY "${_hps_syn} - Rust FFI crate hpshard-sys")
set(CPACK_RPM_RUST_SYS_PACKAGE_DESCRIPTION "${_hps_long} This package contains the source of the Rust crate hpshard-sys for offline cargo builds.")
set(CPACK_RPM_RUST_SYS_PACKAGE_ARCHITECTURE noarch)
set(CPACK_RPM_RUST_SYS_PACKAGE_REQUIRES "${HPS_PKG_DEV_RPM} = ${HPS_PKG_FULL_VERSION}")
set(CPACK_RPM_RUST_PACKAGE_NAME "${HPS_PKG_RUST_RPM}")
set(CPACK_RPM_RUST_PACKAGE_SUMMARY "${_hps_syn} - Rust crate hpshard")
set(CPACK_RPM_RUST_PACKAGE_DESCRIPTION "${_hps_long} This package contains the source of the Rust crate hpshard for offline cargo builds.")
set(CPACK_RPM_RUST_PACKAGE_ARCHITECTURE noarch)
set(CPACK_RPM_RUST_PACKAGE_REQUIRES "${HPS_PKG_RUST_SYS_RPM} = ${HPS_PKG_FULL_VERSION}")

set(CPACK_RPM_PYTHON_PACKAGE_NAME "${HPS_PKG_PYTHON}")
set(CPACK_RPM_PYTHON_PACKAGE_SUMMARY "${_hps_syn} - Python 3 binding")
set(CPACK_RPM_PYTHON_PACKAGE_DESCRIPTION "${_hps_long} This package contains the Python 3 module hpshard.")
set(CPACK_RPM_PYTHON_PACKAGE_REQUIRES
    "${HPS_PKG_RUNTIME} = ${HPS_PKG_FULL_VERSION}, ${_hps_py_rpm}, python3-numpy")

set(CPACK_RPM_JAVA_PACKAGE_NAME "${HPS_PKG_JAVA}")
set(CPACK_RPM_JAVA_PACKAGE_SUMMARY "${_hps_syn} - Java binding")
set(CPACK_RPM_JAVA_PACKAGE_DESCRIPTION "${_hps_long} This package contains hpshard.jar and its JNI library.")
set(CPACK_RPM_JAVA_PACKAGE_REQUIRES "${HPS_PKG_RUNTIME} = ${HPS_PKG_FULL_VERSION}, java-headless")

# ---- what the packaging test expects (tests/packaging/package_test.sh reads it) ---
list(JOIN _hps_components " " _hps_components_sp)
set(_hps_manifest "${PROJECT_BINARY_DIR}/packaging/hps_packages.env")
file(CONFIGURE OUTPUT "${_hps_manifest}" CONTENT [[
# Generated by packaging/PackageSetup.cmake — what CPack builds in this build tree.
HPS_COMPONENTS="@_hps_components_sp@"
HPS_VERSION="@PROJECT_VERSION@"
HPS_VERSION_MAJOR="@PROJECT_VERSION_MAJOR@"
HPS_PKG_RELEASE="@HPS_PACKAGE_RELEASE@"
HPS_PKG_RUNTIME="@HPS_PKG_RUNTIME@"
HPS_PKG_DEV_DEB="@HPS_PKG_DEV_DEB@"
HPS_PKG_DEV_RPM="@HPS_PKG_DEV_RPM@"
HPS_PKG_PYTHON="@HPS_PKG_PYTHON@"
HPS_PKG_JAVA="@HPS_PKG_JAVA@"
HPS_PKG_TOOLS="@HPS_PKG_TOOLS@"
HPS_PKG_RUST_SYS_DEB="@HPS_PKG_RUST_SYS_DEB@"
HPS_PKG_RUST_SYS_RPM="@HPS_PKG_RUST_SYS_RPM@"
HPS_PKG_RUST_DEB="@HPS_PKG_RUST_DEB@"
HPS_PKG_RUST_RPM="@HPS_PKG_RUST_RPM@"
HPS_INSTALL_PYTHONDIR="@HPS_PYTHON_INSTALL_DIR@"
HPS_RPM_LIBDIR="@HPS_RPM_LIBDIR@"
HPS_RPM_PYTHONDIR="@_hps_rpm_python_dir@"
HPS_INSTALL_PREFIX="@CPACK_PACKAGING_INSTALL_PREFIX@"
HPS_INSTALL_LIBDIR="@CMAKE_INSTALL_LIBDIR@"
HPS_INSTALL_INCLUDEDIR="@CMAKE_INSTALL_INCLUDEDIR@"
HPS_INSTALL_CMAKEDIR="@HPS_INSTALL_CMAKEDIR@"
HPS_HAVE_CUDA="@HPS_HAVE_CUDA@"
]] @ONLY)

include(CPack)
