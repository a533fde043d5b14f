-- sequence_advance KEYS[1] = <prefix>seq:{<entity>}; ARGV[1] = seq, canonical decimal uint64.
-- Compare-and-set of the entity's last applied sequence (advance_seq in sequence.lua).
-- Reply: {1, previous} advanced, {0, previous} not advanced; previous is '' when none was applied.
if not canonical_seq(ARGV[1]) then
  return redis.error_reply('IDEMUSAGE sequence_advance: the sequence is not a canonical decimal uint64')
end
local code, prev = advance_seq(KEYS[1], ARGV[1])
if code == -1 then
  return redis.error_reply('IDEMCORRUPT the sequence key does not hold a canonical decimal uint64')
elseif code == -2 then
  return redis.error_reply(prev)
end
return {code, prev}
