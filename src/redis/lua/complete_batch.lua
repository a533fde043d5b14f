-- complete_batch KEYS[1..n]; ARGV: retention ms, then fence, token, result for each key.
-- Reply: 1 (written) or 0 (lease lost) per key, in order.
local ret, out = ARGV[1], {}
for i = 1, #KEYS do
  local a = 3 * i - 1
  out[i] = complete_key(KEYS[i], ARGV[a], ARGV[a + 1], ARGV[a + 2], ret)
end
return out
