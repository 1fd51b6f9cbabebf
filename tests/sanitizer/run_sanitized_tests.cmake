# Configures, builds and runs tests in a sanitizer sub-build. As tools/run-tests does, a test
# that fails runs once more before it counts (a real failure fails twice; a scheduling stall
# of a multi-rank test on a loaded machine does not rerun the whole sub-build's tests).
#   SANITIZE unset: AddressSanitizer + UBSan over every C++ and C test (labels cpp, c).
#   SANITIZE=thread: ThreadSanitizer over the threaded C++ tests (communicators over every
#     transport, the stores and their aborts, streams, task flows, clipping, both engines,
#     checkpoints, the timeline), built
#     by clang (CC, CXX):
#     gcc 12's TSan runtime crashes at load on some kernels, clang 14's does not.
# CUDA and the bindings are left out: the CUDA runtime and the sanitizers' shadow memory do
# not mix.
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

# Only what the C++ and C tests run: no bindings, no hpshard-bench or hpshard-trace
# (building those was a sixth of the sub-build's time).
set(common -DHPS_WITH_CUDA=OFF -DHPS_WITH_NCCL=OFF -DHPS_BUILD_PYTHON=OFF -DHPS_BUILD_JAVA=OFF
           -DHPS_BUILD_RUST=OFF -DHPS_BUILD_TOOLS=OFF -DHPS_PACKAGING_TESTS=OFF
           -DHPS_NO_SANITIZER_SUBBUILD=ON)
# The parent build's compiler launcher (ccache, say), when it has one.
if(LAUNCHER)
  list(APPEND common -DCMAKE_C_COMPILER_LAUNCHER=${LAUNCHER} -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
endif()
if(SANITIZE STREQUAL "thread")
  foreach(v CC CXX)
    if(NOT DEFINED ${v})
      message(FATAL_ERROR "${v} is not set")
    endif()
    set(ENV{${v}} ${${v}})
  endforeach()
  set(tests communicator_test shm_process_test stream_test task_flow_test hybrid_clip_test
            full_buffer_pool_test engine_harness_test stage2_engine_test stage3_engine_test
            checkpointer_test trace_test store_test)
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BUILD_DIR} -G ${GENERATOR} ${common}
      -DHPS_SANITIZE=thread -DHPS_WERROR=OFF -DHPS_BUILD_EXAMPLES=OFF
      -DCMAKE_BUILD_TYPE=RelWithDebInfo)
  run(${CMAKE_COMMAND} --build ${BUILD_DIR} --parallel 2 --target ${tests})
  # A report fails the test: TSan exits 66 when it reported anything.
  set(ENV{TSAN_OPTIONS} "halt_on_error=1:second_deadlock_stack=1")
  list(JOIN tests "|" regex)
  run(${CMAKE_CTEST_COMMAND} --test-dir ${BUILD_DIR} -R "^(${regex})$" --output-on-failure
      --repeat until-pass:2)
else()
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BUILD_DIR} -G ${GENERATOR} ${common}
      "-DHPS_SANITIZE=address\\;undefined" -DCMAKE_BUILD_TYPE=Debug)
  run(${CMAKE_COMMAND} --build ${BUILD_DIR} --parallel 2)
  set(ENV{ASAN_OPTIONS} "detect_leaks=1:allocator_may_return_null=1:strict_string_checks=1")
  set(ENV{UBSAN_OPTIONS} "print_stacktrace=1:halt_on_error=1")
  run(${CMAKE_CTEST_COMMAND} --test-dir ${BUILD_DIR} -L "^(cpp|c)$" --output-on-failure
      --repeat until-pass:2)
endif()
