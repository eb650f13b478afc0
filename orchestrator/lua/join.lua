-- A worker joins the pipeline: at its start, and with every heartbeat.  Workers bring
-- the plan (stage layout) they were started with, so a re-plan needs no control-plane
-- call.  A running request restarts from its token log under a new epoch once every
-- participant of the plan has a live heartbeat reporting that plan.
-- KEYS: epoch, active, participants, plan
-- ARGV: worker, plan id ('' = none), participants json ('' = keep), startup (0/1),
--       ctl prefix, req key prefix, heartbeat prefix
local function alive(plan, parts)
  local names = cjson.decode(parts)
  if #names == 0 then return false end
  for _, w in ipairs(names) do
    local hb = redis.call('GET', ARGV[7] .. w)
    if not hb then return false end
    local ok, info = pcall(cjson.decode, hb)
    if not ok or (info['plan'] or '') ~= plan then return false end
  end
  return true
end

local function member(plan, parts)
  if ARGV[2] ~= plan then return false end
  for _, w in ipairs(cjson.decode(parts)) do
    if w == ARGV[1] then return true end
  end
  return false
end

local function clear(parts)
  for _, w in ipairs(cjson.decode(parts)) do redis.call('DEL', ARGV[5] .. w) end
end

local plan = redis.call('GET', KEYS[4]) or ''
local parts = redis.call('GET', KEYS[3]) or '[]'
local old_parts = parts
local switched = false
-- a plan takes over only from one that cannot run (all of whose workers are not up):
-- a re-plan's pods find the old plan's pods gone, while a restarting pod of a
-- superseded plan finds the current plan running and changes nothing
if ARGV[2] ~= '' and ARGV[2] ~= plan and ARGV[3] ~= '' and not alive(plan, parts) then
  plan, parts, switched = ARGV[2], ARGV[3], true
  redis.call('SET', KEYS[4], plan)
  redis.call('SET', KEYS[3], parts)
  redis.call('SETNX', KEYS[1], 0)
end
local act = redis.call('GET', KEYS[2])
if not act then return {'IDLE', plan} end
local rk = ARGV[6] .. act
local st = redis.call('HMGET', rk, 'status', 'parts', 'pending', 'plan')
if st[1] ~= 'running' then return {'IDLE', plan} end
if switched or (st[4] or '') ~= plan then
  -- fence: no worker of the old plan may go on with this request, and nothing
  -- queued for it may start; the new plan's epoch comes once all of it is up
  local epoch = redis.call('INCR', KEYS[1])
  clear(old_parts)
  clear(parts)
  redis.call('HSET', rk, 'epoch', epoch, 'plan', plan, 'parts', parts, 'pending', 1)
  st[3] = '1'
end
-- a participant that (re)starts has lost the request's state: it needs an epoch
if not ((ARGV[4] == '1' and member(plan, parts)) or st[3] == '1') then
  return {'RUNNING', plan}
end
if not alive(plan, parts) then
  -- whoever beats next after everyone is up starts the epoch
  redis.call('HSET', rk, 'pending', 1)
  return {'WAITING', plan}
end
local epoch = redis.call('INCR', KEYS[1])
clear(parts)
redis.call('HSET', rk, 'epoch', epoch, 'parts', parts, 'plan', plan, 'pending', 0)
local msg = cjson.encode({op = 'start', req = act, epoch = epoch, resume = true})
for _, w in ipairs(cjson.decode(parts)) do redis.call('RPUSH', ARGV[5] .. w, msg) end
return {'RESUMED', tostring(epoch)}
