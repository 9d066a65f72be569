#include "report/png.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <vector>

extern char** environ;

namespace gmem::report {
namespace {

bool executable(const std::string& path) { return ::access(path.c_str(), X_OK) == 0; }

}  // namespace

std::string find_chromium() {
  if (const char* chosen = std::getenv("GMEM_CHROMIUM"); chosen && *chosen) return chosen;
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::vector<std::string> dir_list;
  for (std::string dir; std::getline(dirs, dir, ':');) dir_list.push_back(dir.empty() ? "." : dir);
  for (const char* name : {"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"})
    for (const std::string& dir : dir_list)
      if (executable(dir + "/" + name)) return dir + "/" + name;
  return "";
}

bool write_timeline_png(const std::string& html, const std::string& png) {
  const std::string chromium = find_chromium();
  if (chromium.empty()) {
    std::fprintf(stderr,
                 "gmem: report: --png needs headless Chromium, and none is installed (looked for "
                 "$GMEM_CHROMIUM, chromium, chromium-browser, google-chrome on PATH); Debian: "
                 "apt-get install chromium. The HTML report was written: %s\n",
                 html.c_str());
    return false;
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path page = fs::absolute(html, ec);
  const fs::path out = fs::absolute(png, ec);
  fs::remove(out, ec);
  // A profile of its own, so that a Chromium the user has open is neither used nor disturbed.
  const fs::path profile = fs::temp_directory_path(ec) / ("gmem-report-chromium-" + std::to_string(::getpid()));
  std::vector<std::string> args = {chromium,
                                   "--headless",
                                   "--disable-gpu",
                                   "--hide-scrollbars",
                                   "--no-first-run",
                                   "--user-data-dir=" + profile.string(),
                                   "--host-resolver-rules=MAP * ~NOTFOUND",
                                   "--window-size=1400,680",
                                   "--virtual-time-budget=10000",
                                   "--screenshot=" + out.string(),
                                   "file://" + page.string() + "#only-timeline"};
  if (::geteuid() == 0) args.insert(args.begin() + 1, "--no-sandbox");  // Chromium refuses root otherwise
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  // Chromium's chatter (GPU, D-Bus) is noise here; whether the PNG appeared is what counts.
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, chromium.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  int status = 0;
  if (spawned == 0) ::waitpid(pid, &status, 0);
  fs::remove_all(profile, ec);
  if (spawned != 0 || !fs::exists(out) || fs::file_size(out, ec) == 0) {
    std::fprintf(stderr, "gmem: report: %s did not write %s (%s)\n", chromium.c_str(), png.c_str(),
                 spawned != 0 ? "could not start it" : ("exit status " + std::to_string(WEXITSTATUS(status))).c_str());
    return false;
  }
  std::fprintf(stderr, "gmem: wrote %s (the timeline, by %s)\n", png.c_str(), chromium.c_str());
  return true;
}

}  // namespace gmem::report
