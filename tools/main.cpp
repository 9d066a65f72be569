// gmem: the command line tool. A dispatcher over the subcommands listed in commands.hpp.
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>

#include "args.hpp"
#include "commands.hpp"

namespace {
using gmem::cli::Command;
using gmem::cli::kCommands;

const Command* find_command(std::string_view name) {
  for (const Command& c : kCommands)
    if (name == c.name) return &c;
  return nullptr;
}

void print_help(std::FILE* out) {
  std::fputs("usage: gmem <command> [options] [arguments]\n\ncommands:\n", out);
  std::fprintf(out, "  %-10s %s\n", "help", "show this help, or a command's: gmem help <command>");
  std::fprintf(out, "  %-10s %s\n", "--version", "print gmem's version");
  for (const Command& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.summary);
  std::fputs("\nThe commands read traces: FILE..., where a FILE of - reads standard input.\n"
             "gmem help <command> lists a command's options.\n", out);
}

bool wants_help(const gmem::cli::Args& args) {
  for (const std::string& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

int dispatch(gmem::cli::Args args) {
  if (args.empty()) {
    print_help(stderr);
    return 1;
  }
  const std::string name = args.front();
  args.erase(args.begin());
  if (name == "--version" || name == "version") {
    std::printf("gmem %s\n", GMEM_VERSION);
    return 0;
  }
  if (name == "help" || name == "--help" || name == "-h") {
    if (args.empty()) {
      print_help(stdout);
      return 0;
    }
    const Command* c = find_command(args.front());
    if (!c) throw gmem::cli::UsageError("no command '" + args.front() + "' (see gmem help)");
    std::fputs(c->usage, stdout);
    return 0;
  }
  const Command* c = find_command(name);
  if (!c) throw gmem::cli::UsageError("no command '" + name + "' (see gmem help)");
  if (wants_help(args)) {
    std::fputs(c->usage, stdout);
    return 0;
  }
  return c->run(args);
}
}  // namespace

int main(int argc, char** argv) {
  try {
    return dispatch(gmem::cli::Args(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gmem: %s\n", e.what());
    return 1;
  }
}
