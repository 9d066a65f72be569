// A reader for Python pickles that hold plain data (dicts, lists, tuples, sets, strings, bytes,
// ints, floats, bools, None), such as torch.cuda.memory._dump_snapshot() files.
//
// A pickle is a program for a stack machine that may import and call any Python function, so
// only the opcodes that build data are accepted; GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ,
// NEWOBJ and the like are rejected with an error naming the opcode and its offset. The reader
// makes one forward pass with an explicit stack (no recursion, so deep nesting cannot overflow
// the C stack). Containers are shared, as in Python: an object the pickle refers to twice
// (through its memo) is one object here too, so repeated frames cost nothing. Everything lives
// in the Document that parse() returns; a Value is a small handle into it (cycles, which a
// pickle may contain, are harmless).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace gmem::pickle {

class Value;
using List = std::vector<Value>;                    // list, tuple or set items
using Dict = std::vector<std::pair<Value, Value>>;  // in insertion order
namespace detail { class Machine; }

class Value {
 public:
  enum class Kind : std::uint8_t { none, boolean, integer, floating, string, bytes, list, tuple, set, dict };

  Value() = default;  // None
  Kind kind() const { return kind_; }
  const char* kind_name() const { return name_of(kind_); }  // "int", "str", ... as in Python
  static const char* name_of(Kind kind);
  bool is_none() const { return kind_ == Kind::none; }
  bool is_int() const { return kind_ == Kind::integer; }
  bool is_string() const { return kind_ == Kind::string; }
  bool is_sequence() const { return kind_ == Kind::list || kind_ == Kind::tuple || kind_ == Kind::set; }
  bool is_dict() const { return kind_ == Kind::dict; }

  // Accessors: the value must be of that kind (checked; std::logic_error otherwise).
  bool as_bool() const;
  std::int64_t as_int() const;
  double as_float() const;               // ints convert
  const std::string& as_string() const;  // str or bytes
  const List& as_list() const;           // list, tuple or set
  const Dict& as_dict() const;

  // The value under the string key `key` of a dict; nullptr when absent or not a dict.
  const Value* get(std::string_view key) const;

 private:
  friend class detail::Machine;
  using Payload = std::variant<std::monostate, bool, std::int64_t, double, const std::string*, List*, Dict*>;
  template <class T>
  Value(Kind kind, T payload) : kind_(kind), payload_(payload) {}
  void expect(bool ok, const char* wanted) const;

  Kind kind_ = Kind::none;
  Payload payload_;
};

// A parsed pickle: owns every string and container its values refer to. Move-only.
class Document {
 public:
  const Value& root() const { return storage_->root; }

 private:
  friend class detail::Machine;
  struct Storage {
    std::deque<std::string> strings;
    std::deque<List> lists;
    std::deque<Dict> dicts;
    Value root;
  };
  std::unique_ptr<Storage> storage_ = std::make_unique<Storage>();
};

// Reads the pickle in `data`. Throws BadInputError(file, 0, "pickle byte N: problem") for
// truncated or malformed data and for opcodes that are not plain data, and "exceeds N objects"
// when it pushes more than `max_objects` values (built, or references to built ones) or memo
// entries: each costs memory, and a few bytes of pickle can ask for one (ReadLimits::max_objects).
Document parse(std::string_view data, const std::string& file,
               std::size_t max_objects = static_cast<std::size_t>(-1));

}  // namespace gmem::pickle
