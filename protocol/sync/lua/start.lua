-- Admit a request: record its state and tell every participant to start it.
-- KEYS: req, active, epoch, participants, log, events, plan
-- ARGV: rid, prompt (json), params (json), max_new, stop ids (json), ctl prefix,
--       now_ms, req key prefix, ttl_s
local act = redis.call('GET', KEYS[2])
if act and redis.call('HGET', ARGV[8] .. act, 'status') == 'running' then
  return {'BUSY', act}
end
local parts = redis.call('GET', KEYS[4])
if not parts then return {'NOPIPE', ''} end
local epoch = tonumber(redis.call('GET', KEYS[3]) or '0')
redis.call('DEL', KEYS[1], KEYS[5], KEYS[6])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'prompt', ARGV[2], 'params', ARGV[3],
           'max_new', ARGV[4], 'stop', ARGV[5], 'status', 'running', 'epoch', epoch,
           'parts', parts, 'created_ms', ARGV[7],
           'plan', redis.call('GET', KEYS[7]) or '', 'pending', 0)
redis.call('XADD', KEYS[6], '*', 'start', epoch, 't', ARGV[7])
for _, k in ipairs({KEYS[1], KEYS[5], KEYS[6]}) do redis.call('EXPIRE', k, ARGV[9]) end
redis.call('SET', KEYS[2], ARGV[1])
local msg = cjson.encode({op = 'start', req = ARGV[1], epoch = epoch})
for _, w in ipairs(cjson.decode(parts)) do redis.call('RPUSH', ARGV[6] .. w, msg) end
return {'OK', tostring(epoch)}
