-- A worker joins the pipeline: at its start, and every heartbeat while the stored
-- plan is not its own.  Workers bring the plan (stage layout) they were started
-- with; the newest starter sets it, so a re-plan needs no control-plane call.  A
-- running request restarts from its token log under a new epoch once every
-- participant of the plan has a live heartbeat reporting that plan: the last
-- worker to come up (a restarted pod, the new stages of a re-plan) triggers it.
-- KEYS: epoch, active, participants, plan
-- ARGV: worker, plan id ('' = none), participants json ('' = keep), startup (0/1),
--       ctl prefix, req key prefix, heartbeat prefix
local function alive(plan, parts)
  for _, w in ipairs(cjson.decode(parts)) do
    local hb = redis.call('GET', ARGV[7] .. w)
    if not hb then return false end
    local ok, info = pcall(cjson.decode, hb)
    if not ok or (info['plan'] or '') ~= plan then return false end
  end
  return true
end

local plan = redis.call('GET', KEYS[4]) or ''
local parts = redis.call('GET', KEYS[3]) or '[]'
local startup = ARGV[4] == '1'
local switched = false
if ARGV[2] ~= '' and ARGV[2] ~= plan and ARGV[3] ~= '' then
  -- a restarted worker of a superseded plan (a pod not yet replaced) only takes the
  -- pipeline back while the stored plan cannot run; that stops once it is gone
  if startup or not alive(plan, parts) then
    plan, parts, switched = ARGV[2], ARGV[3], true
    redis.call('SET', KEYS[4], plan)
    redis.call('SET', KEYS[3], parts)
    redis.call('SETNX', KEYS[1], 0)
  end
end
local act = redis.call('GET', KEYS[2])
if not act then return {'IDLE', plan} end
local rk = ARGV[6] .. act
local st = redis.call('HMGET', rk, 'status', 'parts')
if st[1] ~= 'running' then return {'IDLE', plan} end
if not (startup or switched or st[2] ~= parts) then return {'RUNNING', plan} end
if not alive(plan, parts) then return {'WAITING', plan} end
-- the new epoch, as in resume.lua
local epoch = redis.call('INCR', KEYS[1])
for _, w in ipairs(cjson.decode(parts)) do redis.call('DEL', ARGV[5] .. w) end
redis.call('HSET', rk, 'epoch', epoch, 'parts', parts)
local msg = cjson.encode({op = 'start', req = act, epoch = epoch, resume = true})
for _, w in ipairs(cjson.decode(parts)) do redis.call('RPUSH', ARGV[5] .. w, msg) end
return {'RESUMED', tostring(epoch)}
