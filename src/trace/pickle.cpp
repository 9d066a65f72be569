// The pickle virtual machine, restricted to data: see pickle.hpp.
#include "trace/pickle.hpp"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <unordered_map>

#include "gmem/error.hpp"
#include "trace/formats.hpp"

namespace gmem::pickle {

// --- Value -------------------------------------------------------------------------------------

const char* Value::name_of(Kind kind) {
  switch (kind) {
    case Kind::none: return "None";
    case Kind::boolean: return "bool";
    case Kind::integer: return "int";
    case Kind::floating: return "float";
    case Kind::string: return "str";
    case Kind::bytes: return "bytes";
    case Kind::list: return "list";
    case Kind::tuple: return "tuple";
    case Kind::set: return "set";
    case Kind::dict: return "dict";
  }
  return "?";
}

void Value::expect(bool ok, const char* wanted) const {
  if (!ok) throw std::logic_error(std::string("pickle value is a ") + kind_name() + ", not " + wanted);
}

bool Value::as_bool() const {
  expect(kind_ == Kind::boolean, "bool");
  return std::get<bool>(payload_);
}

std::int64_t Value::as_int() const {
  expect(kind_ == Kind::integer, "int");
  return std::get<std::int64_t>(payload_);
}

double Value::as_float() const {
  if (kind_ == Kind::integer) return static_cast<double>(std::get<std::int64_t>(payload_));
  expect(kind_ == Kind::floating, "float");
  return std::get<double>(payload_);
}

const std::string& Value::as_string() const {
  expect(kind_ == Kind::string || kind_ == Kind::bytes, "str");
  return *std::get<const std::string*>(payload_);
}

const List& Value::as_list() const {
  expect(is_sequence(), "list");
  return *std::get<List*>(payload_);
}

const Dict& Value::as_dict() const {
  expect(is_dict(), "dict");
  return *std::get<Dict*>(payload_);
}

const Value* Value::get(std::string_view key) const {
  if (!is_dict()) return nullptr;
  const Dict& d = as_dict();
  for (auto it = d.rbegin(); it != d.rend(); ++it)  // the last assignment wins, as in Python
    if (it->first.is_string() && it->first.as_string() == key) return &it->second;
  return nullptr;
}

// --- the machine -------------------------------------------------------------------------------

namespace detail {

class Machine {
 public:
  Machine(std::string_view data, const std::string& file, std::size_t max_objects, Document& doc)
      : data_(data), file_(file), doc_(*doc.storage_), objects_left_(max_objects), max_objects_(max_objects) {}

  void run() {
    for (;;) {
      op_at_ = pos_;
      const auto op = static_cast<unsigned char>(take(1)[0]);
      if (op == '.') {  // STOP
        if (stack_.empty()) fail("STOP with an empty stack");
        doc_.root = stack_.back();
        return;
      }
      step(op);
    }
  }

 private:
  using K = Value::Kind;
  // Values that the document owns.
  static Value boolean(bool b) { return Value(K::boolean, b); }
  static Value integer(std::int64_t i) { return Value(K::integer, i); }
  static Value floating(double d) { return Value(K::floating, d); }
  Value text(K kind, std::string_view s) { return Value(kind, static_cast<const std::string*>(&doc_.strings.emplace_back(s))); }
  Value string(std::string_view s) { return text(K::string, s); }
  Value bytes(std::string_view s) { return text(K::bytes, s); }
  Value list(K kind, List items = {}) { return Value(kind, &doc_.lists.emplace_back(std::move(items))); }
  Value dict() { return Value(K::dict, &doc_.dicts.emplace_back()); }
  static List& items_of(const Value& v) { return *std::get<List*>(v.payload_); }
  static Dict& entries_of(const Value& v) { return *std::get<Dict*>(v.payload_); }

  [[noreturn]] void fail(const std::string& problem) const {
    throw BadInputError(file_, 0, "pickle byte " + std::to_string(op_at_) + ": " + problem);
  }

