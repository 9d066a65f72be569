# `gmem COMMAND ARGS... -` with FILE on standard input prints what `gmem COMMAND ARGS... FILE` prints,
# the trace named <stdin> instead of by its file name.
#   cmake -DGMEM=path/to/gmem -DARGS="leaks;--json" -DFILE=trace -DNAME=leak_losses -P stdin_test.cmake
execute_process(COMMAND ${GMEM} ${ARGS} ${FILE} RESULT_VARIABLE file_rc
  OUTPUT_VARIABLE from_file ERROR_VARIABLE file_err)
execute_process(COMMAND ${GMEM} ${ARGS} - INPUT_FILE ${FILE} RESULT_VARIABLE stdin_rc
  OUTPUT_VARIABLE from_stdin ERROR_VARIABLE stdin_err)
if(NOT file_rc EQUAL stdin_rc)
  message(FATAL_ERROR "exit status ${file_rc} from the file, ${stdin_rc} from stdin: ${file_err}${stdin_err}")
endif()
if(from_stdin STREQUAL "")
  message(FATAL_ERROR "nothing printed from stdin: ${stdin_err}")
endif()
string(REPLACE "<stdin>" "${NAME}" renamed "${from_stdin}")
if(NOT renamed STREQUAL from_file)
  message(FATAL_ERROR "stdin gave\n${from_stdin}\nthe file gave\n${from_file}")
endif()
message(STATUS "same output from stdin as from ${FILE}")
