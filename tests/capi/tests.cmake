# C API tests of DLPack tensors, the ABI, bucket_bytes and fork() (included from
# tests/CMakeLists.txt).

# A C99 program `name` from `source`, run as a test labelled c within `timeout` seconds;
# the arguments after those are more libraries to link.
function(hps_c_test name source timeout)
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE hpshard::hpshard hps_warnings Threads::Threads ${ARGN})
  set_target_properties(${name} PROPERTIES C_STANDARD 99 C_EXTENSIONS OFF)
  target_compile_definitions(${name} PRIVATE _POSIX_C_SOURCE=200809L)
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS c TIMEOUT ${timeout} SKIP_RETURN_CODE 77)
endfunction()

# DLPack views, the host/device policy and collectives over DLTensors, as C99.
hps_c_test(dlpack_capi_test capi/dlpack_capi_test.c 120)

# A program compiled against the frozen 0.1.0 header runs against today's library. The
# frozen headers come first (BEFORE), so they shadow the library's own include directory.
add_executable(abi_consumer_0_1_0 capi/abi/consumer_0_1_0.c)
target_include_directories(abi_consumer_0_1_0 BEFORE PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/capi/abi/include-0.1.0)
target_link_libraries(abi_consumer_0_1_0 PRIVATE hpshard::hpshard hps_warnings Threads::Threads)
set_target_properties(abi_consumer_0_1_0 PROPERTIES C_STANDARD 99 C_EXTENSIONS OFF)
add_test(NAME abi_consumer_0_1_0 COMMAND abi_consumer_0_1_0)
set_tests_properties(abi_consumer_0_1_0 PROPERTIES LABELS c TIMEOUT 60)

# Older and newer callers of the extensible structs, as documented in hpshard.h.
hps_c_test(abi_extensible_test capi/abi/extensible_test.c 60)

# The built library's ABI against the baseline of the major version's first release
# (abidiff, Debian abigail-tools). Not in the sanitizer sub-build: it compares the
# release build's library.
find_program(HPS_ABIDW abidw)
if(HPS_ABIDW AND NOT HPS_SANITIZE)
  add_test(NAME abi_check
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/capi/abi/abi_check.py
      --library $<TARGET_FILE:hpshard> --source-dir ${PROJECT_SOURCE_DIR}
      --generated-dir ${HPS_GENERATED_DIR} --work-dir ${CMAKE_CURRENT_BINARY_DIR}/abi-check)
  set_tests_properties(abi_check PROPERTIES LABELS abi TIMEOUT 120)
elseif(NOT HPS_SANITIZE)
  add_test(NAME abi_check
    COMMAND sh -c "echo 'skipped: abidw not found (apt-get install abigail-tools)'; exit 77")
  set_tests_properties(abi_check PROPERTIES LABELS abi SKIP_RETURN_CODE 77)
endif()

# bucket_bytes: more flat buffers, other shards, the same training.
hps_c_test(engine_buckets_capi_test capi/engine_buckets_capi_test.c 120 m)

# fork(): a handle belongs to the process that made it; a forked child is refused the
# parent's handles, lets them go without waiting, and makes its own.
hps_c_test(fork_capi_test capi/fork_capi_test.c 120)
