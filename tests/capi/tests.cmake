# C API tests of DLPack tensors, the ABI and bucket_bytes (included from tests/CMakeLists.txt).

# DLPack views, the host/device policy and collectives over DLTensors, as C99.
add_executable(dlpack_capi_test capi/dlpack_capi_test.c)
target_link_libraries(dlpack_capi_test PRIVATE hpshard::hpshard hps_warnings Threads::Threads)
set_target_properties(dlpack_capi_test PROPERTIES C_STANDARD 99 C_EXTENSIONS OFF)
target_compile_definitions(dlpack_capi_test PRIVATE _POSIX_C_SOURCE=200809L)
add_test(NAME dlpack_capi_test COMMAND dlpack_capi_test)
set_tests_properties(dlpack_capi_test PROPERTIES LABELS c TIMEOUT 120)

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
add_executable(abi_extensible_test capi/abi/extensible_test.c)
target_link_libraries(abi_extensible_test PRIVATE hpshard::hpshard hps_warnings Threads::Threads)
set_target_properties(abi_extensible_test PROPERTIES C_STANDARD 99 C_EXTENSIONS OFF)
target_compile_definitions(abi_extensible_test PRIVATE _POSIX_C_SOURCE=200809L)
add_test(NAME abi_extensible_test COMMAND abi_extensible_test)
set_tests_properties(abi_extensible_test PROPERTIES LABELS c TIMEOUT 60)

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
add_executable(engine_buckets_capi_test capi/engine_buckets_capi_test.c)
target_link_libraries(engine_buckets_capi_test PRIVATE hpshard::hpshard hps_warnings
  Threads::Threads m)
set_target_properties(engine_buckets_capi_test PROPERTIES C_STANDARD 99 C_EXTENSIONS OFF)
target_compile_definitions(engine_buckets_capi_test PRIVATE _POSIX_C_SOURCE=200809L)
add_test(NAME engine_buckets_capi_test COMMAND engine_buckets_capi_test)
set_tests_properties(engine_buckets_capi_test PROPERTIES LABELS c TIMEOUT 120
  SKIP_RETURN_CODE 77)

# fork(): a handle belongs to the process that made it; a forked child is refused the
# parent's handles, lets them go without waiting, and makes its own.
add_executable(fork_capi_test capi/fork_capi_test.c)
target_link_libraries(fork_capi_test PRIVATE hpshard::hpshard hps_warnings Threads::Threads)
set_target_properties(fork_capi_test PROPERTIES C_STANDARD 99 C_EXTENSIONS OFF)
target_compile_definitions(fork_capi_test PRIVATE _POSIX_C_SOURCE=200809L)
add_test(NAME fork_capi_test COMMAND fork_capi_test)
set_tests_properties(fork_capi_test PROPERTIES LABELS c TIMEOUT 120)
