// read_trace: loads a file or a stream (gunzipping when needed) and hands it to the reader for its format.
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <filesystem>
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

// All of an open stream (a file, standard input), refusing more than limits.max_bytes before
// reading it all: reading stops at the limit, so an endless stream costs bounded memory.
std::string read_stream(std::FILE* file, const std::string& path, const ReadLimits& limits) {
  std::string data;
  char buf[1 << 16];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, file)) > 0) {
    if (n > limits.max_bytes - std::min<std::uint64_t>(data.size(), limits.max_bytes))
      detail::exceeds(path, 0, format_bytes(limits.max_bytes) + " of data", "--max-bytes");
    data.append(buf, n);
  }
  if (std::ferror(file)) throw BadInputError(path, 0, std::string("read error: ") + std::strerror(errno));
  return data;
}

// The whole file, refusing one larger than limits.max_bytes before reading it all.
std::string read_raw(const std::string& path, const ReadLimits& limits) {
  std::error_code ignored;
  if (std::filesystem::is_directory(path, ignored))
    throw BadInputError(path, 0, "is a directory, not a trace");
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) throw BadInputError(path, 0, std::string("cannot open: ") + std::strerror(errno));
  return read_stream(file.get(), path, limits);
}

// Inflates gzip data a piece at a time, so that a caller can look at the beginning (and give up
// on it) before the rest is inflated, and so that the output never passes limits.max_bytes: a
// small file may inflate to gigabytes. Every gzip member is read (gzip allows several,
// concatenated); bytes after the last member that are not gzip are ignored, as gzip -d does.
class Gunzip {
 public:
  Gunzip(std::string_view data, const std::string& path, std::uint64_t max_bytes)
      : path_(path), max_bytes_(max_bytes) {
    if (data.size() > UINT32_MAX) throw BadInputError(path, 0, "gzip file larger than 4 GiB");
    if (inflateInit2(&zs_, 15 + 16) != Z_OK) throw BadInputError(path, 0, "zlib initialisation failed");
    zs_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
    zs_.avail_in = static_cast<uInt>(data.size());
  }
  ~Gunzip() { inflateEnd(&zs_); }
  Gunzip(const Gunzip&) = delete;
  Gunzip& operator=(const Gunzip&) = delete;

  bool done() const { return done_; }

  // Appends to `out` until it holds at least `wanted` bytes or the data ends.
  void inflate_to(std::string& out, std::size_t wanted) {
    constexpr std::size_t kPiece = 1 << 20;
    while (!done_ && out.size() < wanted) {
      const std::size_t before = out.size();
      if (before >= max_bytes_)  // full, and not done: there is more (or at least a trailer)
        if (!finishes_without_output())
          detail::exceeds(path_, 0, format_bytes(max_bytes_) + " of data once gunzipped", "--max-bytes");
      if (done_) break;
      const std::size_t room = static_cast<std::size_t>(std::min<std::uint64_t>(kPiece, max_bytes_ - before));
      out.resize(before + room);
      const std::size_t produced = step(out.data() + before, room);
      out.resize(before + produced);
    }
  }

 private:
  // Inflates at most `room` bytes into `to`; returns how many came.
  std::size_t step(char* to, std::size_t room) {
    zs_.next_out = reinterpret_cast<Bytef*>(to);
    zs_.avail_out = static_cast<uInt>(room);
    const int rc = inflate(&zs_, Z_NO_FLUSH);
    const std::size_t produced = room - zs_.avail_out;
    if (rc == Z_STREAM_END) {
      if (zs_.avail_in == 0 ||
          !is_gzip(std::string_view(reinterpret_cast<const char*>(zs_.next_in), zs_.avail_in)))
        done_ = true;
      else
        inflateReset(&zs_);  // the next member
      return produced;
    }
    if (rc == Z_BUF_ERROR && zs_.avail_in == 0)
      throw BadInputError(path_, 0, "truncated gzip data (the file ends inside the compressed stream)");
    if (rc != Z_OK && rc != Z_BUF_ERROR)
      throw BadInputError(path_, 0, std::string("corrupt gzip data: ") + (zs_.msg ? zs_.msg : "inflate failed"));
    return produced;
  }

  // At the size limit: true when what is left of the stream inflates to nothing (a trailer,
  // empty members), so that a file of exactly max_bytes still reads.
  bool finishes_without_output() {
    char probe[1];
    for (int i = 0; i < 64 && !done_; ++i)
      if (step(probe, sizeof probe) > 0) return false;
    return done_;
  }

  z_stream zs_{};
  const std::string& path_;
  std::uint64_t max_bytes_;
  bool done_ = false;
};

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

