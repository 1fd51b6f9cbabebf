# Detects CUDA and NCCL. AUTO builds a backend when it is found; ON requires it; OFF skips it.
# Sets HPS_HAVE_CUDA / HPS_HAVE_NCCL (0 or 1).
set(HPS_HAVE_CUDA 0)
set(HPS_HAVE_NCCL 0)

if(NOT HPS_WITH_CUDA STREQUAL "OFF")
  if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND AND TARGET CUDA::cudart_static)
    set(HPS_HAVE_CUDA 1)
    # The CUDA language at the top level, before any target: every target that links the
    # kernels' objects (libhpshard.so, tools, tests) then has CUDA_ARCHITECTURES, which the
    # Makefile generator requires (Ninja does not check).
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING "CUDA architectures of the kernels")
    endif()
    if(NOT CMAKE_CUDA_COMPILER AND CUDAToolkit_NVCC_EXECUTABLE)
      set(CMAKE_CUDA_COMPILER ${CUDAToolkit_NVCC_EXECUTABLE})
    endif()
    if(NOT CMAKE_CUDA_HOST_COMPILER)
      set(CMAKE_CUDA_HOST_COMPILER ${CMAKE_CXX_COMPILER})
    endif()
    enable_language(CUDA)
    # CUDA follows CMAKE_CXX_STANDARD (20); CMake 3.25 knows no C++20 flag for nvcc (12+ has it).
    if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
  elseif(HPS_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "HPS_WITH_CUDA=ON but the CUDA toolkit was not found (set CUDAToolkit_ROOT)")
  endif()
endif()

if(HPS_HAVE_CUDA AND NOT HPS_WITH_NCCL STREQUAL "OFF")
  # NCCL is loaded at run time (core/comm/nccl/nccl_api.cc), so the build needs only nccl.h;
  # a library found here becomes one of the run-time candidates. Looked for beside CUDA, in
  # the system, and in NCCL's Python wheel (nvidia-nccl-cu*: site-packages/nvidia/nccl/{include,lib})
  # of the python3 on PATH and the usual site-packages folders. HPS_NCCL_LIBRARY (here, or
  # in the environment at configure time) names the library instead.
  if(NOT HPS_NCCL_LIBRARY AND DEFINED ENV{HPS_NCCL_LIBRARY})
    set(HPS_NCCL_LIBRARY "$ENV{HPS_NCCL_LIBRARY}" CACHE FILEPATH "The NCCL library (libnccl.so.2)")
  endif()
  set(_hps_wheel_dirs)
  find_program(HPS_PYTHON3 NAMES python3)
  if(HPS_PYTHON3)
    execute_process(
      COMMAND ${HPS_PYTHON3} -c "import site, sysconfig; print(';'.join([sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']] + site.getsitepackages() + [site.getusersitepackages()]))"
      OUTPUT_VARIABLE _hps_site_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
      RESULT_VARIABLE _hps_site_rc)
    if(_hps_site_rc EQUAL 0)
      list(APPEND _hps_wheel_dirs ${_hps_site_dirs})
    endif()
  endif()
  file(GLOB _hps_glob_dirs LIST_DIRECTORIES true /usr/local/lib/python3*/dist-packages
       /usr/local/lib/python3*/site-packages /usr/lib/python3/dist-packages
       /opt/conda/lib/python3*/site-packages)
  list(APPEND _hps_wheel_dirs ${_hps_glob_dirs})
  set(_hps_nccl_include_hints ${CUDAToolkit_INCLUDE_DIRS})
  set(_hps_nccl_library_hints ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
  foreach(_dir IN LISTS _hps_wheel_dirs)
    list(APPEND _hps_nccl_include_hints ${_dir}/nvidia/nccl/include)
    list(APPEND _hps_nccl_library_hints ${_dir}/nvidia/nccl/lib)
  endforeach()
  find_path(HPS_NCCL_INCLUDE_DIR nccl.h HINTS ${_hps_nccl_include_hints} /usr/include)
  find_library(HPS_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_hps_nccl_library_hints})
  if(HPS_NCCL_INCLUDE_DIR)
    set(HPS_HAVE_NCCL 1)
    if(NOT HPS_NCCL_LIBRARY)
      message(STATUS "NCCL: nccl.h found, no library: it is looked for at run time only")
    endif()
  endif()
endif()
if(HPS_WITH_NCCL STREQUAL "ON" AND NOT HPS_HAVE_NCCL)
  message(FATAL_ERROR "HPS_WITH_NCCL=ON but NCCL's nccl.h (and CUDA) were not found")
endif()

# Gloo: the CPU communicator. AUTO builds it when Debian's libgloo-dev is installed.
set(HPS_WITH_GLOO AUTO CACHE STRING "Build the Gloo (CPU) communicator backend: AUTO, ON or OFF")
set_property(CACHE HPS_WITH_GLOO PROPERTY STRINGS AUTO ON OFF)
set(HPS_HAVE_GLOO 0)
if(NOT HPS_WITH_GLOO STREQUAL "OFF")
  find_package(Gloo CONFIG QUIET)
  if(Gloo_FOUND AND TARGET gloo)
    set(HPS_HAVE_GLOO 1)
  elseif(HPS_WITH_GLOO STREQUAL "ON")
    message(FATAL_ERROR "HPS_WITH_GLOO=ON but Gloo was not found (apt-get install libgloo-dev)")
  endif()
endif()

# OpenSSL's libcrypto: HMAC-SHA256 for the TCP store's token check. AUTO uses it when
# Debian's libssl-dev is installed (tools/setup.sh installs it); without it a TCP store
# works only without a token (HPS_STORE_TOKEN set is then an error, never ignored).
set(HPS_WITH_OPENSSL AUTO CACHE STRING "Authenticate TCP stores with OpenSSL's HMAC: AUTO, ON or OFF")
set_property(CACHE HPS_WITH_OPENSSL PROPERTY STRINGS AUTO ON OFF)
set(HPS_HAVE_OPENSSL 0)
if(NOT HPS_WITH_OPENSSL STREQUAL "OFF")
  find_package(OpenSSL QUIET COMPONENTS Crypto)
  if(OpenSSL_FOUND AND TARGET OpenSSL::Crypto)
    set(HPS_HAVE_OPENSSL 1)
  elseif(HPS_WITH_OPENSSL STREQUAL "ON")
    message(FATAL_ERROR "HPS_WITH_OPENSSL=ON but OpenSSL was not found (apt-get install libssl-dev)")
  endif()
endif()
