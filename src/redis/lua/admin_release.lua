-- admin_release KEYS[1]; ARGV: fence, force 0/1, reason. The operator's `idem release`: frees a
-- stuck key only while it still has the fence the operator saw, so a holder that took the key over
-- since is never freed. Reply {status, fence, state}: 0 released, 1 absent, 2 another fence,
-- 3 completed (never released: its effect happened), 4 a live lease (refused unless force).
-- Released = what a release-policy failure leaves (failed, retry at once, the fence kept so it keeps
-- growing) with a zero token, which no holder has (tokens are never 0): the old holder's complete,
-- fail and extend all answer lease_lost from then on.
local raw = redis.call('GET', KEYS[1])
if not raw then return {1, 0, 0} end
local r = decode(raw)
if r.gen ~= tonumber(ARGV[1]) then return {2, r.gen, r.st} end
if r.st == COMPLETED then return {3, r.gen, r.st} end
local now = now_ms()
if r.st == IN_PROGRESS and r.lease > now and ARGV[2] ~= '1' then return {4, r.gen, r.st} end
local was = r.st
local ttl = redis.call('PTTL', KEYS[1])
r.st, r.perm, r.retry, r.tok, r.pay = FAILED, false, now, string.char(0, 0, 0, 0, 0, 0, 0, 0), ARGV[3]
if ttl > 0 then
  redis.call('SET', KEYS[1], encode(r), 'PX', ttl)
else
  redis.call('SET', KEYS[1], encode(r))
end
return {0, r.gen, was}
