// read_trace: loads a file (gunzipping when needed) and hands it to the reader for its format.
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "gmem/error.hpp"
#include "gmem/trace.hpp"
#include "trace/csv.hpp"
#include "trace/formats.hpp"

namespace gmem::trace {

namespace {
constexpr std::array<const char*, 6> kActionNames = {
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom"};

bool is_gzip(std::string_view data) {
  return data.size() >= 2 && static_cast<unsigned char>(data[0]) == 0x1f &&
         static_cast<unsigned char>(data[1]) == 0x8b;
}

std::string read_raw(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) throw BadInputError(path, 0, std::string("cannot open: ") + std::strerror(errno));
  std::string data;
  char buf[1 << 16];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, file.get())) > 0) data.append(buf, n);
  if (std::ferror(file.get())) throw BadInputError(path, 0, "read error");
  return data;
}

// Inflates every gzip member of `data` (gzip allows several, concatenated).
std::string gunzip(std::string_view data, const std::string& path) {
  z_stream zs{};
  if (inflateInit2(&zs, 15 + 16) != Z_OK) throw BadInputError(path, 0, "zlib initialisation failed");
  std::unique_ptr<z_stream, int (*)(z_stream*)> guard(&zs, &inflateEnd);
  // The trailer's ISIZE (size mod 4 GiB) is a good first guess; capped in case it is garbage.
  std::size_t guess = data.size() * 4;
  if (data.size() >= 18) {
    const auto* tail = reinterpret_cast<const unsigned char*>(data.data() + data.size() - 4);
    const std::size_t isize = tail[0] | tail[1] << 8 | tail[2] << 16 | std::size_t{tail[3]} << 24;
    guess = std::min(isize + 1, data.size() * 64);
  }
  std::string out(std::max<std::size_t>(guess, 1024), '\0');
  std::size_t produced = 0;
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  if (data.size() > UINT32_MAX) throw BadInputError(path, 0, "gzip file larger than 4 GiB");
  zs.avail_in = static_cast<uInt>(data.size());
  for (;;) {
    if (produced == out.size()) out.resize(out.size() * 2);
    zs.next_out = reinterpret_cast<Bytef*>(out.data() + produced);
    const std::size_t room = std::min<std::size_t>(out.size() - produced, UINT32_MAX);
    zs.avail_out = static_cast<uInt>(room);
    const int rc = inflate(&zs, Z_NO_FLUSH);
    produced += room - zs.avail_out;
    if (rc == Z_STREAM_END) {
      if (zs.avail_in == 0) break;
      if (!is_gzip(std::string_view(reinterpret_cast<const char*>(zs.next_in), zs.avail_in)))
        break;  // trailing garbage after the last member: ignored, as gzip -d does
      inflateReset(&zs);
      continue;
    }
    if (rc == Z_BUF_ERROR && zs.avail_in == 0)
      throw BadInputError(path, 0, "truncated gzip data (the file ends inside the compressed stream)");
    if (rc != Z_OK && rc != Z_BUF_ERROR)
      throw BadInputError(path, 0, std::string("corrupt gzip data: ") + (zs.msg ? zs.msg : "inflate failed"));
  }
  out.resize(produced);
  return out;
}

// "dir/gpt2.trace.csv.gz" -> "gpt2": the base name without the extensions traces carry.
std::string trace_name(const std::string& path) {
  std::string name = path.substr(path.find_last_of('/') + 1);
  static constexpr std::array<std::string_view, 9> kExtensions = {
      ".gz", ".csv", ".trace", ".pickle", ".pkl", ".snapshot", ".log", ".txt", ".rmm"};
  for (bool stripped = true; stripped;) {
    stripped = false;
    for (std::string_view ext : kExtensions)
      if (name.size() > ext.size() && name.ends_with(ext)) {
        name.resize(name.size() - ext.size());
        stripped = true;
      }
  }
  return name;
}

bool is_pickle(std::string_view data) {
  return data.size() >= 2 && static_cast<unsigned char>(data[0]) == 0x80 &&
         data[1] >= 2 && data[1] <= 5;  // PROTO n
}
}  // namespace

const char* action_name(Action action) noexcept {
  const auto i = static_cast<std::size_t>(action);
  return i < kActionNames.size() ? kActionNames[i] : "unknown";
}

namespace detail {
std::optional<Action> parse_action(std::string_view name) {
  for (std::size_t i = 0; i < kActionNames.size(); ++i)
    if (name == kActionNames[i]) return static_cast<Action>(i);
  return std::nullopt;
}
}  // namespace detail

std::string read_file_maybe_gzip(const std::string& path) {
  std::string data = read_raw(path);
  return is_gzip(data) ? gunzip(data, path) : data;
}

Trace read_trace(const std::string& path) {
  Trace trace;
  trace.path = path;
  trace.name = trace_name(path);
  trace.frames.emplace_back();
  const std::string data = read_file_maybe_gzip(path);
  if (data.empty()) throw BadInputError(path, 0, "empty file");
  if (is_pickle(data)) {
    detail::read_snapshot_pickle(data, trace);
    return trace;
  }
  std::string_view text = data;
  if (text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);  // UTF-8 byte order mark
  detail::CsvReader header(text.substr(0, text.find('\n')), path);
  header.next();
  bool has_action = false, has_rmm = false;
  for (std::size_t i = 0; i < header.size(); ++i) {
    has_action |= header[i] == "action";
    has_rmm |= header[i] == "Pointer";
  }
  if (has_action) {
    detail::read_pytorch_csv(text, trace);
  } else if (has_rmm) {
    detail::read_rmm_csv(text, trace);
  } else {
    throw BadInputError(path, 1,
                        "not a trace: expected a PyTorch trace CSV header (action,addr,size,stream,"
                        "time_us,user_frame,lib_frame), an RMM log header (Thread,Time,Action,"
                        "Pointer,Size,Stream) or a PyTorch snapshot pickle");
  }
  return trace;
}

}  // namespace gmem::trace
