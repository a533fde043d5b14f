#pragma once
// A strict, small JSON reader for the tests: Prometheus's HTTP API answers (prometheus_server.hpp)
// and the Grafana dashboard (docs/operations/idem-dashboard.json). Rejects what RFC 8259 rejects
// (trailing commas, comments, bare words, trailing garbage), so a dashboard Grafana would refuse
// fails here.

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <fmt/core.h>

namespace idem_test {

struct Json;
using JsonArray = std::vector<Json>;
using JsonObject = std::map<std::string, Json>;

/// One JSON value; objects keep their keys sorted (order is not meaningful in JSON).
struct Json {
  std::variant<std::nullptr_t, bool, double, std::string, std::shared_ptr<JsonArray>, std::shared_ptr<JsonObject>> v;

  [[nodiscard]] bool is_null() const { return std::holds_alternative<std::nullptr_t>(v); }
  [[nodiscard]] bool is_string() const { return std::holds_alternative<std::string>(v); }
  [[nodiscard]] bool is_number() const { return std::holds_alternative<double>(v); }
  [[nodiscard]] bool is_array() const { return std::holds_alternative<std::shared_ptr<JsonArray>>(v); }
  [[nodiscard]] bool is_object() const { return std::holds_alternative<std::shared_ptr<JsonObject>>(v); }

  [[nodiscard]] const std::string& str() const {
    if (!is_string()) throw std::runtime_error("json: not a string");
    return std::get<std::string>(v);
  }
  [[nodiscard]] double num() const {
    if (!is_number()) throw std::runtime_error("json: not a number");
    return std::get<double>(v);
  }
  [[nodiscard]] bool boolean() const {
    if (!std::holds_alternative<bool>(v)) throw std::runtime_error("json: not a boolean");
    return std::get<bool>(v);
  }
  [[nodiscard]] const JsonArray& arr() const {
    if (!is_array()) throw std::runtime_error("json: not an array");
    return *std::get<std::shared_ptr<JsonArray>>(v);
  }
  [[nodiscard]] const JsonObject& obj() const {
    if (!is_object()) throw std::runtime_error("json: not an object");
    return *std::get<std::shared_ptr<JsonObject>>(v);
  }
  [[nodiscard]] bool has(const std::string& key) const { return is_object() && obj().count(key) != 0; }
  /// The member `key` of an object; throws naming the key when it is missing.
  [[nodiscard]] const Json& operator[](const std::string& key) const {
    const auto& o = obj();
    const auto it = o.find(key);
    if (it == o.end()) throw std::runtime_error(fmt::format("json: no member \"{}\"", key));
    return it->second;
  }
};

namespace detail_json {

class Reader {
public:
  explicit Reader(std::string_view text) : s_(text) {}

  Json document() {
    Json j = value(0);
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return j;
  }

private:
  [[noreturn]] void fail(std::string_view what) const {
    std::size_t line = 1;
    for (std::size_t k = 0; k < i_ && k < s_.size(); ++k) line += s_[k] == '\n';
    throw std::runtime_error(fmt::format("json: {} at line {} (offset {})", what, line, i_));
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool eat(char c) {
    ws();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(fmt::format("expected '{}'", c));
  }
  void word(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) fail("bad literal");
    i_ += w.size();
  }

  Json value(int depth) {
    if (depth > 200) fail("nesting too deep");
    ws();
    if (i_ >= s_.size()) fail("unexpected end");
    const char c = s_[i_];
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') return Json{string()};
    if (c == 't') return word("true"), Json{true};
    if (c == 'f') return word("false"), Json{false};
    if (c == 'n') return word("null"), Json{nullptr};
    if (c == '-' || (c >= '0' && c <= '9')) return Json{number()};
    fail("unexpected character");
  }

  Json object(int depth) {
    auto o = std::make_shared<JsonObject>();
    expect('{');
    if (eat('}')) return Json{o};
    do {
      ws();
      if (i_ >= s_.size() || s_[i_] != '"') fail("expected a key");
      std::string key = string();
      expect(':');
      if (!o->emplace(key, value(depth + 1)).second) fail(fmt::format("duplicate key \"{}\"", key));
    } while (eat(','));
    expect('}');
    return Json{o};
  }

  Json array(int depth) {
    auto a = std::make_shared<JsonArray>();
    expect('[');
    if (eat(']')) return Json{a};
    do a->push_back(value(depth + 1));
    while (eat(','));
    expect(']');
    return Json{a};
  }

  double number() {
    const std::size_t start = i_;
    if (s_[i_] == '-') ++i_;
    auto digits = [&] {
      const std::size_t d = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ == d) fail("expected a digit");
    };
    if (i_ < s_.size() && s_[i_] == '0') ++i_;
    else digits();
    if (i_ < s_.size() && s_[i_] == '.') ++i_, digits();
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      digits();
    }
    return std::strtod(std::string(s_.substr(start, i_ - start)).c_str(), nullptr);
  }

  static void utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::uint32_t hex4() {
    if (i_ + 4 > s_.size()) fail("short \\u escape");
    std::uint32_t cp = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[i_++];
      cp <<= 4;
      if (h >= '0' && h <= '9') cp |= static_cast<std::uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f') cp |= static_cast<std::uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') cp |= static_cast<std::uint32_t>(h - 'A' + 10);
      else fail("bad \\u escape");
    }
    return cp;
  }

  std::string string() {
    ++i_;  // the opening quote
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      switch (s_[i_++]) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (s_.substr(i_, 2) != "\\u") fail("lone surrogate");
            i_ += 2;
            const std::uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

}  // namespace detail_json

/// Parses a whole JSON document; throws std::runtime_error with the line on malformed input.
inline Json parse_json(std::string_view text) { return detail_json::Reader(text).document(); }

}  // namespace idem_test
