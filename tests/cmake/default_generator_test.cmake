# Configures the source tree as a user would with plain `cmake -S . -B build`: CMake's
# default generator (Unix Makefiles: CMAKE_GENERATOR unset) and no options. Where the CUDA
# toolkit is installed this is what once failed at generation ("CUDA_ARCHITECTURES is empty
# for target hpshard"); EXPECT_CUDA=1 also checks that CUDA was really part of it. Where
# Debian's OpenJDK 17 is installed, the configuration sees only what its headless packages
# (tools/setup.sh's default-jdk-headless) hold, through JAVA_HOME: the Java binding once
# required AWT (jawt.h) and failed on a fresh machine.
foreach(v SOURCE_DIR BUILD_DIR EXPECT_CUDA)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "${v} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE ${BUILD_DIR})
set(jdk /usr/lib/jvm/java-17-openjdk-amd64)
set(java_home)
if(EXISTS ${jdk}/include/jni.h)
  set(headless ${BUILD_DIR}/headless-jdk)
  foreach(f include/jni.h include/linux/jni_md.h lib/server/libjvm.so bin/java bin/javac
            bin/jar bin/javadoc)
    get_filename_component(dir ${headless}/${f} DIRECTORY)
    file(MAKE_DIRECTORY ${dir})
    file(CREATE_LINK ${jdk}/${f} ${headless}/${f} SYMBOLIC)
  endforeach()
  set(java_home JAVA_HOME=${headless})
endif()
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env --unset=CMAKE_GENERATOR ${java_home}
          ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BUILD_DIR}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "plain `cmake -S . -B build` failed (${rc}):\n${err}")
endif()
file(STRINGS ${BUILD_DIR}/CMakeCache.txt generator REGEX "^CMAKE_GENERATOR:")
if(NOT generator MATCHES "Unix Makefiles")
  message(FATAL_ERROR "expected the default generator (Unix Makefiles), got: ${generator}")
endif()
if(java_home AND NOT out MATCHES "java=ON")
  message(FATAL_ERROR "the Java binding was left out with a headless JDK")
endif()
if(EXPECT_CUDA AND NOT out MATCHES "CUDA=1")
  message(FATAL_ERROR "CUDA is installed here but the plain configuration left it out")
endif()
file(REMOVE_RECURSE ${BUILD_DIR})
