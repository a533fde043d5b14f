-- acquire_batch KEYS[1..n]; ARGV as acquire (token, lease ms, retention ms, fingerprint, owner),
-- shared by every key. Reply: one acquire reply per key, in order. Each key is decided alone, as
-- by acquire.lua, at one server time; one script run saves the per-call cost of n EVALSHAs.
local token, lease, ret, fp, owner = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local now, out = now_ms(), {}
-- Every new key gets the same record (fence 1, this token, lease and owner), encoded once.
local fresh = fresh_record(token, lease, owner, fp)
for i = 1, #KEYS do out[i] = acquire_key(KEYS[i], token, lease, ret, fp, owner, now, fresh) end
return out
