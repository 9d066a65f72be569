// The Python stack of the thread that allocates, taken from C++ (frames::capture_python), so that
// every tracked allocation names the user's line without the Python layer setting frames first.
//
// libgmem does not link libpython: it finds CPython's C API in the process (dlsym) the first time,
// and in a process without Python it captures nothing. The calling thread usually does not hold
// the GIL (ctypes and PyTorch's operators release it before they reach the allocator), so the
// capture takes it for the walk, as PyTorch's own stack capture does. It walks only threads
// Python has run on (the autograd engine's threads have no Python stack), never while the
// interpreter shuts down, and never while the engine's lock is held (the engine gathers context
// before its lock).
//
// Cost: each frame is read as (code object, instruction offset); a stack seen before is found by
// those pairs alone. Its text ("file:line:function" lines) is made once, on first sight, and code
// objects are kept alive by a reference so that their addresses stay theirs.
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gmem/tracker.hpp"
#include "tracking/string_hash.hpp"

namespace gmem::frames {
namespace {

using Object = void;  // PyObject, PyFrameObject, PyCodeObject: opaque here

struct PythonApi {
  int (*is_initialized)() = nullptr;
  int (*is_finalizing)() = nullptr;  // Py_IsFinalizing (3.13) or _Py_IsFinalizing
  void* (*this_thread_state)() = nullptr;
  int (*gil_ensure)() = nullptr;      // PyGILState_STATE is an int-sized enum
  void (*gil_release)(int) = nullptr;
  Object* (*current_frame)() = nullptr;  // borrowed
  Object* (*frame_back)(Object*) = nullptr;  // new reference
  Object* (*frame_code)(Object*) = nullptr;  // new reference
  int (*frame_lasti)(Object*) = nullptr;     // 3.11+; else the line number is the key
  int (*frame_line)(Object*) = nullptr;
  int (*code_line)(Object*, int) = nullptr;  // PyCode_Addr2Line
  void (*incref)(Object*) = nullptr;
  void (*decref)(Object*) = nullptr;
  Object* (*get_attr)(Object*, const char*) = nullptr;
  const char* (*utf8)(Object*) = nullptr;
  void (*clear_error)() = nullptr;
  bool ok = false;

  template <class F>
  static void find(F& fn, const char* name) {
    fn = reinterpret_cast<F>(::dlsym(RTLD_DEFAULT, name));
  }

  PythonApi() {
    find(is_initialized, "Py_IsInitialized");
    find(is_finalizing, "Py_IsFinalizing");
    if (is_finalizing == nullptr) find(is_finalizing, "_Py_IsFinalizing");
    find(this_thread_state, "PyGILState_GetThisThreadState");
    find(gil_ensure, "PyGILState_Ensure");
    find(gil_release, "PyGILState_Release");
    find(current_frame, "PyEval_GetFrame");
    find(frame_back, "PyFrame_GetBack");
    find(frame_code, "PyFrame_GetCode");
    find(frame_lasti, "PyFrame_GetLasti");
    find(frame_line, "PyFrame_GetLineNumber");
    find(code_line, "PyCode_Addr2Line");
    find(incref, "Py_IncRef");
    find(decref, "Py_DecRef");
    find(get_attr, "PyObject_GetAttrString");
    find(utf8, "PyUnicode_AsUTF8");
    find(clear_error, "PyErr_Clear");
    ok = is_initialized && this_thread_state && gil_ensure && gil_release && current_frame &&
         frame_back && frame_code && frame_line && incref && decref && get_attr && utf8 &&
         clear_error;
  }
};

const PythonApi& api() {
  static const PythonApi* const instance = new PythonApi;
  return *instance;
}

constexpr std::size_t kPairBytes = sizeof(void*) + sizeof(int);  // (code, offset) in a key

struct CodeInfo {
  std::string filename;
  std::string name;
  bool skipped = false;  // one of gmem's own files
};

class PythonStacks {
 public:
  void skip_prefix(std::string prefix) {
    std::lock_guard lock(mutex_);
    if (prefix == skip_prefix_) return;
    skip_prefix_ = std::move(prefix);
    for (auto& [code, info] : codes_) info.skipped = skipped(info.filename);
    stacks_.clear();  // their texts were made with the old prefix
  }

