-- record.lua: the packed record codec, the clock and the per-key transitions shared by every idem
-- script. The build prepends it to each script, so each generated script runs alone (EVALSHA, or
-- redis-cli --eval), and the single-key and batch scripts decide through the same code.
--
-- One record per key, one Redis string, big-endian (struct library):
--   B  header: 0x80 (format v1) | state (1 in_progress, 2 completed, 3 failed) | 0x04 permanent
--             | 0x10 has fingerprint | 0x20 has payload | generation width (0x08 and 0x40, below)
--   generation: the fence, which is also the number of acquisitions; B, H, I4 or d by width
--   c8 token of the latest acquisition (the fence alone is not enough: see DESIGN.md)
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

local IN_PROGRESS, COMPLETED, FAILED = 1, 2, 3

-- struct format of the generation for a width code (header bits 0x08 and 0x40).
local function gen_format(gw)
  if gw == 0 then return 'B' elseif gw == 8 then return 'H' elseif gw == 64 then return 'I4' end
  return 'd'
end

local function corrupt(why)
  error({err = 'IDEMCORRUPT idem record ' .. why .. ', so it was not written by this idem version'})
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function decode(s)
  local n = #s
  if n < 10 then corrupt('is ' .. n .. ' bytes long') end
  local h = string.byte(s, 1)
  local st = h % 4
  if h < 128 or st == 0 then corrupt('has an unknown header byte ' .. h) end
  local has_fp, has_pay = bit.band(h, 16) ~= 0, bit.band(h, 32) ~= 0
  local f = '>B' .. gen_format(bit.band(h, 72)) .. 'c8' ..
            ((st == IN_PROGRESS and 'dHc0') or (st == FAILED and 'd') or '') ..
            (has_fp and 'Hc0' or '') .. (has_pay and 'I4c0' or '')
  local ok, _, gen, tok, a, b, c, d, e = pcall(struct.unpack, f, s)
  if not ok then corrupt('of ' .. n .. ' bytes does not parse') end
  local r = {st = st, perm = bit.band(h, 4) ~= 0, gen = gen, tok = tok, fp = '', pay = '', owner = ''}
  -- a, b, c, d, e: the values after the token in layout order, then the end position.
  if st == IN_PROGRESS then
    r.lease, r.owner, a, b, c = a, b, c, d, e
  elseif st == FAILED then
    r.retry, a, b, c = a, b, c, d
  end
  if has_fp then r.fp, a, b = a, b, c end
  if has_pay then r.pay, a = a, b end
  if a ~= n + 1 then corrupt('of ' .. n .. ' bytes does not parse') end
  if gen < 1 or gen ~= math.floor(gen) then corrupt('has generation ' .. tostring(gen)) end
  return r
end

local function encode(r)
  local g, st, fp, pay = r.gen, r.st, r.fp, r.pay
  local gw = (g < 256 and 0) or (g < 65536 and 8) or (g < 4294967296 and 64) or 72
  local h = 128 + st + gw
  if r.perm then h = h + 4 end
  if fp ~= '' then h = h + 16 end
  if pay ~= '' then h = h + 32 end
  local gf, s = gen_format(gw)
  if st == IN_PROGRESS then
    s = struct.pack('>B' .. gf .. 'c8dHc0', h, g, r.tok, r.lease, #r.owner, r.owner)
  elseif st == FAILED then
    s = struct.pack('>B' .. gf .. 'c8d', h, g, r.tok, r.retry)
  else
    s = struct.pack('>B' .. gf .. 'c8', h, g, r.tok)
  end
  if fp ~= '' then s = s .. struct.pack('>Hc0', #fp, fp) end
  if pay ~= '' then s = s .. struct.pack('>I4c0', #pay, pay) end
  return s
end

-- The record of a live holder (state in_progress, fence and token equal), or nil.
local function held(key, fence, token)
  local raw = redis.call('GET', key)
  if not raw then return nil end
  local r = decode(raw)
  if r.st ~= IN_PROGRESS or r.gen ~= tonumber(fence) or r.tok ~= token then return nil end
  return r
end

-- Retention `ret` stays the decimal string the client sent: SET takes it as is, math.max reads it
-- as a number, and no number is formatted back to text on the hot path.

-- Acquire of one key (DESIGN.md section 1). Reply: {1 acquired, fence, takeover 0/1}
-- | {2 in_flight, attempts, retry_after ms} | {3 duplicate, attempts, result}
-- | {4 previously_failed, attempts, error} | {5 mismatch, attempts}
local function acquire_key(key, token, lease, ret, fp, owner, now)
  local raw = redis.call('GET', key)
  if not raw then
    redis.call('SET', key, encode({st = IN_PROGRESS, gen = 1, tok = token, lease = now + lease, owner = owner,
                                   fp = fp, pay = ''}), 'PX', ret)
    return {1, 1, 0}
  end
  local r = decode(raw)
  if fp ~= '' and r.fp ~= '' and r.fp ~= fp then return {5, r.gen} end
  local takeover = 0
  if r.st == COMPLETED then return {3, r.gen, r.pay} end
  if r.st == IN_PROGRESS then
    if r.lease > now then return {2, r.gen, r.lease - now} end
    takeover = 1
  else
    if r.perm then return {4, r.gen, r.pay} end
    if r.retry > now then return {2, r.gen, r.retry - now} end
  end
  local ttl = redis.call('PTTL', key)
  r.st, r.perm, r.gen, r.tok, r.lease, r.owner, r.pay = IN_PROGRESS, false, r.gen + 1, token, now + lease, owner, ''
  redis.call('SET', key, encode(r), 'PX', math.max(ttl, ret))
  return {1, r.gen, takeover}
end

-- Complete of one key by its holder. Reply: 1 written, 0 lease lost (nothing written).
local function complete_key(key, fence, token, result, ret)
  local r = held(key, fence, token)
  if not r then return 0 end
  r.st, r.pay = COMPLETED, result
  redis.call('SET', key, encode(r), 'PX', ret)
  return 1
end
