-- complete KEYS[1]; ARGV: fence, token, result, retention ms. Reply: 1 written, 0 lease lost.
return complete_key(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
