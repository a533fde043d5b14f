-- sequence_advance KEYS[1] = <prefix>seq:{<entity>}; ARGV[1] = seq, canonical decimal uint64.
-- Compare-and-set of the entity's last applied sequence: set it to ARGV[1] iff the key is absent
-- or holds a strictly lower number. Reply: {1, previous} advanced, {0, previous} not advanced;
-- previous is '' when nothing was applied yet. No TTL: a sequence is never forgotten.
-- Lua numbers are doubles (exact to 2^53 only), so the values are compared as canonical decimal
-- strings: the shorter one is lower; of equal length, byte order is numeric order.
local function canonical(s)
  return type(s) == 'string' and #s >= 1 and #s <= 20 and string.find(s, '^[0-9]+$') ~= nil
      and (#s == 1 or string.sub(s, 1, 1) ~= '0')
      and (#s < 20 or s <= '18446744073709551615')
end
local function lower(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local seq = ARGV[1]
if not canonical(seq) then
  return redis.error_reply('IDEMUSAGE sequence_advance: the sequence is not a canonical decimal uint64')
end
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], seq)
  return {1, ''}
end
if not canonical(cur) then
  return redis.error_reply('IDEMCORRUPT the sequence key does not hold a canonical decimal uint64')
end
if lower(cur, seq) then
  redis.call('SET', KEYS[1], seq)
  return {1, cur}
end
return {0, cur}
