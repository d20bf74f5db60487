# pipeline_add_test(NAME name SOURCES ... LIBS ... LABELS unit|integration|gpu|faults|cpu-isa [TIMEOUT s])
# One helper for every test so a run can pick what this machine can do:
#   ctest -L unit, ctest -LE gpu. A test that needs a GPU exits 77 without one.
function(pipeline_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS;ARGS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} PkgConfig::CHECK)
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  set_target_properties(${T_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  add_test(NAME ${T_NAME} COMMAND ${T_NAME} ${T_ARGS})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
                       SKIP_RETURN_CODE 77
                       ENVIRONMENT "PIPELINE_SOURCE_DIR=${PROJECT_SOURCE_DIR};PIPELINE_BIN_DIR=${CMAKE_BINARY_DIR}/bin")
endfunction()
