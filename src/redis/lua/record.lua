-- record.lua: the packed record codec, the clock and the per-key transitions shared by every idem
-- script. The build prepends it to each script, so each generated script runs alone (EVALSHA, or
-- redis-cli --eval), and the single-key and batch scripts decide through the same code.
--
-- One record per key, one Redis string, big-endian (struct library):
--   B  header: 0x80 (format v1) | state (1 in_progress, 2 completed, 3 failed) | 0x04 permanent
--             | 0x10 has fingerprint | 0x20 has payload | generation width (0x08 and 0x40, below)
--             0x04 on a completed record: completed without its result (complete_unavailable);
--             the payload is then why. Older versions never set it there, so the format is v1 still.
--   generation: the fence, which is also the number of acquisitions; B, H, I4 or d by width
--   c8 token of the latest acquisition (the fence alone is not enough: see docs/design.md)
--   in_progress only: d lease_until_ms, H owner length, owner bytes
--   failed only:      d retry_at_ms
--   0x10: H length, fingerprint bytes
--   0x20: I4 length, payload bytes (the result when completed, the error when failed)
-- A completed record with an empty result and no fingerprint is 10 bytes, which Redis stores
-- inside its object header: that is what keeps a retained record under 100 bytes.
-- The key's TTL (SET ... PX) is the retention; Redis expires it, and an expired record is absent.

-- Redis >= 5 replicates scripts by their effects, which is what lets them call TIME before a
-- write; on older servers that write fails (error reply, nothing changed). This file runs on
-- every script call, so it allocates nothing per call that it can spell as a constant.
-- Its functions are closures created on every call, and each chunk-level local one of them uses
-- is an upvalue that costs each call a little: so the functions write the states as literals
-- (1 in_progress, 2 completed, 3 failed) and reach string/bit/struct through their globals or
-- function-level locals. The names below are for the scripts' own use.

local IN_PROGRESS, COMPLETED, FAILED = 1, 2, 3

local function corrupt(why)
  error({err = 'IDEMCORRUPT idem record ' .. why .. ', so it was not written by this idem version'})
end

