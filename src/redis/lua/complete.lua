-- complete KEYS[1]; ARGV: fence, token, result, retention ms[, unavailable]. Reply: 1 written,
-- 0 lease lost. ARGV[5] = '1': complete without the result, ARGV[3] says why (complete_unavailable).
-- The usual record is completed before the rest of the prelude (decode, encode, complete_key: a
-- closure each, created on every call) is reached: the marker line below is where embed_lua.cmake
-- puts it.
local s = redis.call('GET', KEYS[1])
if not s then return 0 end
local w = complete_usual(KEYS[1], s, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1')
if w then return w end
-- idem:prelude
return complete_key(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1', s)
