# The pass of ffi/CMakeLists.txt that scikit-build-core runs: it builds the same project again, in
# <build-dir>/handlers, and installs what that built.
#
# Why: scikit-build-core deletes CMakeFiles/, where every object file lives, whenever it runs from a build
# environment it has not seen before, and pip makes a new one (build isolation) at every `pip install`. The kept
# build directory (pyproject's build-dir) would then save nothing: the README's second install recompiled all of
# the first's. It leaves <build-dir>/handlers alone, so there a second install recompiles only what changed.
set(_handlers "${CMAKE_BINARY_DIR}/handlers")
file(MAKE_DIRECTORY "${_handlers}")

# What scikit-build-core set for this pass (the Python to build for, the wheel's state and ABI tag, the build type)
# and any -D KDTREE_JAX_* option, handed on through an initial-cache file (values may hold ';').
set(_init "")
get_cmake_property(_vars CACHE_VARIABLES)
foreach(_v IN LISTS _vars)
  if(_v MATCHES "^(SKBUILD|Python3?_|PYTHON_|KDTREE_JAX_|CMAKE_BUILD_TYPE$|CMAKE_MAKE_PROGRAM$)")
    string(APPEND _init "set(${_v} [==[${${_v}}]==] CACHE STRING \"\" FORCE)\n")
  endif()
endforeach()
file(WRITE "${_handlers}/init.cmake" "${_init}")

# Configured here, at every configure, so that the environment of this `pip install` (KDTREE_JAX_CUDA, ...) is read.
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${CMAKE_CURRENT_SOURCE_DIR}" -B "${_handlers}" -G "${CMAKE_GENERATOR}"
          -C "${_handlers}/init.cmake" -DKDTREE_JAX_KEPT_BUILD=ON
  RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "configuring ${_handlers} failed (see above)")
endif()

add_custom_target(handlers ALL COMMAND "${CMAKE_COMMAND}" --build "${_handlers}" USES_TERMINAL)
# At install time CMAKE_INSTALL_PREFIX is the wheel's directory and CMAKE_INSTALL_DO_STRIP says whether to strip.
install(CODE "
  set(_strip \"\")
  if(CMAKE_INSTALL_DO_STRIP)
    set(_strip --strip)
  endif()
  execute_process(COMMAND \"${CMAKE_COMMAND}\" --install \"${_handlers}\"
                          --prefix \"\${CMAKE_INSTALL_PREFIX}\" \${_strip} RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR \"installing from ${_handlers} failed\")
  endif()
")
