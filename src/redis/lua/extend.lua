-- extend KEYS[1]; ARGV: fence, token, lease ms. Reply: see extend_key in record.lua.
return extend_key(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
