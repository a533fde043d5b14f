-- extend KEYS[1]; ARGV: fence, token, lease ms. Reply: 1 written, 0 lease lost.
-- The retention never ends before the new lease does.
local r = held(KEYS[1], ARGV[1], ARGV[2])
if not r then return 0 end
local lease = tonumber(ARGV[3])
r.lease = now_ms() + lease
local ttl = redis.call('PTTL', KEYS[1])
redis.call('SET', KEYS[1], encode(r), 'PX', math.max(ttl, lease))
return 1
