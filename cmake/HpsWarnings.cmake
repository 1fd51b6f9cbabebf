# Warning flags for every target of the project; errors when HPS_WERROR is on.
add_library(hps_warnings INTERFACE)
target_compile_options(hps_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wconversion -Wno-sign-conversion>
  $<$<COMPILE_LANGUAGE:C>:-Wall -Wextra -Wpedantic -Wstrict-prototypes>
  $<$<BOOL:${HPS_WERROR}>:-Werror>)
