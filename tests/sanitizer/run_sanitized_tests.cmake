# Configures, builds and runs the C++ and C tests with -fsanitize=address,undefined.
# CUDA is left out of this build: the CUDA runtime and ASan's shadow memory do not mix.
foreach(v SOURCE_DIR BUILD_DIR GENERATOR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "${v} is not set")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "sanitizer build step failed (${rc}): ${ARGV}")
  endif()
endfunction()

run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BUILD_DIR} -G ${GENERATOR}
    "-DHPS_SANITIZE=address\\;undefined" -DHPS_WITH_CUDA=OFF -DHPS_WITH_NCCL=OFF
    -DHPS_BUILD_PYTHON=OFF -DHPS_BUILD_JAVA=OFF -DHPS_BUILD_RUST=OFF
    -DHPS_PACKAGING_TESTS=OFF -DHPS_NO_SANITIZER_SUBBUILD=ON -DCMAKE_BUILD_TYPE=Debug)
run(${CMAKE_COMMAND} --build ${BUILD_DIR} --parallel 2)
set(ENV{ASAN_OPTIONS} "detect_leaks=1:allocator_may_return_null=1:strict_string_checks=1")
set(ENV{UBSAN_OPTIONS} "print_stacktrace=1:halt_on_error=1")
run(${CMAKE_CTEST_COMMAND} --test-dir ${BUILD_DIR} -L "^(cpp|c)$" --output-on-failure)
