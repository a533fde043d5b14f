-- fail KEYS[1]; ARGV: fence, token, error, release 0/1, permanent 0/1, backoff ms, retention ms.
-- Reply: see fail_key in record.lua.
return fail_key(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
