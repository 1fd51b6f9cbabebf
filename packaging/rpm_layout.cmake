# CPack pre-build script (CPACK_PRE_BUILD_SCRIPTS): gives the RPM packages the
# Fedora/RHEL layout. The build installs in the Debian layout (lib/, lib/jni,
# lib/python3/dist-packages); for RPM, after CPack staged each component and before it
# lists the files, this moves them where Fedora/RHEL x86_64 look:
#   lib/libhpshard.so*, lib/pkgconfig, lib/cmake  -> lib64/...          (%{_libdir})
#   lib/jni/libhpshard_jni.so                      -> lib64/hpshard/     (Fedora's JNI rule)
#   lib/python3/dist-packages/hpshard              -> the interpreter's site-packages,
#                                                     byte-compiled (its __pycache__)
#   share/doc/<deb package>/copyright              -> share/licenses/<rpm package>/LICENSE
#   share/doc/<deb package>/ (the rest)            -> share/doc/<rpm package>/
# and rewrites the paths inside hpshard.pc and the CMake package files. The packaging
# test checks the result (file lists, and a consumer built in each layout).
if(NOT CPACK_GENERATOR STREQUAL "RPM")
  return()
endif()
foreach(v CPACK_TEMPORARY_INSTALL_DIRECTORY CPACK_PACKAGING_INSTALL_PREFIX
          CPACK_HPS_LIBDIR CPACK_HPS_RPM_LIBDIR CPACK_HPS_PYTHON_DIR CPACK_HPS_RPM_PYTHON_DIR
          CPACK_HPS_DATAROOTDIR CPACK_HPS_LICENSE_FILE)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "rpm_layout.cmake: ${v} is not set")
  endif()
endforeach()

function(hps_move src dst)
  if(EXISTS "${src}" OR IS_SYMLINK "${src}")  # a -dev link dangles in its stage
    get_filename_component(parent "${dst}" DIRECTORY)
    file(MAKE_DIRECTORY "${parent}")
    file(RENAME "${src}" "${dst}")
  endif()
endfunction()

