-- fail KEYS[1]; ARGV: fence, token, error, release 0/1, permanent 0/1, backoff ms, retention ms.
-- Reply: 1 written (or already written by this very request: see of_holder in record.lua), 0 lease
-- lost. A release keeps the record (as failed, retry at once) so the fence keeps growing across retries.
local r = of_holder(KEYS[1], ARGV[1], ARGV[2])
if not r or r.st == COMPLETED then return 0 end
-- Already failed by this holder with this error and permanence: this request asked again.
if r.st == FAILED then
  if r.pay == ARGV[3] and r.perm == (ARGV[4] ~= '1' and ARGV[5] == '1') then
    touch(KEYS[1])
    return 1
  end
  return 0
end
local now, release = now_ms(), ARGV[4] == '1'
r.st, r.pay = FAILED, ARGV[3]
r.perm = (not release) and ARGV[5] == '1'
if release then r.retry = now else r.retry = now + math.max(0, tonumber(ARGV[6])) end
redis.call('SET', KEYS[1], encode(r), 'PX', tonumber(ARGV[7]))
return 1
