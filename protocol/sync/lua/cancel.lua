-- Stop a running request (Synchroniser.cancel: KEYS/ARGV, replies).
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then return status or 'gone' end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'reason', ARGV[1])
if redis.call('SISMEMBER', KEYS[3], ARGV[3]) == 1 then
  redis.call('HSET', KEYS[1], 'ending', 1)  -- ends after its step's token (arrive.lua)
else
  redis.call('XADD', KEYS[2], '*', 'end', 'cancelled', 'reason', ARGV[1], 't', ARGV[2])
end
return 'cancelled'
