# cmake -DIDEM_SOURCE_DIR=... -DWORK_DIR=... -DMODE=install|subdirectory [-DBUILD_DIR=...] -P run_package_test.cmake
# install: installs BUILD_DIR (the build the tests run from: no second build of idem) to a temp
# prefix and builds the consumer against it; subdirectory: builds the consumer with idem as its
# subdirectory, only what the consumer links.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(consumer "${CMAKE_CURRENT_LIST_DIR}/consumer")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}")
  endif()
endfunction()

if(MODE STREQUAL "install")
  set(prefix "${WORK_DIR}/prefix")
  run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")
  run(${CMAKE_COMMAND} -S "${consumer}" -B "${WORK_DIR}/consumer-build" -G Ninja "-DCMAKE_PREFIX_PATH=${prefix}")
else()
  run(${CMAKE_COMMAND} -S "${consumer}" -B "${WORK_DIR}/consumer-build" -G Ninja
      "-DIDEM_SUBDIRECTORY=${IDEM_SOURCE_DIR}")
endif()
run(${CMAKE_COMMAND} --build "${WORK_DIR}/consumer-build" --target consumer -j2)
run("${WORK_DIR}/consumer-build/consumer")
message(STATUS "package test (${MODE}) passed")