namespace detail {
void exceeds(const std::string& file, std::size_t line, const std::string& what, const char* option) {
  throw BadInputError(file, line, "exceeds " + what + " (set with " + option + ")");
}

void reserve_events(Trace& trace, std::size_t text_bytes, const ReadLimits& limits) {
  trace.events.reserve(trace.events.size() + std::min(text_bytes / 60, limits.max_events));
}

void check_event_count(const Trace& trace, std::size_t line, const ReadLimits& limits) {
  if (trace.events.size() >= limits.max_events)
    exceeds(trace.path, line, std::to_string(limits.max_events) + " events", "--max-events");
}
}  // namespace detail

namespace {
enum class Format { pytorch_csv, rmm_csv, snapshot_pickle };

// The format, from the beginning of the content (`head`; `complete` when that is all of it).
// Throws for anything else, so that a file that is not a trace is refused after one line.
Format detect_format(std::string_view head, bool complete, const std::string& path,
                     const ReadLimits& limits) {
  if (head.empty()) throw BadInputError(path, 0, "empty file");
  if (is_pickle(head)) return Format::snapshot_pickle;
  if (head.starts_with("\xEF\xBB\xBF")) head.remove_prefix(3);  // UTF-8 byte order mark
  const std::size_t newline = head.find('\n');
  if (newline == std::string_view::npos && !complete)
    detail::exceeds(path, 1, std::to_string(limits.max_line) + " bytes in one line", "--max-line");
  detail::CsvReader header(head.substr(0, newline), path, limits.max_line, limits.max_fields);
  header.next();
  bool has_action = false, has_rmm = false;
  for (std::size_t i = 0; i < header.size(); ++i) {
    has_action |= header[i] == "action";
    has_rmm |= header[i] == "Pointer";
  }
  if (has_action) return Format::pytorch_csv;
  if (has_rmm) return Format::rmm_csv;
  throw BadInputError(path, 1,
                      "not a trace: expected a PyTorch trace CSV header (action,addr,size,stream,"
                      "time_us,user_frame,lib_frame), an RMM log header (Thread,Time,Action,"
                      "Pointer,Size,Stream) or a PyTorch snapshot pickle");
}

// How much of the content detect_format needs: the header line, its byte order mark, its newline.
std::size_t head_bytes(const ReadLimits& limits) {
  return static_cast<std::size_t>(std::min<std::uint64_t>(limits.max_line, limits.max_bytes)) + 4;
}

void check_size(std::string_view raw, const std::string& path, const ReadLimits& limits) {
  if (raw.size() > limits.max_bytes)
    detail::exceeds(path, 0, format_bytes(limits.max_bytes) + " of data", "--max-bytes");
}

// Gunzips `raw`; with `format`, detects the format from the first line before inflating the rest.
std::string gunzip(std::string_view raw, const std::string& path, const ReadLimits& limits,
                   Format* format) {
  Gunzip gunzip(raw, path, limits.max_bytes);
  std::string out;
  if (format) {
    const std::size_t head = head_bytes(limits);
    gunzip.inflate_to(out, head);
    *format = detect_format(std::string_view(out).substr(0, head), gunzip.done() && out.size() <= head,
                            path, limits);
  }
  gunzip.inflate_to(out, SIZE_MAX);
  return out;
}

void parse(std::string_view data, Format format, Trace& trace, const ReadLimits& limits) {
  std::string_view text = data;
  if (text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);  // UTF-8 byte order mark
  switch (format) {
    case Format::snapshot_pickle: detail::read_snapshot_pickle(data, trace, limits); break;
    case Format::pytorch_csv: detail::read_pytorch_csv(text, trace, limits); break;
    case Format::rmm_csv: detail::read_rmm_csv(text, trace, limits); break;
  }
}
}  // namespace

std::string read_file_maybe_gzip(const std::string& path, const ReadLimits& limits) {
  std::string raw = read_raw(path, limits);
  return is_gzip(raw) ? gunzip(raw, path, limits, nullptr) : raw;
}

Trace read_trace_bytes(std::string_view bytes, const std::string& path, const ReadLimits& limits) {
  Trace trace;
  trace.path = path;
  trace.name = trace_name(path);
  trace.frames.emplace_back();
  Format format{};
  if (is_gzip(bytes)) {
    const std::string data = gunzip(bytes, path, limits, &format);
    parse(data, format, trace, limits);
  } else {
    check_size(bytes, path, limits);
    const std::size_t head = head_bytes(limits);
    format = detect_format(bytes.substr(0, head), bytes.size() <= head, path, limits);
    parse(bytes, format, trace, limits);
  }
  rebuild_history_window(trace);
  return trace;
}

Trace read_trace(const std::string& path, const ReadLimits& limits) {
  return read_trace_bytes(read_raw(path, limits), path, limits);
}

Trace read_trace_stream(std::FILE* stream, const std::string& name, const ReadLimits& limits) {
  return read_trace_bytes(read_stream(stream, name, limits), name, limits);
}

}  // namespace gmem::trace
