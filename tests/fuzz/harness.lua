-- harness.lua (tests/fuzz, appended to record.lua by fuzz_lua_record): the codec's own properties.
-- KEYS[1] holds the fuzzed record; ARGV: op, fence, token, result (op acquire: the fingerprint).
-- Reply: 'ok', or an error 'HARNESS ...' when a property fails (the fuzz target aborts on it).
-- Any error the codec raises must be IDEMCORRUPT: the client maps that to corrupt_record_error.
local op, fence, token, result = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local s = redis.call('GET', KEYS[1])

local function corrupt_only(ok, e)
  if ok then return end
  -- Redis hands pcall the error table's text (7.0) or the table itself (older servers).
  local m = type(e) == 'table' and e.err or e
  if type(m) == 'string' and string.sub(m, 1, 12) == 'IDEMCORRUPT ' then return end
  error({err = 'HARNESS the codec raised a non-IDEMCORRUPT error: ' .. tostring(m)})
end

local function same(a, b)
  if a ~= a and b ~= b then return true end -- NaN
  return a == b
end

local function same_record(a, b)
  for _, f in ipairs({'st', 'perm', 'gen', 'tok', 'fp', 'pay', 'owner', 'lease', 'retry'}) do
    if not same(a[f], b[f]) then return f end
  end
  return nil
end

local okd, r = pcall(decode, s)
corrupt_only(okd, r)

if op == 'roundtrip' then
  -- what decode accepts, encode writes back to a value that decodes to the same record
  if okd then
    local e = encode(r)
    local ok2, r2 = pcall(decode, e)
    if not ok2 then error({err = 'HARNESS decode refused what encode wrote'}) end
    local f = same_record(r, r2)
    if f then error({err = 'HARNESS field ' .. f .. ' changed through encode + decode'}) end
  end
  return 'ok'
end

if op == 'complete' then
  -- complete_key's fast path must write byte for byte what decode + the transition + encode give
  local okc, w = pcall(complete_key, KEYS[1], fence, token, result, '600000')
  corrupt_only(okc, w)
  local got = redis.call('GET', KEYS[1])
  if not okd then
    if okc and w == 1 then error({err = 'HARNESS complete wrote over a record decode refuses'}) end
    return 'ok'
  end
  if not okc then error({err = 'HARNESS complete refused a record decode accepts'}) end
  local want_w, want = 0, s
  if r.gen == tonumber(fence) and r.tok == token then
    if r.st == 2 and not r.perm and r.pay == result then
      want_w = 1
    elseif r.st == 1 then
      r.st, r.pay, r.perm = 2, result, false
      want_w, want = 1, encode(r)
    end
  end
  if w ~= want_w then error({err = 'HARNESS complete answered ' .. tostring(w) .. ', the decoded record says ' .. want_w}) end
  if got ~= want then error({err = 'HARNESS complete wrote other bytes than decode + encode'}) end
  return 'ok'
end

if op == 'acquire' then
  -- acquire_key's fast path for completed records must answer what its decoding path answers
  local fp = result
  local okf, c = pcall(completed_reply, s, fp)
  if not okf then error({err = 'HARNESS completed_reply raised an error: ' .. tostring(c)}) end
  if c == nil then return 'ok' end
  if not okd then error({err = 'HARNESS completed_reply answered for a record decode refuses'}) end
  -- The record itself, for the usual completed one: read as parse_acquire reads it.
  if type(c) == 'string' then
    local h = string.byte(s, 1)
    if c ~= s or not ((h == 162 and #s >= 14) or (h == 130 and #s == 10)) then
      error({err = 'HARNESS completed_reply answered other bytes'})
    end
    c = {3, string.byte(s, 2), h == 162 and string.sub(s, 15) or ''}
  end
  local want
  if fp ~= '' and r.fp ~= '' and r.fp ~= fp then want = {5, r.gen}
  elseif r.st ~= 2 then error({err = 'HARNESS completed_reply answered for a record in state ' .. r.st})
  elseif r.perm then want = {6, r.gen, r.pay}
  else want = {3, r.gen, r.pay} end
  if #c ~= #want then error({err = 'HARNESS completed_reply answered ' .. #c .. ' fields, decode says ' .. #want}) end
  for i = 1, #want do
    if c[i] ~= want[i] then error({err = 'HARNESS completed_reply field ' .. i .. ' differs from decode'}) end
  end
  return 'ok'
end
return 'ok'
