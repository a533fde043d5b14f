-- inspect KEYS[1]. Reply: nil when absent or expired, else
-- {state, fence, token, owner, lease_until ms, retry_at ms, permanent 0/1, fingerprint, payload}.
local raw = redis.call('GET', KEYS[1])
if not raw then return false end
local r = decode(raw)
return {r.st, r.gen, r.tok, r.owner, r.lease or 0, r.retry or 0, r.perm and 1 or 0, r.fp, r.pay}
