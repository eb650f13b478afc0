-- Stop a running request (client cancel, deadline, stop string); the next
-- barrier tells the participants.  KEYS: req, events  ARGV: reason, now_ms
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then return status or 'gone' end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'reason', ARGV[1])
redis.call('XADD', KEYS[2], '*', 'end', 'cancelled', 'reason', ARGV[1], 't', ARGV[2])
return 'cancelled'
