-- Stop a running request (client cancel, deadline, stop string).  One waiting to join
-- ends now; one in the batch ends at the next barrier (arrive.lua), which still commits
-- the token its step verifies (the in-process engine's cancel keeps the step it lands
-- in too), so its end event follows that token ('ending' marks it due; join.lua sends
-- it if the batch's barrier never completes).
-- KEYS: req, events, batch  ARGV: reason, now_ms, request id
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then return status or 'gone' end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'reason', ARGV[1])
if redis.call('SISMEMBER', KEYS[3], ARGV[3]) == 1 then
  redis.call('HSET', KEYS[1], 'ending', 1)
else
  redis.call('XADD', KEYS[2], '*', 'end', 'cancelled', 'reason', ARGV[1], 't', ARGV[2])
end
return 'cancelled'
