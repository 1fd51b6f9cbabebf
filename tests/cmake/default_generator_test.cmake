# Configures the source tree as a user would with plain `cmake -S . -B build`: CMake's
# default generator (Unix Makefiles: CMAKE_GENERATOR unset) and no options. Where the CUDA
# toolkit is installed this is what once failed at generation ("CUDA_ARCHITECTURES is empty
# for target hpshard"); EXPECT_CUDA=1 also checks that CUDA was really part of it.
foreach(v SOURCE_DIR BUILD_DIR EXPECT_CUDA)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "${v} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE ${BUILD_DIR})
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env --unset=CMAKE_GENERATOR
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
if(EXPECT_CUDA AND NOT out MATCHES "CUDA=1")
  message(FATAL_ERROR "CUDA is installed here but the plain configuration left it out")
endif()
file(REMOVE_RECURSE ${BUILD_DIR})
