# CMake package of libtinyloop, installed by scripts/install into PREFIX/lib/cmake/tinyloop.
#
#   find_package(tinyloop 0.1 REQUIRED)       # CMAKE_PREFIX_PATH=PREFIX when not a system prefix
#   target_link_libraries(app PRIVATE tinyloop::tinyloop)
#
# tinyloop::tinyloop          libtinyloop.so and tinyloop.h
# tinyloop::tinyloop_static   libtinyloop.a and tinyloop.h, with the system libraries it needs
# tinyloop::cpp               the header-only C++17 wrapper tinyloop.hpp over tinyloop::tinyloop
include(CMakeFindDependencyMacro)
find_dependency(Threads)

get_filename_component(_tinyloop_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)

if(NOT TARGET tinyloop::tinyloop)
  add_library(tinyloop::tinyloop SHARED IMPORTED)
  set_target_properties(tinyloop::tinyloop PROPERTIES
    IMPORTED_LOCATION "${_tinyloop_prefix}/lib/libtinyloop.so"
    IMPORTED_SONAME "libtinyloop.so"
    INTERFACE_INCLUDE_DIRECTORIES "${_tinyloop_prefix}/include")

  add_library(tinyloop::tinyloop_static STATIC IMPORTED)
  set_target_properties(tinyloop::tinyloop_static PROPERTIES
    IMPORTED_LOCATION "${_tinyloop_prefix}/lib/libtinyloop.a"
    IMPORTED_LINK_INTERFACE_LANGUAGES C
    INTERFACE_INCLUDE_DIRECTORIES "${_tinyloop_prefix}/include"
    INTERFACE_LINK_LIBRARIES "Threads::Threads;${CMAKE_DL_LIBS};m;rt")

  add_library(tinyloop::cpp INTERFACE IMPORTED)
  set_target_properties(tinyloop::cpp PROPERTIES
    INTERFACE_LINK_LIBRARIES tinyloop::tinyloop
    INTERFACE_COMPILE_FEATURES cxx_std_17)
endif()

unset(_tinyloop_prefix)
