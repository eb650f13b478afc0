-- The step barrier of the batch (Synchroniser.arrive: KEYS/ARGV, replies).
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur ~= tonumber(ARGV[1]) then return {'STALE', tostring(cur)} end  -- epoch fence
if redis.call('HSETNX', KEYS[4], 'w:' .. ARGV[3], 1) == 0 then return {'DUP', '0'} end
local reports = json_table(ARGV[8]) or {}
local planned = json_table(ARGV[9])
if planned and #planned > 0 then redis.call('HSET', KEYS[4], 'j', ARGV[9]) end
local lps = json_table(ARGV[10]) or {}
for rid, rep in pairs(reports) do
  if type(rid) == 'string' and type(rep) == 'table'
      and redis.call('SISMEMBER', KEYS[2], rid) == 1 then
    local rk = ARGV[7] .. rid
    local tok = tonumber(rep[1]) or -1
    local status = redis.call('HMGET', rk, 'status', 'ending')
    -- a request cancelled in this step still commits the token it verified (cancel.lua)
    if tok >= 0 and (status[1] == 'running' or status[2]) then
      local n = redis.call('RPUSH', rk .. ':log', tok)
      -- all its keys expire ttl_s after its last commit (the log too: this push may create it)
      for _, k in ipairs({rk, rk .. ':log', rk .. ':ev'}) do redis.call('EXPIRE', k, ARGV[5]) end
      redis.call('HSET', KEYS[4], 't:' .. rid, tok)
      local lp = lps[rid]
      if type(lp) == 'string' and #lp <= 1024 then
        redis.call('XADD', rk .. ':ev', '*', 'tok', tok, 'i', n - 1, 't', ARGV[6], 'lp', lp)
      else  -- none asked (or a malformed one: the gateway names it missing)
        redis.call('XADD', rk .. ':ev', '*', 'tok', tok, 'i', n - 1, 't', ARGV[6])
      end
      local reason = rep[3]  -- the last stage's stop rule (protocol/requests/stopping.py)
      if reason == 'eos' or reason == 'length' then
        redis.call('HDEL', rk, 'ending')  -- it ended by itself: no cancel end follows
        redis.call('HSET', rk, 'status', 'done', 'reason', reason)
        redis.call('XADD', rk .. ':ev', '*', 'end', 'done', 'reason', reason, 't', ARGV[6])
      end
    end
    local root = tonumber(rep[2]) or -1
    if root >= 0 then
      redis.call('HSET', KEYS[4], 'r:' .. rid, root)
      -- one child per token (stages/speculation/step.py root_children): a lookup below
      for i = 4, #rep - 1, 2 do
        redis.call('HSET', KEYS[4], 'c:' .. rid .. ':' .. tostring(rep[i]), rep[i + 1])
      end
    end
  end
end
local parts = cjson.decode(redis.call('GET', KEYS[5]) or '[]')
local arrived = redis.call('HINCRBY', KEYS[4], 'n', 1)
if arrived < #parts then
  redis.call('EXPIRE', KEYS[4], ARGV[5])
  return {'WAIT', tostring(arrived)}
end
local step = tonumber(ARGV[2])  -- everyone is here: one verdict per request of the batch
local members = redis.call('SMEMBERS', KEYS[2])
table.sort(members)
local verdicts = {}
for _, rid in ipairs(members) do
  local rk = ARGV[7] .. rid
  local st = redis.call('HMGET', rk, 'status', 'joined')
  local token, child = -1, -1
  local first = tonumber(st[2] or '-1')
  local bar = redis.call('HMGET', KEYS[4], 't:' .. rid, 'r:' .. rid)
  if step == first then
    token = tonumber(redis.call('LINDEX', rk .. ':log', -1) or '-1')  -- root of the first tree
  elseif step > first and bar[1] then  -- (step < first: a prefill chunk, nothing verified)
    token = tonumber(bar[1])
    child = tonumber(redis.call('HGET', KEYS[4], 'c:' .. rid .. ':' .. bar[1]) or '-1')
  end
  local done = st[1] ~= 'running'
  if st[1] then  -- its schedule (Synchroniser.schedule)
    local mark = (step < first and ':') or (step == first and '|')
        or (token < 0 and '.') or (child >= 0 and 'h') or 'm'
    redis.call('APPEND', rk .. ':sched', mark)
    redis.call('EXPIRE', rk .. ':sched', ARGV[5])
    redis.call('HSET', rk, 'step', step - first)
  end
  verdicts[#verdicts + 1] = {rid, token, child, tonumber(bar[2] or '-1'), done}
  if done then redis.call('SREM', KEYS[2], rid) end
  end_if_ending(rk, ARGV[6])  -- cancelled in this step: after the token it committed
end
-- the line drops its ended head entries (cancelled while they waited); the draft's
-- joiners join in its order, up to one no longer first in line (it decides again)
local function head_of_line()
  local rid = redis.call('LINDEX', KEYS[3], 0)
  while rid and redis.call('HGET', ARGV[7] .. rid, 'status') ~= 'running' do
    redis.call('LPOP', KEYS[3])
    rid = redis.call('LINDEX', KEYS[3], 0)
  end
  return rid
end
local joins = {}
for _, j in ipairs(json_table(redis.call('HGET', KEYS[4], 'j')) or {}) do
  local rid, head, steps = j[1], tonumber(j[2]), tonumber(j[3])
  if type(rid) ~= 'string' or not head or not steps or head < 0 or steps < 1
      or head_of_line() ~= rid then
    break
  end
  redis.call('LPOP', KEYS[3])
  redis.call('SADD', KEYS[2], rid)  -- its prefill starts in the next step
  redis.call('HSET', ARGV[7] .. rid, 'head', head, 'epoch', ARGV[1], 'joined', step + steps)
  joins[#joins + 1] = rid
end
local more = head_of_line() ~= false
local msg = cjson.encode({op = 'step', epoch = tonumber(ARGV[1]), step = step,
                          v = verdicts, join = joins, more = more})
for _, w in ipairs(parts) do redis.call('RPUSH', ARGV[4] .. w, msg) end
redis.call('DEL', KEYS[4])
return {'GO', tostring(arrived)}
