-- New epoch (a worker restarted, or the stages were re-planned): drop queued
-- control messages and restart the running request from its token log.
-- KEYS: epoch, active, participants  ARGV: ctl prefix, req key prefix
local epoch = redis.call('INCR', KEYS[1])
local parts = redis.call('GET', KEYS[3]) or '[]'
for _, w in ipairs(cjson.decode(parts)) do redis.call('DEL', ARGV[1] .. w) end
local act = redis.call('GET', KEYS[2])
if not act then return {epoch, ''} end
local rk = ARGV[2] .. act
if redis.call('HGET', rk, 'status') ~= 'running' then
  redis.call('DEL', KEYS[2])
  return {epoch, ''}
end
redis.call('HSET', rk, 'epoch', epoch, 'parts', parts, 'pending', 0)
local msg = cjson.encode({op = 'start', req = act, epoch = epoch, resume = true})
for _, w in ipairs(cjson.decode(parts)) do redis.call('RPUSH', ARGV[1] .. w, msg) end
return {epoch, act}
