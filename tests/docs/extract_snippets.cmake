# Writes one C++ file holding every ```cpp block of one markdown page, so that the page's code is
# compiled (tests/docs/CMakeLists.txt). Run at build time:
#   cmake -DIN=<page.md> -DOUT=<file.cpp> [-DCONTEXT=<stand-ins.hpp>] -P extract_snippets.cmake
#
# The line right before a block's opening fence may say how to compile it (docs/development.md,
# "Code in the docs"):
#   (nothing)                      statements: the body of a function of its own
#   <!-- snippet: declarations --> namespace-scope code, in a namespace of its own
#   <!-- snippet: prelude -->      namespace-scope code every later block of the page sees
#   <!-- snippet: skip REASON -->  not compiled; REASON is required
# Every other block gets a namespace of its own (docs_snippet_<N>, N its place on the page), so two
# blocks may declare the same name; what several blocks share goes in a prelude.
# `#include` lines are moved to the top of the file (one translation unit per page: the headers
# are parsed once). `#line` directives make the compiler name the page and line of an error.

if(NOT IN OR NOT OUT)
  message(FATAL_ERROR "usage: cmake -DIN=page.md -DOUT=file.cpp [-DCONTEXT=header.hpp] -P extract_snippets.cmake")
endif()

file(READ "${IN}" text)
# CMake lists split on ";" and treat "[", "]" and "\" specially: park them while the text is a
# list of lines, put them back in the output.
string(ASCII 1 _semi)
string(ASCII 2 _lbr)
string(ASCII 3 _rbr)
string(ASCII 4 _bsl)
string(REPLACE "\\" "${_bsl}" text "${text}")
string(REPLACE ";" "${_semi}" text "${text}")
string(REPLACE "[" "${_lbr}" text "${text}")
string(REPLACE "]" "${_rbr}" text "${text}")
string(REPLACE "\n" ";" lines "${text}")

set(page "${IN}")
set(includes "")
set(preludes "")
set(snippets "")
set(blocks 0)
set(compiled 0)
set(skipped 0)
set(inside FALSE)
set(lineno 0)
set(previous "")
foreach(line IN LISTS lines)
  math(EXPR lineno "${lineno} + 1")
  if(NOT inside)
    if(line MATCHES "^[ \t]*```cpp[ \t]*$")
      set(inside TRUE)
      set(kind statements)
      set(reason "")
      if(previous MATCHES "^[ \t]*<!-- snippet: ([a-z]+)(.*)-->[ \t]*$")
        set(kind "${CMAKE_MATCH_1}")
        string(STRIP "${CMAKE_MATCH_2}" reason)
        if(NOT kind MATCHES "^(statements|declarations|prelude|skip)$")
          message(FATAL_ERROR "${page}:${lineno}: unknown snippet marker `${kind}` (statements, declarations, prelude or skip)")
        endif()
        if(kind STREQUAL "skip" AND reason STREQUAL "")
          message(FATAL_ERROR "${page}:${lineno}: `<!-- snippet: skip -->` needs a reason after `skip`")
        endif()
      endif()
      set(block_start ${lineno})
      math(EXPR first_line "${lineno} + 1")
      set(body "")
    endif()
    set(previous "${line}")
    continue()
  endif()
  if(NOT line MATCHES "^[ \t]*```[ \t]*$")
    if(NOT kind STREQUAL "skip" AND line MATCHES "^[ \t]*#[ \t]*include[ \t]")
      # Hoisted to the top of the file; an empty line keeps the block's line numbers.
      string(APPEND includes "#line ${lineno} \"${page}\"\n${line}\n")
      string(APPEND body "\n")
    else()
      string(APPEND body "${line}\n")
    endif()
    continue()
  endif()
  # The closing fence: the block is complete.
  set(inside FALSE)
  set(previous "")
  set(where "${page}:${block_start}")
  math(EXPR blocks "${blocks} + 1")
  set(ns "docs_snippet_${blocks}")
  if(kind STREQUAL "skip")
    math(EXPR skipped "${skipped} + 1")
    string(APPEND snippets "// ${where}: skipped (${reason})\n")
    continue()
  endif()
  math(EXPR compiled "${compiled} + 1")
  if(kind STREQUAL "prelude")
    string(APPEND preludes "// ${where}: prelude\n#line ${first_line} \"${page}\"\n${body}\n")
  elseif(kind STREQUAL "declarations")
    string(APPEND snippets "// ${where}\nnamespace ${ns} {\n#line ${first_line} \"${page}\"\n${body}\n}  // namespace ${ns}\n")
  else()
    string(APPEND snippets "// ${where}\nnamespace ${ns} {\n[[maybe_unused]] void run() {\n#line ${first_line} \"${page}\"\n${body}\n}\n}  // namespace ${ns}\n")
  endif()
endforeach()
if(inside)
  message(FATAL_ERROR "${page}:${block_start}: the ```cpp block is never closed")
endif()

set(out "// Generated from ${page} by tests/docs/extract_snippets.cmake: do not edit.\n")
string(APPEND out "// ${compiled} block(s) compiled, ${skipped} skipped.\n")
if(compiled GREATER 0)
  string(APPEND out "${includes}")
  if(CONTEXT)
    # The names the page's blocks use without declaring them (msg, consumer, ...).
    string(APPEND out "#line 1 \"${OUT}\"\n#include \"${CONTEXT}\"\n")
  endif()
  string(APPEND out "${preludes}${snippets}")
endif()
string(REPLACE "${_semi}" ";" out "${out}")
string(REPLACE "${_lbr}" "[" out "${out}")
string(REPLACE "${_rbr}" "]" out "${out}")
string(REPLACE "${_bsl}" "\\" out "${out}")
file(WRITE "${OUT}" "${out}")
