-- many KEYS[1..n]: several callers' one-key steps in one call (auto-batching, docs/async.md).
-- ARGV[1]: the steps, one byte per key, in order. ARGV[2], ARGV[3], ARGV[4]: a lease (ms), a
-- retention (ms) and an owner that the short steps share. Then, for each key in turn, its step's
-- arguments:
--   a  token                                    acquire: ARGV[2..4]'s lease, retention and owner, no fingerprint
--   b  token fingerprint                        acquire: ARGV[2..4]'s lease, retention and owner
--   A  token lease retention fingerprint owner  acquire (acquire.lua's arguments)
--   c  fence token result                       complete, retention ARGV[3]
--   C  fence token result retention             complete (complete.lua's arguments)
--   U  fence token why retention                complete without the result (complete.lua's, unavailable)
--   f  fence token error release permanent backoff retention   fail (fail.lua's)
--   e  fence token lease                        extend (extend.lua's)
-- The short forms exist because each argument costs the server about 700 instructions to read and
-- hand to Lua, as much as a step's own logic: a coalesced new key's acquire went from 33.0k to
-- 29.5k instructions with them (callgrind, scripts/bench-lua).
-- Reply: one reply per key, in order, each what the single-key script would have answered had
-- the calls run one after another in this order; a key may appear more than once (acquired, then
-- in_flight, as in a batch). One key's error (a damaged record: IDEMCORRUPT; a write refused:
-- OOM) becomes that key's reply, as it would be its single call's, and the keys after it go on:
-- Redis does not undo a script's earlier writes when it fails, so one key's error must not hide
-- the replies of the keys already done. The steps run under one pcall, entered again after the
-- key that failed (a pcall per step cost each step about 1,000 instructions).
-- KEYS and ARGV as locals (upvalues of run): each step reads several, and a global is a table lookup.
local KEYS, ARGV = KEYS, ARGV
local ops, lease, ret, owner = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local n, out, i, a, nexta = #KEYS, {}, 0, 5, 5
-- The layout is checked whole before any step runs, so a malformed call writes nothing.
if #ops ~= n then return redis.error_reply('IDEMUSAGE many.lua: ' .. #ops .. ' steps for ' .. n .. ' keys') end
-- The letters as numbers, read in one call (a string.byte per step cost each ~500 instructions).
local opv = {string.byte(ops, 1, n)}
local width, want = {[97] = 1, [98] = 2, [65] = 5, [99] = 3, [67] = 4, [85] = 4, [102] = 7, [101] = 3}, 4
for j = 1, n do
  local w = width[opv[j]]
  if not w then return redis.error_reply('IDEMUSAGE many.lua: unknown step ' .. string.sub(ops, j, j) .. ' for key ' .. j) end
  want = want + w
end
if #ARGV ~= want then return redis.error_reply('IDEMUSAGE many.lua: ' .. #ARGV .. ' arguments, the steps take ' .. want) end
local function run()
  while i < n do
    local k, op, res = KEYS[i + 1], opv[i + 1]
    if op == 97 then -- a
      nexta = a + 1
      res = acquire_key(k, ARGV[a], lease, ret, '', owner)
    elseif op == 99 then -- c
      nexta = a + 3
      res = complete_key(k, ARGV[a], ARGV[a + 1], ARGV[a + 2], ret, false)
    elseif op == 98 then -- b
      nexta = a + 2
      res = acquire_key(k, ARGV[a], lease, ret, ARGV[a + 1], owner)
    elseif op == 65 then -- A
      nexta = a + 5
      res = acquire_key(k, ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4])
    elseif op == 67 then -- C
      nexta = a + 4
      res = complete_key(k, ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], false)
    elseif op == 85 then -- U
      nexta = a + 4
      res = complete_key(k, ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], true)
    elseif op == 102 then -- f
      nexta = a + 7
      res = fail_key(k, ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6])
    else -- e
      nexta = a + 3
      res = extend_key(k, ARGV[a], ARGV[a + 1], ARGV[a + 2])
    end
    i, a = i + 1, nexta
    out[i] = res
  end
end
while i < n do
  local ok, res = pcall(run)
  if ok then break end
  i, a = i + 1, nexta
  if type(res) == 'table' and res.err then
    out[i] = res
  elseif type(res) == 'string' and string.find(res, '^%u+ ') then -- 'IDEMCORRUPT ...', 'OOM ...'
    out[i] = {err = res}
  else
    out[i] = {err = 'ERR ' .. tostring(res)}
  end
end
return out