# CPack stages each component in its own directory under the temporary one.
file(GLOB _hps_roots LIST_DIRECTORIES true "${CPACK_TEMPORARY_INSTALL_DIRECTORY}/*")
foreach(stage IN LISTS _hps_roots)
  set(prefix "${stage}${CPACK_PACKAGING_INSTALL_PREFIX}")
  if(NOT IS_DIRECTORY "${prefix}")
    continue()
  endif()
  set(from "${prefix}/${CPACK_HPS_LIBDIR}")
  set(to "${prefix}/${CPACK_HPS_RPM_LIBDIR}")

  # The Python package first: it lies under lib/ too. It ships its bytecode, as Fedora's
  # python packages do (levels 0 and 1, the sources' installed path in tracebacks): rpm
  # owns the files, so an import as root writes none that a removal would leave behind.
  set(python_package "${prefix}/${CPACK_HPS_RPM_PYTHON_DIR}/hpshard")
  hps_move("${prefix}/${CPACK_HPS_PYTHON_DIR}/hpshard" "${python_package}")
  if(IS_DIRECTORY "${python_package}" AND CPACK_HPS_PYTHON_EXECUTABLE)
    execute_process(
      COMMAND "${CPACK_HPS_PYTHON_EXECUTABLE}" -m compileall -q -o 0 -o 1
              -d "${CPACK_PACKAGING_INSTALL_PREFIX}/${CPACK_HPS_RPM_PYTHON_DIR}/hpshard"
              "${python_package}"
      RESULT_VARIABLE compiled)
    if(NOT compiled EQUAL 0)
      message(FATAL_ERROR "rpm_layout.cmake: byte-compiling ${python_package} failed")
    endif()
  endif()
  hps_move("${from}/jni/libhpshard_jni.so" "${to}/hpshard/libhpshard_jni.so")
  file(GLOB libs "${from}/libhpshard.so*")
  foreach(lib IN LISTS libs)
    get_filename_component(name "${lib}" NAME)
    hps_move("${lib}" "${to}/${name}")
  endforeach()
  hps_move("${from}/pkgconfig" "${to}/pkgconfig")
  hps_move("${from}/cmake" "${to}/cmake")

  # Paths inside the moved files: hpshard.pc's libdir, the CMake package's library files,
  # and the CMake package's way up to the prefix when lib64 is less deep (lib/<multiarch>).
  string(REGEX MATCHALL "/" deb_depth "/${CPACK_HPS_LIBDIR}")
  string(REGEX MATCHALL "/" rpm_depth "/${CPACK_HPS_RPM_LIBDIR}")
  list(LENGTH deb_depth deb_depth)
  list(LENGTH rpm_depth rpm_depth)
  math(EXPR shallower "${deb_depth} - ${rpm_depth}")
  file(GLOB_RECURSE texts "${to}/pkgconfig/*.pc" "${to}/cmake/*.cmake")
  foreach(f IN LISTS texts)
    file(READ "${f}" text)
    string(REPLACE "/${CPACK_HPS_LIBDIR}/" "/${CPACK_HPS_RPM_LIBDIR}/" text "${text}")
    string(REGEX REPLACE "/${CPACK_HPS_LIBDIR}\n" "/${CPACK_HPS_RPM_LIBDIR}\n" text "${text}")
    set(up "get_filename_component(_IMPORT_PREFIX \"\${_IMPORT_PREFIX}\" PATH)\n")
    string(LENGTH "${up}" up_length)
    set(level 0)
    while(level LESS shallower)  # one step up fewer per level
      string(FIND "${text}" "${up}" at)
      if(at GREATER -1)
        string(SUBSTRING "${text}" 0 ${at} head)
        math(EXPR after "${at} + ${up_length}")
        string(SUBSTRING "${text}" ${after} -1 tail)
        set(text "${head}${tail}")
      endif()
      string(REPLACE "/../../../../\"" "/../../../\"" text "${text}")
      math(EXPR level "${level} + 1")
    endwhile()
    file(WRITE "${f}" "${text}")
  endforeach()

  # The licence: Debian's share/doc/<deb package>/copyright becomes the full text as
  # share/licenses/<rpm package>/LICENSE (the %license file; share/doc is left to %doc).
  file(GLOB copyrights "${prefix}/${CPACK_HPS_DATAROOTDIR}/doc/*/copyright")
  foreach(copyright IN LISTS copyrights)
    get_filename_component(docdir "${copyright}" DIRECTORY)
    get_filename_component(deb_name "${docdir}" NAME)
    set(rpm_name "")
    foreach(pair IN LISTS CPACK_HPS_DOC_TO_RPM)
      if(pair MATCHES "^${deb_name}=(.+)$")
        set(rpm_name "${CMAKE_MATCH_1}")
      endif()
    endforeach()
    if(rpm_name STREQUAL "")
      message(FATAL_ERROR "rpm_layout.cmake: no RPM package name for ${deb_name}")
    endif()
    # The rest of the directory (the tools' guides) is the package's %doc, under its
    # RPM name.
    file(REMOVE "${copyright}" "${docdir}/changelog.Debian.gz")
    file(GLOB_RECURSE docs_left "${docdir}/*")
    if(docs_left)
      if(NOT deb_name STREQUAL rpm_name)
        file(RENAME "${docdir}" "${prefix}/${CPACK_HPS_DATAROOTDIR}/doc/${rpm_name}")
      endif()
    else()
      file(REMOVE_RECURSE "${docdir}")
    endif()
    file(MAKE_DIRECTORY "${prefix}/share/licenses/${rpm_name}")
    configure_file("${CPACK_HPS_LICENSE_FILE}" "${prefix}/share/licenses/${rpm_name}/LICENSE"
                   COPYONLY)
  endforeach()

  # Directories the moves emptied.
  foreach(dir "${from}/jni" "${prefix}/${CPACK_HPS_PYTHON_DIR}" "${prefix}/lib/python3" "${from}"
              "${prefix}/${CPACK_HPS_DATAROOTDIR}/doc" "${prefix}/${CPACK_HPS_DATAROOTDIR}")
    if(IS_DIRECTORY "${dir}")
      file(GLOB left "${dir}/*")
      if(NOT left)
        file(REMOVE_RECURSE "${dir}")
      endif()
    endif()
  endforeach()
endforeach()