  std::string_view take(std::size_t n) {
    if (n > data_.size() - pos_) fail("truncated pickle (data ends inside an opcode)");
    std::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  std::uint64_t little_endian(std::size_t n) {
    std::string_view b = take(n);
    std::uint64_t v = 0;
    for (std::size_t i = n; i-- > 0;) v = v << 8 | static_cast<unsigned char>(b[i]);
    return v;
  }
  std::string_view text_line() {  // protocol 0 arguments end with a newline
    const std::size_t end = data_.find('\n', pos_);
    if (end == std::string_view::npos) fail("truncated pickle (no newline after a text argument)");
    std::string_view line = data_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return line;
  }
  std::size_t length(std::size_t bytes) {
    const std::uint64_t n = little_endian(bytes);
    if (n > data_.size() - pos_) fail("truncated pickle (string longer than the data left)");
    return static_cast<std::size_t>(n);
  }

  // Every value pushed and every memo entry counts against max_objects.
  void count_object() {
    if (objects_left_ == 0)
      trace::detail::exceeds(file_, 0, std::to_string(max_objects_) + " objects in a pickle", "--max-objects");
    --objects_left_;
  }
  void push(Value v) {
    count_object();
    stack_.push_back(std::move(v));
  }
  Value pop() {
    if (stack_.size() <= floor()) fail("stack underflow");
    Value v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  Value& top() {
    if (stack_.size() <= floor()) fail("stack underflow");
    return stack_.back();
  }
  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // Removes the items above the innermost MARK, and the mark.
  List pop_mark() {
    if (marks_.empty()) fail("no MARK on the stack");
    const std::size_t mark = marks_.back();
    marks_.pop_back();
    List items(std::make_move_iterator(stack_.begin() + static_cast<std::ptrdiff_t>(mark)),
               std::make_move_iterator(stack_.end()));
    stack_.resize(mark);
    return items;
  }
  Value& container(Value::Kind kind, const char* opcode) {
    Value& c = top();
    if (c.kind() != kind)
      fail(std::string(opcode) + " expects a " + Value::name_of(kind) + ", found " + c.kind_name());
    return c;
  }
  void set_items(const Value& dict, List& items) {
    if (items.size() % 2) fail("SETITEMS with an odd number of items");
    Dict& d = entries_of(dict);
    for (std::size_t i = 0; i < items.size(); i += 2) {
      if (d.size() < 16 && items[i].is_string()) {  // small dicts: replace a repeated key
        auto same = [&](const auto& kv) {
          return kv.first.is_string() && kv.first.as_string() == items[i].as_string();
        };
        auto it = std::find_if(d.begin(), d.end(), same);
        if (it != d.end()) {
          it->second = std::move(items[i + 1]);
          continue;
        }
      }
      d.emplace_back(std::move(items[i]), std::move(items[i + 1]));
    }
  }
  void put(std::uint64_t index) {
    count_object();
    memo_[index] = top();
  }
  void get(std::uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail("memo entry " + std::to_string(index) + " used before it was stored");
    push(it->second);
  }
  std::int64_t long_bytes(std::size_t n) {  // little-endian two's complement
    std::string_view b = take(n);
    if (n == 0) return 0;
    const bool negative = static_cast<unsigned char>(b[n - 1]) & 0x80;
    for (std::size_t i = 8; i < n; ++i)  // bytes beyond 8 may only extend the sign
      if (static_cast<unsigned char>(b[i]) != (negative ? 0xff : 0x00) ||
          (static_cast<unsigned char>(b[7]) & 0x80) != (negative ? 0x80 : 0))
        fail("integer does not fit in 64 bits");
    std::uint64_t v = negative ? ~std::uint64_t{0} : 0;
    for (std::size_t i = std::min<std::size_t>(n, 8); i-- > 0;)
      v = v << 8 | static_cast<unsigned char>(b[i]);
    return static_cast<std::int64_t>(v);
  }
  std::int64_t text_int(std::string_view text) {
    if (text.ends_with('L')) text.remove_suffix(1);
    std::int64_t v = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc{} || end != text.data() + text.size())
      fail("bad integer '" + std::string(text) + "'");
    return v;
  }
  std::uint64_t text_index(std::string_view text) {
    return static_cast<std::uint64_t>(text_int(text));
  }

  void step(unsigned char op);

  std::string_view data_;
  const std::string& file_;
  Document::Storage& doc_;
  std::size_t pos_ = 0;
  std::size_t op_at_ = 0;
  std::vector<Value> stack_;
  std::vector<std::size_t> marks_;  // stack sizes at each MARK
  std::unordered_map<std::uint64_t, Value> memo_;
  std::size_t objects_left_;
  std::size_t max_objects_;
};

void Machine::step(unsigned char op) {
  switch (op) {
    // framing and protocol
    case 0x80: {  // PROTO
      const auto proto = static_cast<unsigned char>(take(1)[0]);
      if (proto > 5) fail("unsupported pickle protocol " + std::to_string(proto));
      return;
    }
    case 0x95: little_endian(8); return;  // FRAME: a size hint for buffered readers

    // the stack
    case '(': marks_.push_back(stack_.size()); return;  // MARK
    case '0': pop(); return;                            // POP
    case '1': pop_mark(); return;                       // POP_MARK
    case '2': push(top()); return;                      // DUP

    // scalars
    case 'N': push(Value()); return;
    case 0x88: push(boolean(true)); return;
    case 0x89: push(boolean(false)); return;
    case 'J': push(integer(static_cast<std::int32_t>(little_endian(4)))); return;  // BININT
    case 'K': push(integer(static_cast<std::int64_t>(little_endian(1)))); return;  // BININT1
    case 'M': push(integer(static_cast<std::int64_t>(little_endian(2)))); return;  // BININT2
    case 0x8a: push(integer(long_bytes(static_cast<std::size_t>(little_endian(1))))); return;
    case 0x8b: push(integer(long_bytes(length(4)))); return;  // LONG4
    case 'I': {  // INT (text); "00" and "01" are protocol 0's False and True
      std::string_view t = text_line();
      if (t == "00" || t == "01") push(boolean(t == "01"));
      else push(integer(text_int(t)));
      return;
    }
    case 'L': push(integer(text_int(text_line()))); return;  // LONG (text)
    case 'G': {  // BINFLOAT: big-endian IEEE 754
      std::uint64_t bits = 0;
      for (char c : take(8)) bits = bits << 8 | static_cast<unsigned char>(c);
      push(floating(std::bit_cast<double>(bits)));
      return;
    }
    case 'F': {  // FLOAT (text)
      std::string t(text_line());
      char* end = nullptr;
      const double d = std::strtod(t.c_str(), &end);
      if (t.empty() || *end) fail("bad float '" + t + "'");
      push(floating(d));
      return;
    }

    // strings and bytes
    case 0x8c: push(string(take(length(1)))); return;  // SHORT_BINUNICODE
    case 'X': push(string(take(length(4)))); return;   // BINUNICODE
    case 0x8d: push(string(take(length(8)))); return;  // BINUNICODE8
    case 'U': push(bytes(take(length(1)))); return;    // SHORT_BINSTRING
    case 'T': push(bytes(take(length(4)))); return;    // BINSTRING
    case 'C': push(bytes(take(length(1)))); return;    // SHORT_BINBYTES
    case 'B': push(bytes(take(length(4)))); return;    // BINBYTES
    case 0x8e: push(bytes(take(length(8)))); return;   // BINBYTES8
    case 0x96: push(bytes(take(length(8)))); return;   // BYTEARRAY8

    // containers
    case '}': push(dict()); return;                  // EMPTY_DICT
    case ']': push(list(K::list)); return;           // EMPTY_LIST
    case ')': push(list(K::tuple)); return;          // EMPTY_TUPLE
    case 0x8f: push(list(K::set)); return;           // EMPTY_SET
    case 'l': push(list(K::list, pop_mark())); return;    // LIST
    case 't': push(list(K::tuple, pop_mark())); return;   // TUPLE
    case 0x91: push(list(K::set, pop_mark())); return;    // FROZENSET
    case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
      const std::size_t n = op - 0x84u;
      if (stack_.size() < floor() + n) fail("stack underflow");
      List items(std::make_move_iterator(stack_.end() - static_cast<std::ptrdiff_t>(n)),
                 std::make_move_iterator(stack_.end()));
      stack_.resize(stack_.size() - n);
      push(list(K::tuple, std::move(items)));
      return;
    }
    case 'd': {  // DICT
      List items = pop_mark();
      Value d = dict();
      set_items(d, items);
      push(std::move(d));
      return;
    }
    case 'a': {  // APPEND
      Value item = pop();
      items_of(container(K::list, "APPEND")).push_back(std::move(item));
      return;
    }
    case 'e': {  // APPENDS
      List items = pop_mark();
      List& list = items_of(container(K::list, "APPENDS"));
      list.insert(list.end(), std::make_move_iterator(items.begin()), std::make_move_iterator(items.end()));
      return;
    }
    case 0x90: {  // ADDITEMS
      List items = pop_mark();
      List& set = items_of(container(K::set, "ADDITEMS"));
      set.insert(set.end(), std::make_move_iterator(items.begin()), std::make_move_iterator(items.end()));
      return;
    }
    case 's': {  // SETITEM
      List items(2);
      items[1] = pop();
      items[0] = pop();
      set_items(container(K::dict, "SETITEM"), items);
      return;
    }
    case 'u': {  // SETITEMS
      List items = pop_mark();
      set_items(container(K::dict, "SETITEMS"), items);
      return;
    }

    // the memo
    case 0x94: put(memo_.size()); return;                  // MEMOIZE
    case 'q': put(little_endian(1)); return;               // BINPUT
    case 'r': put(little_endian(4)); return;               // LONG_BINPUT
    case 'p': put(text_index(text_line())); return;        // PUT
    case 'h': get(little_endian(1)); return;               // BINGET
    case 'j': get(little_endian(4)); return;               // LONG_BINGET
    case 'g': get(text_index(text_line())); return;        // GET

    // code, objects and out-of-band data: never run
    case 'c': fail("GLOBAL opcode: the pickle imports Python code; only plain data is accepted");
    case 0x93: fail("STACK_GLOBAL opcode: the pickle imports Python code; only plain data is accepted");
    case 'R': fail("REDUCE opcode: the pickle calls Python code; only plain data is accepted");
    case 'b': fail("BUILD opcode: the pickle builds a Python object; only plain data is accepted");
    case 'i': fail("INST opcode: the pickle builds a Python object; only plain data is accepted");
    case 'o': fail("OBJ opcode: the pickle builds a Python object; only plain data is accepted");
    case 0x81: fail("NEWOBJ opcode: the pickle builds a Python object; only plain data is accepted");
    case 0x92: fail("NEWOBJ_EX opcode: the pickle builds a Python object; only plain data is accepted");
    case 0x82: case 0x83: case 0x84: fail("EXT opcode: extension registry objects are not accepted");
    case 'P': case 'Q': fail("persistent id opcode: external objects are not accepted");
    case 0x97: case 0x98: fail("out-of-band buffer opcode: not accepted");
    case 'S': case 'V': fail("protocol 0 text string: not supported (use protocol 2 or later)");
    default: {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", op);
      fail(std::string("unknown opcode ") + hex);
    }
  }
}

}  // namespace detail

Document parse(std::string_view data, const std::string& file, std::size_t max_objects) {
  if (data.empty()) throw BadInputError(file, 0, "empty pickle");
  Document doc;
  detail::Machine(data, file, max_objects, doc).run();
  return doc;
}

}  // namespace gmem::pickle
