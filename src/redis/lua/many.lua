-- many KEYS[1..n]; ARGV: for each key in turn, its step's letter and argument count (a5 acquire,
-- c4 / c5 complete, f7 fail, e3 extend), then exactly the arguments the single-key script of that
-- step takes (acquire.lua, complete.lua, fail.lua, extend.lua). Reply: one reply per key, in
-- order, each what the single-key script would have answered had the calls run one after another
-- in this order. The client coalesces different callers' steps into this one call (auto-batching,
-- docs/async.md); a key may appear more than once (acquired, then in_flight, as in a batch).
-- Each step runs under pcall: an error (a damaged record: IDEMCORRUPT; a write refused: OOM)
-- becomes that key's reply, as it would be its single call's, and the other keys go on. Redis
-- does not undo a script's earlier writes when it fails, so one key's error must not hide the
-- replies of the keys already done.
local out, a = {}, 1
for i = 1, #KEYS do
  local op, k, ok, res = ARGV[a], KEYS[i]
  if op == 'a5' then
    ok, res = pcall(acquire_key, k, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5])
    a = a + 6
  elseif op == 'c4' or op == 'c5' then
    ok, res = pcall(complete_key, k, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], op == 'c5' and ARGV[a + 5] == '1')
    if op == 'c5' then a = a + 6 else a = a + 5 end
  elseif op == 'f7' then
    ok, res = pcall(fail_key, k, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 7])
    a = a + 8
  elseif op == 'e3' then
    ok, res = pcall(extend_key, k, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3])
    a = a + 4
  else
    return redis.error_reply('IDEMUSAGE many.lua: unknown step ' .. tostring(op) .. ' for key ' .. i)
  end
  if ok then
    out[i] = res
  elseif type(res) == 'table' and res.err then
    out[i] = res
  elseif type(res) == 'string' and string.find(res, '^%u+ ') then -- 'IDEMCORRUPT ...', 'OOM ...'
    out[i] = {err = res}
  else
    out[i] = {err = 'ERR ' .. tostring(res)}
  end
end
return out
