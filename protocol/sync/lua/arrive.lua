-- The step barrier.  A participant reports that it finished step `step`; the
-- last stage also commits the token it verified, the draft service also names
-- the root's children (token -> node id) and the id a new root gets on a miss.
-- When everyone has arrived, the verdict goes to every participant's control list,
-- and the step's outcome is appended to the request's schedule string: '|' starts
-- an epoch (step 0), then per step 'h' (hit), 'm' (miss) or '.' (nothing verified).
-- KEYS: req, log, barrier, events, active, schedule
-- ARGV: epoch, step, worker, token (-1: none), root id (-1: not the draft),
--       ctl prefix, ttl_s, now_ms, then child token / child id pairs
local st = redis.call('HMGET', KEYS[1], 'epoch', 'status', 'max_new', 'stop', 'parts', 'id')
if not st[1] then return {'GONE', '-1'} end
if tonumber(st[1]) ~= tonumber(ARGV[1]) then return {'STALE', st[1]} end  -- epoch fence
if redis.call('HSETNX', KEYS[3], 'w:' .. ARGV[3], 1) == 0 then return {'DUP', '0'} end
local status = st[2]
local tok = tonumber(ARGV[4])
if tok >= 0 and status == 'running' then
  local n = redis.call('RPUSH', KEYS[2], ARGV[4])
  redis.call('HSET', KEYS[3], 'token', ARGV[4])
  redis.call('XADD', KEYS[4], '*', 'tok', ARGV[4], 'i', n - 1, 't', ARGV[8])
  local reason = false
  for _, s in ipairs(cjson.decode(st[4])) do
    if s == tok then reason = 'eos' end
  end
  if not reason and n >= tonumber(st[3]) then reason = 'length' end
  if reason then
    status = 'done'
    redis.call('HSET', KEYS[1], 'status', 'done', 'reason', reason)
    redis.call('XADD', KEYS[4], '*', 'end', 'done', 'reason', reason, 't', ARGV[8])
  end
end
if tonumber(ARGV[5]) >= 0 then
  redis.call('HSET', KEYS[3], 'root', ARGV[5])
  -- the first child with a token wins, as in stages/speculation/step.py decide()
  for i = 9, #ARGV, 2 do redis.call('HSETNX', KEYS[3], 'c:' .. ARGV[i], ARGV[i + 1]) end
end
local parts = cjson.decode(st[5])
local arrived = redis.call('HINCRBY', KEYS[3], 'n', 1)
if arrived < #parts then
  redis.call('EXPIRE', KEYS[3], ARGV[7])
  return {'WAIT', tostring(arrived)}
end
-- everyone is here: the step's verdict
local bar = redis.call('HMGET', KEYS[3], 'token', 'root')
local token, child = -1, -1
local step = tonumber(ARGV[2])
if step == 0 then
  token = tonumber(redis.call('LINDEX', KEYS[2], -1) or '-1')  -- root of the first tree
elseif bar[1] then
  token = tonumber(bar[1])
  child = tonumber(redis.call('HGET', KEYS[3], 'c:' .. bar[1]) or '-1')
end
local done = status ~= 'running'
local mark = '|'
if step > 0 then
  mark = (token < 0 and '.') or (child >= 0 and 'h') or 'm'
end
redis.call('APPEND', KEYS[6], mark)
redis.call('EXPIRE', KEYS[6], ARGV[7])
local msg = cjson.encode({op = 'step', req = st[6], epoch = tonumber(ARGV[1]), step = step,
                          token = token, child = child, root = tonumber(bar[2] or '-1'),
                          done = done})
for _, w in ipairs(parts) do redis.call('RPUSH', ARGV[6] .. w, msg) end
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[1], 'step', step)
if done and redis.call('GET', KEYS[5]) == st[6] then redis.call('DEL', KEYS[5]) end
return {'GO', tostring(arrived)}
