-- acquire KEYS[1]; ARGV: token (8 bytes), lease ms, retention ms, fingerprint, owner.
-- Reply: see acquire_key in record.lua.
-- The clock is read only when the answer depends on it (acquire_key reads it then).
return acquire_key(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
