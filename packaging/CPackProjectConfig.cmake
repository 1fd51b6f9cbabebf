# Read by cpack for each generator (CPACK_PROJECT_CONFIG_FILE, set in PackageSetup.cmake).
#
# CPackDeb prepends CPACK_PACKAGE_DESCRIPTION_SUMMARY to every component's
# CPACK_DEBIAN_<COMP>_DESCRIPTION unless the summary is CPack's default one. Our
# per-component descriptions carry their own synopsis line, so for DEB the summary is
# reset to that default (RPM uses CPACK_RPM_<COMP>_PACKAGE_SUMMARY instead).
if(CPACK_GENERATOR STREQUAL "DEB")
  set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${CPACK_DEFAULT_PACKAGE_DESCRIPTION_SUMMARY}")
endif()
