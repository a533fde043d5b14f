-- admin_inspect KEYS[1]; ARGV[1] '1' = include the payload. For the operator's tools (idem inspect,
-- list, stats), never the stores. Reply: nil when absent or expired, else {state, fence, owner,
-- lease_until ms, retry_at ms, permanent 0/1, fingerprint, payload length, pttl ms, value bytes,
-- now ms, payload or ''}. Read in one script so the clock and the record are one instant.
local raw = redis.call('GET', KEYS[1])
if not raw then return false end
local r = decode(raw)
local pay = ''
if ARGV[1] == '1' then pay = r.pay end
return {r.st, r.gen, r.owner, r.lease or 0, r.retry or 0, r.perm and 1 or 0, r.fp, #r.pay,
        redis.call('PTTL', KEYS[1]), #raw, now_ms(), pay}
