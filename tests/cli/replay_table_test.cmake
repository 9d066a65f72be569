# `gmem replay`'s table for people: by default every line fits 100 columns (the longest trace
# names included) and a legend follows the table; --wide shows every column, wider; --explain
# adds how each column is measured.
#   cmake -DGMEM=path/to/gmem -DFILES="a.trace.csv.gz;b.trace.csv.gz" -P replay_table_test.cmake
function(run out)
  execute_process(COMMAND ${GMEM} replay ${ARGN} ${FILES} RESULT_VARIABLE rc OUTPUT_VARIABLE text
    ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "gmem replay ${ARGN}: exit status ${rc}: ${err}")
  endif()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

function(widest text out)
  string(REPLACE "\n" ";" lines "${text}")
  set(most 0)
  foreach(line IN LISTS lines)
    string(LENGTH "${line}" width)
    if(width GREATER most)
      set(most ${width})
    endif()
  endforeach()
  set(${out} ${most} PARENT_SCOPE)
endfunction()

run(default)
widest("${default}" width)
if(width GREATER 100)
  message(FATAL_ERROR "the default table is ${width} columns wide (at most 100):\n${default}")
endif()
foreach(expected "^trace +peak allocated +PyTorch +gmem +min capacity +device ms/step\n"
                 "\n\npeak allocated +the most memory" "\nPyTorch +PyTorch's peak reserved"
                 "\ngmem +gmem's peak reserved" "\nmin capacity +the smallest device"
                 "\ndevice ms/step +modelled time" "ratios to peak allocated" "--wide: " "--explain: ")
  if(NOT default MATCHES "${expected}")
    message(FATAL_ERROR "the default output lacks '${expected}':\n${default}")
  endif()
endforeach()
if(default MATCHES "How each column is measured")
  message(FATAL_ERROR "the default output explains in full without --explain:\n${default}")
endif()

run(wide --wide)
widest("${wide}" wide_width)
if(NOT wide MATCHES "creates/maps/unmaps +ns/op +device ms/step\n" OR NOT wide_width GREATER width)
  message(FATAL_ERROR "--wide does not show every column (${wide_width} columns):\n${wide}")
endif()

run(explained --explain)
if(NOT explained MATCHES "\nHow each column is measured:\n.*\nmin capacity +the smallest simulated device")
  message(FATAL_ERROR "--explain does not explain:\n${explained}")
endif()
widest("${explained}" explained_width)
if(explained_width GREATER 100)
  message(FATAL_ERROR "--explain's output is ${explained_width} columns wide:\n${explained}")
endif()
message(STATUS "default ${width} columns, --wide ${wide_width}")
