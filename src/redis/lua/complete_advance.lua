-- complete_advance KEYS[1] = a RedisStore record, KEYS[2] = <prefix>seq:{<entity>};
-- ARGV: fence, token (8 bytes), result, retention ms, seq (canonical decimal uint64).
-- The guard's completion and the entity's compare-and-set in one atomic step: no crash can leave
-- the record completed with the sequence behind it (or the other way round).
-- Reply: {0, 0, ''} lease lost: nothing written, the sequence untouched (the run that took the
-- key over advances it); {1, code, previous} completed, with advance_seq's code and previous.
-- A damaged sequence key (code -1 or -2) does not stop the completion: the handler's effect
-- happened, and leaving the record in_progress would let a redelivery run it again. The caller
-- reports the damaged key as an error after the result is safe.
if not canonical_seq(ARGV[5]) then
  return redis.error_reply('IDEMUSAGE complete_advance: the sequence is not a canonical decimal uint64')
end
if complete_key(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4]) == 0 then return {0, 0, ''} end
local code, prev = advance_seq(KEYS[2], ARGV[5])
return {1, code, prev}