  // Called with the GIL held. The hot path reads (code, offset) for each frame and looks the
  // stack up by those alone; names, lines and which frames are gmem's own are worked out once,
  // on a stack's first sight.
  FramesId capture(const PythonApi& py, int depth) {
    Object* frame = py.current_frame();
    if (frame == nullptr) return 0;
    py.incref(frame);
    std::string key;
    key.reserve(static_cast<std::size_t>(depth) * kPairBytes);
    int walked = 0;
    while (frame != nullptr && walked < depth) {
      if (Object* code = py.frame_code(frame); code != nullptr) {
        // Offsets where PyFrame_GetLasti exists (3.11+), else lines.
        const int where = py.frame_lasti != nullptr ? py.frame_lasti(frame) : py.frame_line(frame);
        key.append(reinterpret_cast<const char*>(&code), sizeof code);
        key.append(reinterpret_cast<const char*>(&where), sizeof where);
        py.decref(code);  // a known stack's codes are kept alive by code_info's references
        ++walked;
      }
      Object* back = py.frame_back(frame);
      py.decref(frame);
      frame = back;
    }
    if (frame != nullptr) py.decref(frame);
    if (walked == 0) return 0;
    std::lock_guard lock(mutex_);
    if (auto it = stacks_.find(key); it != stacks_.end()) return it->second;
    std::string text;
    for (std::size_t at = 0; at < key.size(); at += kPairBytes) {
      Object* code = nullptr;
      int where = 0;
      std::memcpy(&code, key.data() + at, sizeof code);
      std::memcpy(&where, key.data() + at + sizeof code, sizeof where);
      const CodeInfo& info = code_info(py, code);  // takes a reference on first sight
      if (info.skipped) continue;
      const int line = py.frame_lasti != nullptr && py.code_line != nullptr
                           ? py.code_line(code, where) : where;
      if (!text.empty()) text += '\n';
      text += info.filename + ':' + std::to_string(line) + ':' + info.name;
    }
    const FramesId id = intern(text);  // "" (only gmem's own frames) gives 0
    stacks_.emplace(std::move(key), id);
    return id;
  }

 private:
  const CodeInfo& code_info(const PythonApi& py, Object* code) {
    if (auto it = codes_.find(code); it != codes_.end()) return it->second;
    CodeInfo info;
    info.filename = attribute(py, code, "co_filename");
    info.name = attribute(py, code, "co_name");  // as Python's tracebacks and PyTorch name it
    info.skipped = skipped(info.filename);
    py.incref(code);  // keeps the address this code's for as long as the key holds it
    return codes_.emplace(code, std::move(info)).first->second;
  }

  static std::string attribute(const PythonApi& py, Object* object, const char* name) {
    Object* value = py.get_attr(object, name);
    if (value == nullptr) {
      py.clear_error();
      return {};
    }
    const char* text = py.utf8(value);
    std::string out = text != nullptr ? text : "";
    if (text == nullptr) py.clear_error();
    py.decref(value);
    return out;
  }

  bool skipped(const std::string& filename) const {
    return !skip_prefix_.empty() && filename.compare(0, skip_prefix_.size(), skip_prefix_) == 0;
  }

  std::mutex mutex_;  // the GIL would do, but free-threaded Pythons have none
  std::string skip_prefix_;
  std::unordered_map<Object*, CodeInfo> codes_;
  std::unordered_map<std::string, FramesId, detail::StringHash, std::equal_to<>> stacks_;
};

PythonStacks& stacks() {
  static PythonStacks* const instance = new PythonStacks;  // used until the very end
  return *instance;
}

}  // namespace

FramesId capture_python(int /*skip*/, int depth) {
  // Frames the program set itself (gmem.set_frames, a scope with its stack) are its choice.
  if (current() != 0) return 0;
  const PythonApi& py = api();
  if (!py.ok || !py.is_initialized()) return 0;
  if (py.is_finalizing != nullptr && py.is_finalizing()) return 0;
  // A thread Python never ran on has no Python stack (the autograd engine's workers): taking
  // the GIL there would only cost.
  if (py.this_thread_state() == nullptr) return 0;
  const int gil = py.gil_ensure();
  FramesId id = 0;
  try {
    id = stacks().capture(py, depth);
  } catch (...) {
    py.gil_release(gil);
    throw;
  }
  py.gil_release(gil);
  return id;
}

void skip_python_files(std::string_view prefix) { stacks().skip_prefix(std::string(prefix)); }

bool python_available() { return api().ok && api().is_initialized(); }

}  // namespace gmem::frames
