# Configures, builds and runs the multi-threaded C++ tests (communicators over every
# transport, task flows, streams, clipping, both engines) with -fsanitize=thread, built by
# clang: gcc 12's TSan runtime crashes at load on some kernels, clang 14's does not.
# CUDA and the bindings are left out. tests/CMakeLists.txt runs it only where clang++ is.
foreach(v SOURCE_DIR BUILD_DIR GENERATOR CLANGXX CLANG)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "${v} is not set")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "thread-sanitizer step failed (${rc}): ${ARGV}")
  endif()
endfunction()

set(tests communicator_test shm_process_test stream_test task_flow_test hybrid_clip_test
          stage2_engine_test stage3_engine_test)
set(ENV{CC} ${CLANG})
set(ENV{CXX} ${CLANGXX})
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BUILD_DIR} -G ${GENERATOR}
    -DHPS_SANITIZE=thread -DHPS_WERROR=OFF -DHPS_WITH_CUDA=OFF -DHPS_WITH_NCCL=OFF
    -DHPS_BUILD_PYTHON=OFF -DHPS_BUILD_JAVA=OFF -DHPS_BUILD_RUST=OFF -DHPS_BUILD_EXAMPLES=OFF
    -DHPS_PACKAGING_TESTS=OFF -DHPS_NO_SANITIZER_SUBBUILD=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo)
run(${CMAKE_COMMAND} --build ${BUILD_DIR} --parallel 2 --target ${tests})
# A report fails the test: TSan exits 66 when it reported anything.
set(ENV{TSAN_OPTIONS} "halt_on_error=1:second_deadlock_stack=1")
list(JOIN tests "|" regex)
run(${CMAKE_CTEST_COMMAND} --test-dir ${BUILD_DIR} -R "^(${regex})$" --output-on-failure)
