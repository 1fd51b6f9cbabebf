# The header-only libraries the core and the tools build with, from Debian: nlohmann-json3-dev
# (the checkpoint manifest's, the timeline's and the benchmarks' JSON) and libxxhash-dev
# (XXH3 checksums), used header-only so that libhpshard gains no run-time dependency;
# libcli11-dev (the tools' command lines, optional: without it hpshard-ckpt and
# hpshard-trace are not built). A machine without Debian's packages (the GPU machine of
# tools/gpu-check.sh) finds copies of the two headers in .gpu-carry/include.
add_library(hps_json INTERFACE)
find_package(nlohmann_json 3.2 CONFIG QUIET)
if(nlohmann_json_FOUND)
  target_link_libraries(hps_json INTERFACE nlohmann_json::nlohmann_json)
else()
  find_path(HPS_NLOHMANN_JSON_INCLUDE_DIR nlohmann/json.hpp
            HINTS ${PROJECT_SOURCE_DIR}/.gpu-carry/include)
  if(NOT HPS_NLOHMANN_JSON_INCLUDE_DIR)
    message(FATAL_ERROR "nlohmann/json.hpp not found: apt-get install nlohmann-json3-dev")
  endif()
  target_include_directories(hps_json SYSTEM INTERFACE ${HPS_NLOHMANN_JSON_INCLUDE_DIR})
endif()
add_library(hps_checkpoint_deps INTERFACE)
target_link_libraries(hps_checkpoint_deps INTERFACE hps_json)
find_path(HPS_XXHASH_INCLUDE_DIR xxhash.h HINTS ${PROJECT_SOURCE_DIR}/.gpu-carry/include)
if(NOT HPS_XXHASH_INCLUDE_DIR)
  message(FATAL_ERROR "xxhash.h not found: apt-get install libxxhash-dev")
endif()
target_include_directories(hps_checkpoint_deps SYSTEM INTERFACE ${HPS_XXHASH_INCLUDE_DIR})
find_package(CLI11 CONFIG QUIET)
