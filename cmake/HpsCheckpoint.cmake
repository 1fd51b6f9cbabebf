# What core/checkpoint and tools/hpshard-ckpt build with, from Debian: nlohmann-json3-dev
# (the manifest's JSON) and libxxhash-dev (XXH3 checksums), both used header-only so that
# libhpshard gains no run-time dependency; libcli11-dev (hpshard-ckpt's command line,
# optional: without it the tool is not built). A machine without Debian's packages (the
# GPU machine of tools/gpu-check.sh) finds copies of the two headers in .gpu-carry/include.
add_library(hps_checkpoint_deps INTERFACE)
find_package(nlohmann_json 3.2 CONFIG QUIET)
if(nlohmann_json_FOUND)
  target_link_libraries(hps_checkpoint_deps INTERFACE nlohmann_json::nlohmann_json)
else()
  find_path(HPS_NLOHMANN_JSON_INCLUDE_DIR nlohmann/json.hpp
            HINTS ${PROJECT_SOURCE_DIR}/.gpu-carry/include)
  if(NOT HPS_NLOHMANN_JSON_INCLUDE_DIR)
    message(FATAL_ERROR "nlohmann/json.hpp not found: apt-get install nlohmann-json3-dev")
  endif()
  target_include_directories(hps_checkpoint_deps SYSTEM INTERFACE ${HPS_NLOHMANN_JSON_INCLUDE_DIR})
endif()
find_path(HPS_XXHASH_INCLUDE_DIR xxhash.h HINTS ${PROJECT_SOURCE_DIR}/.gpu-carry/include)
if(NOT HPS_XXHASH_INCLUDE_DIR)
  message(FATAL_ERROR "xxhash.h not found: apt-get install libxxhash-dev")
endif()
target_include_directories(hps_checkpoint_deps SYSTEM INTERFACE ${HPS_XXHASH_INCLUDE_DIR})
find_package(CLI11 CONFIG QUIET)
