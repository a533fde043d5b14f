
-- sequence.lua: the per-entity sequence compare-and-set, prepended (after record.lua) to the
-- sequence scripts. The value is one plain string per entity holding the decimal last applied
-- sequence, with no TTL: a forgotten sequence would let an old event apply again.
-- Lua numbers are doubles (exact to 2^53 only), so values are compared as canonical decimal
-- strings: the shorter one is lower; of equal length, byte order is numeric order.

local function canonical_seq(s)
  return type(s) == 'string' and #s >= 1 and #s <= 20 and string.find(s, '^[0-9]+$') ~= nil
      and (#s == 1 or string.sub(s, 1, 1) ~= '0')
      and (#s < 20 or s <= '18446744073709551615')
end

local function seq_lower(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end

-- Sets `key` to `seq` iff it is absent or holds a strictly lower number. Returns code, previous:
-- 1 advanced, 0 not advanced (previous = the value found, '' when none); -1 the key holds a value
-- that is not a canonical decimal (previous = a prefix of it), -2 the key is not a string
-- (previous = the error text). A damaged key is reported, never overwritten. GET goes through
-- redis.pcall so that the caller decides what a damaged key means: complete_advance has written.
local function advance_seq(key, seq)
  local cur = redis.pcall('GET', key)
  if type(cur) == 'table' then return -2, tostring(cur.err) end
  if not cur then
    redis.call('SET', key, seq)
    return 1, ''
  end
  if not canonical_seq(cur) then return -1, string.sub(cur, 1, 32) end
  if seq_lower(cur, seq) then
    redis.call('SET', key, seq)
    return 1, cur
  end
  return 0, cur
end