-- The server's clock in ms, read once per script call: every step of a call (a batch's keys, a
-- coalesced call's steps) is decided at one server time, as one atomic script runs at one instant.
-- This chunk runs again on every call, so `clock` starts out nil in each. (TIME's two fields are
-- decimal strings; Lua's arithmetic converts them as tonumber would.)
local clock
local function now_ms()
  if not clock then
    local t = redis.call('TIME')
    clock = t[1] * 1000 + math.floor(t[2] / 1000)
  end
  return clock
end

-- The codec reads and writes the layout above with string.byte/sub/char, and struct only with
-- constant formats (doubles, 16- and 32-bit lengths): no format string is built per call. A value
-- is refused (IDEMCORRUPT) unless it has the v1 bit, a state, parses to exactly its length and
-- holds an integer generation >= 1; the messages are those of the struct-based decoder before it.
local function decode(s)
  local byte, band = string.byte, bit.band
  local n = #s
  if n < 10 then corrupt('is ' .. n .. ' bytes long') end
  local h = byte(s, 1)
  local st = h % 4
  if h < 128 or st == 0 then corrupt('has an unknown header byte ' .. h) end
  local gw, gen, p = band(h, 72)
  -- n >= 10, so every generation width fits; p is the token's first byte.
  if gw == 0 then
    gen, p = byte(s, 2), 3
  elseif gw == 8 then
    local a, b = byte(s, 2, 3)
    gen, p = a * 256 + b, 4
  elseif gw == 64 then
    local a, b, c, d = byte(s, 2, 5)
    gen, p = ((a * 256 + b) * 256 + c) * 256 + d, 6
  else
    gen, p = struct.unpack('>d', s, 2)
  end
  local q = p + 8 -- the first byte after the token
  if q > n + 1 then corrupt('of ' .. n .. ' bytes does not parse') end
  local r = {st = st, perm = band(h, 4) ~= 0, gen = gen, tok = string.sub(s, p, q - 1), fp = '', pay = '',
             owner = ''}
  if st == 1 then -- in_progress: lease, owner
    if q + 9 > n then corrupt('of ' .. n .. ' bytes does not parse') end
    local a, b = byte(s, q + 8, q + 9)
    local e = q + 10 + a * 256 + b
    if e > n + 1 then corrupt('of ' .. n .. ' bytes does not parse') end
    r.lease, r.owner, q = struct.unpack('>d', s, q), string.sub(s, q + 10, e - 1), e
  elseif st == 3 then -- failed: retry time
    if q + 7 > n then corrupt('of ' .. n .. ' bytes does not parse') end
    r.retry, q = struct.unpack('>d', s, q), q + 8
  end
  if band(h, 16) ~= 0 then
    if q + 1 > n then corrupt('of ' .. n .. ' bytes does not parse') end
    local a, b = byte(s, q, q + 1)
    local e = q + 2 + a * 256 + b
    if e > n + 1 then corrupt('of ' .. n .. ' bytes does not parse') end
    r.fp, q = string.sub(s, q + 2, e - 1), e
  end
  if band(h, 32) ~= 0 then
    if q + 3 > n then corrupt('of ' .. n .. ' bytes does not parse') end
    local a, b, c, d = byte(s, q, q + 3)
    local e = q + 4 + ((a * 256 + b) * 256 + c) * 256 + d
    if e > n + 1 then corrupt('of ' .. n .. ' bytes does not parse') end
    r.pay, q = string.sub(s, q + 4, e - 1), e
  end
  if q ~= n + 1 then corrupt('of ' .. n .. ' bytes does not parse') end
  if gen < 1 or gen ~= math.floor(gen) then corrupt('has generation ' .. tostring(gen)) end
  return r
end

local function encode(r)
  local st, g, tok, fp, pay = r.st, r.gen, r.tok, r.fp, r.pay
  local h = 128 + st
  if r.perm then h = h + 4 end
  if fp ~= '' then h, fp = h + 16, struct.pack('>H', #fp) .. fp end
  if pay ~= '' then h, pay = h + 32, struct.pack('>I4', #pay) .. pay end
  if #tok ~= 8 then tok = struct.pack('c8', tok) end -- as c8 always did: an error when short, cut when long
  -- the header and the generation in the narrowest width that holds it
  if g < 256 then h = string.char(h, g)
  elseif g < 65536 then h = struct.pack('>BH', h + 8, g)
  elseif g < 4294967296 then h = struct.pack('>BI4', h + 64, g)
  else h = struct.pack('>Bd', h + 72, g) end
  if st == 1 then return h .. tok .. struct.pack('>dH', r.lease, #r.owner) .. r.owner .. fp .. pay end
  if st == 3 then return h .. tok .. struct.pack('>d', r.retry) .. fp .. pay end
  return h .. tok .. fp .. pay
end

-- The record of a new key (fence 1, in_progress, no payload): byte for byte what encode writes for
-- it, without a record table. A token that is not 8 bytes goes through encode (which refuses or cuts it).
-- Every new key of one call shares the lease's end and the owner (one clock reading per call, and
-- a coalesced call's steps mostly carry the same lease and owner), so the bytes after the token
-- are packed once per call and per (lease, owner) (fresh_tail): one concatenation per key.
local fresh_lease, fresh_owner, fresh_tail
local function fresh_record(token, lease, owner, fp)
  if lease ~= fresh_lease or owner ~= fresh_owner then
    fresh_tail = struct.pack('>dH', now_ms() + lease, #owner) .. owner
    fresh_lease, fresh_owner = lease, owner
  end
  if #token ~= 8 then
    return encode({st = 1, gen = 1, tok = token, lease = now_ms() + lease, owner = owner, fp = fp, pay = ''})
  end
  if fp == '' then return '\129\1' .. token .. fresh_tail end
  return '\145\1' .. token .. fresh_tail .. struct.pack('>H', #fp) .. fp
end

-- The record whose latest holder is `fence` and `token`, in any state, or nil.
local function of_holder(key, fence, token)
  local raw = redis.call('GET', key)
  if not raw then return nil end
  local r = decode(raw)
  if r.gen ~= tonumber(fence) or r.tok ~= token then return nil end
  return r
end

-- The record of a live holder (state in_progress, fence and token equal), or nil.
local function held(key, fence, token)
  local r = of_holder(key, fence, token)
  if r and r.st == 1 then return r end
  return nil
end

-- A step found already done writes nothing, so a WAIT sent after it (min_replica_acks) would count
-- replicas against this connection's writes alone and could pass before the first request's write
-- reached them. Setting the key's expiry to what it is now is a write that replicates after that
-- first one, so the WAIT covers it. (Redis propagates it as PEXPIREAT: the same instant, within 1 ms.)
local function touch(key)
  local ttl = redis.call('PTTL', key)
  if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
end

-- A holder's write that finds its own step already done answers as the step did (1): the client
-- sends a request once more, as the same holder, when the reply to the first was lost (the first
-- may have run). The step is recognised by the same holder and the same data, so a different
-- second write by that holder is still refused (0): a completed record is never overwritten.

-- Retention `ret` stays the decimal string the client sent: SET takes it as is, math.max reads it
-- as a number, and no number is formatted back to text on the hot path.

-- The reply to an acquire of a completed record (a duplicate: the common answer under redelivery),
-- read without decode: no record table, no TIME. Takes a completed record as encode writes it
-- (generation in 1, 2 or 4 bytes) checked to its last byte; answers what acquire_key's decoding
-- path answers for it ({3 | 6, generation, payload}, or {5, generation} on a fingerprint mismatch),
-- and nil for anything else, which then goes through decode (IDEMCORRUPT for a damaged record).
-- The fuzz harness (tests/fuzz/harness.lua) holds it to decode's answer on arbitrary bytes.
local function completed_reply(s, fp)
  local n = #s
  local h, g = string.byte(s, 1, 2)
  -- The usual one first: header 162 (v1, completed, a payload; no fingerprint, no permanent bit,
  -- a 1-byte generation), the payload's length reaching exactly the last byte.
  -- Answered with the record itself: the client reads {3, generation, payload} out of it
  -- (parse_acquire), which spares the server a reply table and a copy of the payload: a third of
  -- a coalesced duplicate's instructions (callgrind, scripts/bench-lua).
  if h == 162 and n >= 14 then
    local a, b, c, d = string.byte(s, 11, 14)
    if ((a * 256 + b) * 256 + c) * 256 + d == n - 14 and g > 0 then return s end
  end
  -- And the one of an empty result (header 130: no payload section), 10 bytes.
  if h == 130 and n == 10 and g > 0 then return s end
  -- v1 (h >= 128), state 2 (h % 4), not the 8-byte generation (8 and 64 both set)
  if n < 10 or h < 128 or h % 4 ~= 2 or (h % 16 >= 8 and h >= 192) then return nil end
  local gen, q
  if h < 192 and h % 16 < 8 then
    gen, q = string.byte(s, 2), 11
  elseif h < 192 then
    local a, b = string.byte(s, 2, 3)
    gen, q = a * 256 + b, 12
  else
    if n < 13 then return nil end
    local a, b, c, d = string.byte(s, 2, 5)
    gen, q = ((a * 256 + b) * 256 + c) * 256 + d, 14
  end
  if gen < 1 then return nil end
  -- q: the first byte after the token
  local mismatch = false
  if h % 32 >= 16 then -- fingerprint section
    if q + 1 > n then return nil end
    local a, b = string.byte(s, q, q + 1)
    local e = q + 2 + a * 256 + b
    if e > n + 1 then return nil end
    mismatch = fp ~= '' and e > q + 2 and string.sub(s, q + 2, e - 1) ~= fp
    q = e
  end
  local pay = ''
  if h % 64 >= 32 then -- payload section, to the last byte
    if q + 3 > n then return nil end
    local a, b, c, d = string.byte(s, q, q + 3)
    if q + 4 + ((a * 256 + b) * 256 + c) * 256 + d ~= n + 1 then return nil end
    pay = string.sub(s, q + 4)
  elseif q ~= n + 1 then
    return nil
  end
  if mismatch then return {5, gen} end
  if h % 8 >= 4 then return {6, gen, pay} end
  return {3, gen, pay}
end

-- Acquire of one key (docs/design.md, section 1). Reply: 1 (a new key acquired: fence 1, no
-- takeover; the common answer, as an integer because a table reply costs Redis a conversion of its
-- own) | {1 acquired, fence, takeover 0/1}
-- | {2 in_flight, attempts, retry_after ms} | {3 duplicate, attempts, result}
-- | the completed record itself, for the usual ones (header 0xA2 or 0x82: see completed_reply)
-- | {4 previously_failed, attempts, error} | {5 mismatch, attempts}
-- | {6 duplicate without its result, attempts, why}
-- An in_progress record that already holds this token is this very acquisition asked again (its
-- reply was lost; tokens are random per acquisition): acquired with the same fence, the lease
-- renewed, takeover 0.
-- A batch passes `fresh`, the record of a new key (fence 1) encoded once for all its keys; nil
-- makes acquire_key build its own. `lease` (ms) may be the decimal string the client sent: Lua's
-- arithmetic converts it where a lease is written, so a duplicate never pays tonumber's strtod.
local function acquire_key(key, token, lease, ret, fp, owner, now, fresh)
  local raw = redis.call('GET', key)
  if not raw then
    if not fresh then fresh = fresh_record(token, lease, owner, fp) end
    redis.call('SET', key, fresh, 'PX', ret)
    return 1
  end
  local c = completed_reply(raw, fp)
  if c then return c end
  local r = decode(raw)
  if fp ~= '' and r.fp ~= '' and r.fp ~= fp then return {5, r.gen} end
  local takeover, gen = 0, r.gen + 1
  if r.st == 2 then
    if r.perm then return {6, r.gen, r.pay} end
    return {3, r.gen, r.pay}
  end
  now = now or now_ms()
  if r.st == 1 then
    if r.tok == token then gen = r.gen
    elseif r.lease > now then return {2, r.gen, r.lease - now}
    else takeover = 1 end
  else
    if r.perm then return {4, r.gen, r.pay} end
    if r.retry > now then return {2, r.gen, r.retry - now} end
  end
  local ttl = redis.call('PTTL', key)
  r.st, r.perm, r.gen, r.tok, r.lease, r.owner, r.pay = 1, false, gen, token, now + lease, owner, ''
  redis.call('SET', key, encode(r), 'PX', math.max(ttl, ret))
  return {1, r.gen, takeover}
end

-- The completion of the usual record, `s` (the key's value, not nil): header 129 (v1, in_progress,
-- 1-byte generation, no fingerprint, payload or permanent bit), the owner reaching exactly the last
-- byte, read by one struct.unpack instead of three string calls. Answers 1 (written) or 0 (another
-- holder) as complete_key does for it, writing the same bytes; nil for any other value (or
-- `unavailable`), which complete_key then decides. It uses nothing else of this file, so
-- complete.lua calls it before the rest of the prelude is even created (embed_lua.cmake);
-- complete_key holds the same lines (keep the two alike).
local function complete_usual(key, s, fence, token, result, ret, unavailable)
  local n = #s
  if n < 20 or unavailable then return nil end
  local h, g1, tok, _, ol = struct.unpack('>BBc8dH', s)
  if h ~= 129 or g1 == 0 or ol + 20 ~= n then return nil end
  -- The fence as a number: the usual ones by string equality (interned strings: a pointer compare),
  -- any other through tonumber, whose strtod costs more than the rest of the check.
  local g
  if fence == '1' then g = 1 elseif fence == '2' then g = 2 else g = tonumber(fence) end
  if g1 ~= g or tok ~= token then return 0 end
  if result == '' then
    s = struct.pack('>BBc8', 130, g1, token)
  else
    s = struct.pack('>BBc8I4c0', 162, g1, token, #result, result)
  end
  redis.call('SET', key, s, 'PX', ret)
  return 1
end

-- Complete of one key by its holder. Reply: 1 written (or already written by this very request),
-- 0 lease lost (nothing written). `unavailable` true: complete without the result, `result` is why
-- (the permanent bit on a completed record); it always takes the decoding path below, being rare.
-- Fast path, for an in_progress record as encode writes it (generation in its narrowest width of
-- 1, 2 or 4 bytes, no payload section, a non-empty fingerprint if any), checked to its last byte
-- without decoding it: the completed record is the same header with state 2 (plus the payload bit
-- for a non-empty result), the same generation and token, no lease or owner, the same fingerprint
-- section, then the result; byte for byte what decode + encode give. Any other value goes through
-- decode, which refuses a damaged record (IDEMCORRUPT). `s`: the key's value when the caller has
-- read it already (complete.lua), else nil (read here).
local function complete_key(key, fence, token, result, ret, unavailable, s)
  if s == nil then s = redis.call('GET', key) end
  if not s then return 0 end
  local n, g = #s
  if fence == '1' then g = 1 elseif fence == '2' then g = 2 else g = tonumber(fence) end
  -- complete_usual's case, written out again: a call to it costs a coalesced step ~1,300
  -- instructions (callgrind). The fuzz harness holds this copy to decode + encode.
  if n >= 20 and not unavailable then
    local h, g1, tok, _, ol = struct.unpack('>BBc8dH', s)
    if h == 129 and g1 > 0 and ol + 20 == n then
      if g1 ~= g or tok ~= token then return 0 end
      if result == '' then
        s = struct.pack('>BBc8', 130, g1, token)
      else
        s = struct.pack('>BBc8I4c0', 162, g1, token, #result, result)
      end
      redis.call('SET', key, s, 'PX', ret)
      return 1
    end
  end
  local h, g1 = string.byte(s, 1, 2)
  -- The header bits, by arithmetic (cheaper here than bit.band calls): v1 (h >= 128), state 1
  -- (h % 4), no permanent bit (4 clear: encode never sets it on in_progress, and decode + encode
  -- would clear it where this path would carry it into "completed without its result"), no
  -- payload (32 clear), and not the 8-byte generation (8 and 64 both set).
  if not unavailable and n >= 20 and h >= 128 and h % 4 == 1 and h % 8 < 4 and h % 64 < 32 and (h % 16 < 8 or h < 192) then
    local gen, p
    if h % 16 < 8 and h < 192 then -- 1-byte generation
      gen, p = g1, 3
    elseif h < 192 then -- 2 bytes (8 set); at least 256, else encode would have written 1 byte
      local a, b = string.byte(s, 2, 3)
      gen, p = a * 256 + b, 4
      if gen < 256 then gen = nil end
    else -- 4 bytes (64 set), at least 65536
      local a, b, c, d = string.byte(s, 2, 5)
      gen, p = ((a * 256 + b) * 256 + c) * 256 + d, 6
      if gen < 65536 then gen = nil end
    end
    -- token at p, lease at p + 8, owner length at p + 16 and p + 17, owner from p + 18 to e - 1
    if gen and gen >= 1 and p + 17 <= n then
      local a, b = string.byte(s, p + 16, p + 17)
      local e, ok = p + 18 + a * 256 + b
      local fp = h % 32 >= 16
      if not fp then
        ok = e == n + 1
      elseif e < n then
        a, b = string.byte(s, e, e + 1)
        ok = a + b > 0 and e + 2 + a * 256 + b == n + 1
      end
      if ok then
        if gen ~= g or string.sub(s, p, p + 7) ~= token then return 0 end
        -- completed: state 1 -> 2, and the payload bit (clear so far) for a non-empty result
        -- (one concatenation: each intermediate string would be made and hashed for nothing)
        if result == '' then
          if p == 3 and not fp then -- the usual record: header, 1-byte generation, token (== `token`)
            s = string.char(h + 1, gen) .. token
          else
            s = string.char(h + 1) .. string.sub(s, 2, p + 7) .. string.sub(s, e)
          end
        elseif p == 3 and not fp then
          s = string.char(h + 33, gen) .. token .. struct.pack('>I4', #result) .. result
        else
          s = string.char(h + 33) .. string.sub(s, 2, p + 7) .. string.sub(s, e) .. struct.pack('>I4', #result) .. result
        end
        redis.call('SET', key, s, 'PX', ret)
        return 1
      end
    end
  end
  local r = decode(s)
  if r.gen ~= g or r.tok ~= token then return 0 end
  if r.st == 2 and r.perm == (unavailable == true) and r.pay == result then -- done
    touch(key)
    return 1
  end
  if r.st ~= 1 then return 0 end
  r.st, r.pay, r.perm = 2, result, unavailable == true
  redis.call('SET', key, encode(r), 'PX', ret)
  return 1
end

-- Fail of one key by its holder (fail.lua; a coalesced call's 'f' entry). Reply: 1 written (or
-- already written by this very request: see of_holder), 0 lease lost. A release keeps the record
-- (as failed, retry at once) so the fence keeps growing across retries.
local function fail_key(key, fence, token, err, release, permanent, backoff, ret)
  local r = of_holder(key, fence, token)
  if not r or r.st == 2 then return 0 end
  -- Already failed by this holder with this error and permanence: this request asked again.
  if r.st == 3 then
    if r.pay == err and r.perm == (release ~= '1' and permanent == '1') then
      touch(key)
      return 1
    end
    return 0
  end
  local now = now_ms()
  r.st, r.pay = 3, err
  r.perm = release ~= '1' and permanent == '1'
  if release == '1' then r.retry = now else r.retry = now + math.max(0, tonumber(backoff)) end
  redis.call('SET', key, encode(r), 'PX', tonumber(ret))
  return 1
end

-- Extend of one key by its live holder (extend.lua; a coalesced call's 'e' entry). Reply: 1
-- written, 0 lease lost. The retention never ends before the new lease does.
local function extend_key(key, fence, token, lease)
  local r = held(key, fence, token)
  if not r then return 0 end
  lease = tonumber(lease)
  r.lease = now_ms() + lease
  local ttl = redis.call('PTTL', key)
  redis.call('SET', key, encode(r), 'PX', math.max(ttl, lease))
  return 1
end
