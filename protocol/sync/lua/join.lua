-- A worker joins, or asks for a new epoch (Synchroniser._join_script: KEYS/ARGV, replies).
local function live(plan, parts)  -- its participants that beat with it (no plan: ''), of all
  local names, n = cjson.decode(parts), 0
  for _, w in ipairs(names) do
    local beat = json_table(redis.call('GET', ARGV[7] .. w))
    if beat and (beat['plan'] or '') == plan then n = n + 1 end
  end
  return n, #names
end
local function alive(plan, parts)
  local n, total = live(plan, parts)
  return total > 0 and n == total
end
local function clear(parts)
  for _, w in ipairs(cjson.decode(parts)) do redis.call('DEL', ARGV[5] .. w) end
end
local plan = redis.call('GET', KEYS[4]) or ''
local parts = redis.call('GET', KEYS[3]) or '[]'
local old_parts = parts
local switched = false
-- a plan takes over only from one that cannot run, and only with more live workers
if ARGV[2] ~= '' and ARGV[2] ~= plan and ARGV[3] ~= '' and not alive(plan, parts) then
  if live(ARGV[2], ARGV[3]) > live(plan, parts) then
    plan, parts, switched = ARGV[2], ARGV[3], true
    redis.call('SET', KEYS[4], plan)
    redis.call('SET', KEYS[3], parts)
    redis.call('SETNX', KEYS[1], 0)
  end
end
local force = ARGV[8] == '1'
-- a participant of the plan that (re)starts has lost the requests' state
local restarted = false
if ARGV[4] == '1' and ARGV[2] == plan then
  for _, w in ipairs(cjson.decode(parts)) do restarted = restarted or w == ARGV[1] end
end
local pending = redis.call('GET', KEYS[7]) == '1'
-- no worker of another plan's epoch may commit any more
local fence = switched or (redis.call('GET', KEYS[6]) or '') ~= plan
-- the running requests: the batch's oldest first (a budget holds back the newest), then the line
local reqs = {}
local members = redis.call('SMEMBERS', KEYS[2])
-- the requests cancelled in the batch end now: their barrier will never complete
local function end_cancelled()
  local t = redis.call('TIME')[1] * 1000
  for _, r in ipairs(members) do end_if_ending(ARGV[6] .. r, t) end
end
local born = {}
for _, r in ipairs(members) do
  born[r] = tonumber(redis.call('HGET', ARGV[6] .. r, 'created_ms') or '') or 0
end
table.sort(members, function(x, y) return born[x] < born[y] or (born[x] == born[y] and x < y) end)
for _, list in ipairs({members, redis.call('LRANGE', KEYS[5], 0, -1)}) do
  for _, r in ipairs(list) do
    if redis.call('HGET', ARGV[6] .. r, 'status') == 'running' then reqs[#reqs + 1] = r end
  end
end
local STUCK_S = 20  -- how long finished requests may sit in the batch
local idle_key = KEYS[2] .. ':finished'
if #reqs == 0 then
  -- finished requests in the batch: left to the barrier completing now (their last
  -- schedule mark), unless it never completes or it is STUCK_S late (_join_script)
  local now = tonumber(redis.call('TIME')[1])
  local since = tonumber(redis.call('GET', idle_key) or '')
  if #members > 0 and not since then
    redis.call('SET', idle_key, now, 'EX', 10 * STUCK_S)
    since = now
  end
  if force or fence or restarted or pending or #members == 0 or now - since >= STUCK_S then
    end_cancelled()
    redis.call('DEL', KEYS[2], KEYS[5], idle_key)
  end
  redis.call('DEL', KEYS[7])
  if force then  -- a fresh epoch: nothing of an earlier run can commit any more
    clear(parts)
    return {'IDLE', tostring(redis.call('INCR', KEYS[1]))}
  end
  return {'IDLE', plan}
end
redis.call('DEL', idle_key)  -- a request runs: the batch is stepping
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if force and tonumber(ARGV[9]) >= 0 and cur ~= tonumber(ARGV[9]) then
  return {'RUNNING', plan}  -- the caller waited in an epoch that is already over
end
if fence then  -- nor may anything queued for them start: the epoch comes once all is up
  local fenced = redis.call('INCR', KEYS[1])
  end_cancelled()
  redis.call('SET', KEYS[6], plan)
  for _, r in ipairs(reqs) do
    redis.call('HSET', ARGV[6] .. r, 'epoch', fenced, 'plan', plan)
  end
  clear(old_parts)
  clear(parts)
  redis.call('SET', KEYS[7], 1)
  pending = true
end
if not (force or restarted or pending) then return {'RUNNING', plan} end
if not alive(plan, parts) then
  redis.call('SET', KEYS[7], 1)  -- whoever beats next after everyone is up starts it
  return {'WAITING', plan}
end
local epoch = redis.call('INCR', KEYS[1])
end_cancelled()
clear(parts)
redis.call('SET', KEYS[6], plan)
redis.call('DEL', KEYS[7], KEYS[2], KEYS[5])
-- all restart from their token logs, first in line in this order, as the scheduler lets them
for _, r in ipairs(reqs) do
  redis.call('HSET', ARGV[6] .. r, 'epoch', epoch, 'plan', plan, 'joined', -1)
  redis.call('RPUSH', KEYS[5], r)
end
local msg = cjson.encode({op = 'start', epoch = epoch, reqs = {}, resume = true, more = true})
for _, w in ipairs(cjson.decode(parts)) do redis.call('RPUSH', ARGV[5] .. w, msg) end
return {'RESUMED', tostring(epoch)}
