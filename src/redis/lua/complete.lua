-- complete KEYS[1]; ARGV: fence, token, result, retention ms[, unavailable]. Reply: 1 written,
-- 0 lease lost. ARGV[5] = '1': complete without the result, ARGV[3] says why (complete_unavailable).
return complete_key(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1')
