# cmake -DIDEM_SOURCE_DIR=... -DWORK_DIR=... -DMODE=install|subdirectory -P run_package_test.cmake
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
  run(${CMAKE_COMMAND} -S "${IDEM_SOURCE_DIR}" -B "${WORK_DIR}/idem-build" -G Ninja -DCMAKE_BUILD_TYPE=Release
      -DIDEM_BUILD_TESTS=OFF -DIDEM_BUILD_EXAMPLES=OFF -DIDEM_BUILD_BENCH=OFF "-DCMAKE_INSTALL_PREFIX=${prefix}")
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/idem-build" -j2)
  run(${CMAKE_COMMAND} --install "${WORK_DIR}/idem-build")
  run(${CMAKE_COMMAND} -S "${consumer}" -B "${WORK_DIR}/consumer-build" -G Ninja "-DCMAKE_PREFIX_PATH=${prefix}")
else()
  run(${CMAKE_COMMAND} -S "${consumer}" -B "${WORK_DIR}/consumer-build" -G Ninja
      "-DIDEM_SUBDIRECTORY=${IDEM_SOURCE_DIR}")
endif()
run(${CMAKE_COMMAND} --build "${WORK_DIR}/consumer-build" -j2)
run("${WORK_DIR}/consumer-build/consumer")
message(STATUS "package test (${MODE}) passed")
