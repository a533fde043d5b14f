-- acquire_each KEYS[1..n]; ARGV: lease ms, retention ms, owner, then token (8 bytes) and
-- fingerprint for each key. Reply: one acquire reply per key, in order. A guard's batch: each
-- message has its own token (a holder is one acquisition) and its own fingerprint; the lease,
-- retention and owner are the guard's. Each key is decided by acquire_key, at one server time.
local lease, ret, owner = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local now, out = now_ms(), {}
for i = 1, #KEYS do
  out[i] = acquire_key(KEYS[i], ARGV[2 + 2 * i], lease, ret, ARGV[3 + 2 * i], owner, now)
end
return out
