// The gmem subcommands. To add one: write tools/<name>_command.cpp defining `int <name>_command(
// const Args&)` (return the exit status, throw for errors), declare it here, add a row to
// kCommands and the file to gmem_cli in CMakeLists.txt.
#pragma once

#include <string>
#include <vector>

namespace gmem::cli {

using Args = std::vector<std::string>;  // the arguments after the command's name

struct Command {
  const char* name;
  int (*run)(const Args& args);
  const char* summary;  // one line, for `gmem help`
  const char* usage;    // the full text, for `gmem help <name>` and `gmem <name> --help`
};

int replay_command(const Args& args);
extern const char kReplayUsage[];
int leaks_command(const Args& args);
extern const char kLeaksUsage[];
int summary_command(const Args& args);
extern const char kSummaryUsage[];
int report_command(const Args& args);
extern const char kReportUsage[];

inline constexpr Command kCommands[] = {
    {"replay", &replay_command, "replay allocation traces through gmem on a simulated device", kReplayUsage},
    {"leaks", &leaks_command, "find sites whose surviving memory grows step after step", kLeaksUsage},
    {"summary", &summary_command, "memory summary of a trace replayed through gmem, at its end or peak", kSummaryUsage},
    {"report", &report_command, "one self-contained HTML page of where memory went (opens offline)", kReportUsage},
};

}  // namespace gmem::cli
