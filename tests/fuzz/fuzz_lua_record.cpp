// libFuzzer: the Lua record codec (src/redis/lua/record.lua) as Redis runs it: through a real
// redis-server (run_fuzz.sh starts one on a unix socket, IDEM_FUZZ_REDIS_SOCKET) with each
// script built as idem builds it (record.lua, then the script). Redis's Lua 5.1 with its struct
// and bit libraries is what the codec targets; a Debian Lua interpreter lacks struct.
// Input: byte 0 the script, byte 1 the fence (odd: the record's own 1-byte generation), bytes
// 2..9 the token (when byte 1 is odd: the record's own token bytes), then the stored record.
// Oracles: every script either answers or fails with IDEMCORRUPT (never another Lua error); the
// harness checks decode/encode round-trips and complete's fast path against decode + encode.

#include <hiredis/hiredis.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

redisContext* ctx = nullptr;
std::vector<std::string> shas;  // per op, see ops
const char* const ops[] = {"acquire", "complete", "fail", "extend", "inspect", "harness:roundtrip", "harness:complete", "harness:acquire"};
constexpr int n_ops = 7;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "fuzz_lua_record: cannot read %s\n", path.c_str());
    std::abort();
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

redisReply* command(const std::vector<std::string>& args) {
  std::vector<const char*> argv;
  std::vector<std::size_t> lens;
  for (const auto& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  auto* r = static_cast<redisReply*>(
      redisCommandArgv(ctx, static_cast<int>(args.size()), argv.data(), lens.data()));
  if (!r) {
    std::fprintf(stderr, "fuzz_lua_record: redis connection lost: %s\n", ctx->errstr);
    std::abort();
  }
  return r;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* sock = std::getenv("IDEM_FUZZ_REDIS_SOCKET");
  if (!sock) {
    std::fprintf(stderr, "fuzz_lua_record: set IDEM_FUZZ_REDIS_SOCKET (tests/fuzz/run_fuzz.sh starts a server)\n");
    std::abort();
  }
  ctx = redisConnectUnix(sock);
  if (!ctx || ctx->err) {
    std::fprintf(stderr, "fuzz_lua_record: cannot connect to %s\n", sock);
    std::abort();
  }
  const std::string dir = IDEM_LUA_DIR;
  const std::string record = slurp(dir + "/record.lua");
  for (const char* op : ops) {
    const std::string name(op);
    const std::string body = name.rfind("harness:", 0) == 0 ? slurp(IDEM_FUZZ_HARNESS) : slurp(dir + "/" + name + ".lua");
    redisReply* r = command({"SCRIPT", "LOAD", record + "\n" + body});
    if (r->type != REDIS_REPLY_STRING) {
      std::fprintf(stderr, "fuzz_lua_record: SCRIPT LOAD %s failed: %s\n", op, r->str ? r->str : "?");
      std::abort();
    }
    shas.emplace_back(r->str, r->len);
    freeReplyObject(r);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 10) return 0;
  const int op = data[0] % n_ops;
  const std::string rec(reinterpret_cast<const char*>(data + 10), size - 10);
  std::string fence = std::to_string(data[1] >> 1);
  std::string token(reinterpret_cast<const char*>(data + 2), 8);
  if ((data[1] & 1) && rec.size() >= 10) {
    fence = std::to_string(static_cast<unsigned char>(rec[1]));
    token = rec.substr(2, 8);
  }
  const std::string key = "fuzz:{k}";
  freeReplyObject(command({"SET", key, rec}));
  std::vector<std::string> args{"EVALSHA", shas[static_cast<std::size_t>(op)], "1", key};
  const std::string name(ops[op]);
  if (name == "acquire") args.insert(args.end(), {token, "30000", "600000", "", "owner"});
  if (name == "complete") args.insert(args.end(), {fence, token, "result", "600000"});
  if (name == "fail") args.insert(args.end(), {fence, token, "boom", data[1] & 2 ? "1" : "0", data[1] & 4 ? "1" : "0", "1000", "600000"});
  if (name == "extend") args.insert(args.end(), {fence, token, "30000"});
  if (name == "harness:roundtrip") args.insert(args.end(), {"roundtrip", fence, token, ""});
  if (name == "harness:complete") args.insert(args.end(), {"complete", fence, token, data[1] & 2 ? "" : "result"});
  // the fingerprint asked with: none, or the input's token bytes (equal to the record's when the fuzzer makes them so)
  if (name == "harness:acquire") args.insert(args.end(), {"acquire", fence, token, data[1] & 2 ? "" : token});
  redisReply* r = command(args);
  if (r->type == REDIS_REPLY_ERROR) {
    const std::string e(r->str, r->len);
    // IDEMCORRUPT is the codec refusing the value: the one error a damaged record may cause.
    if (e.rfind("IDEMCORRUPT ", 0) != 0) {
      std::fprintf(stderr, "fuzz_lua_record: %s answered: %s\n", ops[op], e.c_str());
      std::abort();
    }
  }
  freeReplyObject(r);
  return 0;
}
