-- The step barrier of the batch: one barrier per pipeline step carries every request
-- in flight.  A participant reports once that it finished step `step` of the epoch,
-- with one entry per request it computed: the last stage the token it verified (it is
-- committed now), the draft service the root's children (token -> node id) and the id
-- a new root gets on a miss.  When everyone has arrived, one verdict per request goes
-- to every participant's control list in one message, together with the requests that
-- join the batch in the next step (admitted since, as far as the prefill budget goes:
-- see fits() in prefill.lua; their prefill starts in the next step, and takes
-- prefill_steps of them: a long prompt goes in chunks, pipelined through the stages
-- beside the other requests' steps).  Each request's outcome is appended to its
-- schedule string: ':' for each prefill step before the last, '|' at the last (its
-- step 0), then 'h' (hit), 'm' (miss) or '.' (nothing verified).
-- KEYS: epoch, batch (set), joining (list), barrier, participants, plan, kv pool (join.lua)
-- ARGV: epoch, step, worker, ctl prefix, ttl_s, now_ms, req key prefix,
--       reports (json object: rid -> [token (-1: none), root id (-1: not the draft),
--       child token, child id, child token, child id, ...]), heartbeat prefix
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur ~= tonumber(ARGV[1]) then return {'STALE', tostring(cur)} end  -- epoch fence
if redis.call('HSETNX', KEYS[4], 'w:' .. ARGV[3], 1) == 0 then return {'DUP', '0'} end
local ok, reports = pcall(cjson.decode, ARGV[8])
if not ok or type(reports) ~= 'table' then reports = {} end
for rid, rep in pairs(reports) do
  if type(rid) == 'string' and type(rep) == 'table'
      and redis.call('SISMEMBER', KEYS[2], rid) == 1 then
    local rk = ARGV[7] .. rid
    local tok = tonumber(rep[1]) or -1
    local st = redis.call('HMGET', rk, 'status', 'max_new', 'stop')
    if tok >= 0 and st[1] == 'running' then
      local n = redis.call('RPUSH', rk .. ':log', tok)
      -- every key of the request expires ttl_s after its last commit: the log too (its
      -- first push creates it; without this every output stayed in Redis and its AOF),
      -- and a request that runs longer than ttl_s keeps its state while it runs
      for _, k in ipairs({rk, rk .. ':log', rk .. ':ev'}) do redis.call('EXPIRE', k, ARGV[5]) end
      redis.call('HSET', KEYS[4], 't:' .. rid, tok)
      redis.call('XADD', rk .. ':ev', '*', 'tok', tok, 'i', n - 1, 't', ARGV[6])
      local reason = false
      for _, s in ipairs(cjson.decode(st[3])) do
        if s == tok then reason = 'eos' end
      end
      if not reason and n >= tonumber(st[2]) then reason = 'length' end
      if reason then
        redis.call('HSET', rk, 'status', 'done', 'reason', reason)
        redis.call('XADD', rk .. ':ev', '*', 'end', 'done', 'reason', reason, 't', ARGV[6])
      end
    end
    local root = tonumber(rep[2]) or -1
    if root >= 0 then
      redis.call('HSET', KEYS[4], 'r:' .. rid, root)
      -- the first child with a token wins, as in stages/speculation/step.py decide()
      for i = 3, #rep - 1, 2 do
        redis.call('HSETNX', KEYS[4], 'c:' .. rid .. ':' .. tostring(rep[i]), rep[i + 1])
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
-- everyone is here: one verdict per request of the batch
local step = tonumber(ARGV[2])
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
  elseif step < first then
    -- a prefill chunk: nothing to verify yet
  elseif bar[1] then
    token = tonumber(bar[1])
    child = tonumber(redis.call('HGET', KEYS[4], 'c:' .. rid .. ':' .. bar[1]) or '-1')
  end
  local done = st[1] ~= 'running'
  if st[1] then
    local mark = (step < first and ':') or '|'
    if step > first then
      mark = (token < 0 and '.') or (child >= 0 and 'h') or 'm'
    end
    redis.call('APPEND', rk .. ':sched', mark)
    redis.call('EXPIRE', rk .. ':sched', ARGV[5])
    redis.call('HSET', rk, 'step', step - first)
  end
  verdicts[#verdicts + 1] = {rid, token, child, tonumber(bar[2] or '-1'), done}
  if done then redis.call('SREM', KEYS[2], rid) end
end
-- requests admitted since the last barrier join now, in order, while the prefill budget
-- has room beside the chunks stage 1 already has in the next step (their first chunk
-- takes that room) and the KV budget has room beside the worst cases of the batch (a
-- request a re-plan left waiting: kv.lua); the first without room waits, first in
-- line, for a later barrier; their prefill starts in the next step
local stages = #parts - 1
-- (`members` still names the requests that ended now: stage1_load and kv_held count
-- running ones, and the stages free the blocks of the others before the next step)
local load = stage1_load(ARGV[7], members, step + 1, stages)
local kv_stages = math.max(stages, 1)  -- as the gateway and start.lua count them
local held = kv_held(ARGV[7], members, kv_stages)
local pool = false  -- the pools now (kv_pool), read once a request waits to join
local joins = {}
while true do
  local rid = redis.call('LINDEX', KEYS[3], 0)
  if not rid then break end
  local rk = ARGV[7] .. rid
  if redis.call('HGET', rk, 'status') == 'running' then
    if not fits(rk, load) then break end
    if pool == false then
      pool = kv_pool(parts, ARGV[9], redis.call('GET', KEYS[6]) or '', KEYS[7])
    end
    if not kv_fits(rk, held, kv_stages, pool) then break end
    held = held + kv_need(rk, kv_stages)
    redis.call('SADD', KEYS[2], rid)
    redis.call('HSET', rk, 'head', room(rk, load))  -- before its steps: they follow it
    redis.call('HSET', rk, 'epoch', ARGV[1], 'joined', step + prefill_steps(rk, stages))
    load = load + stage1_rows(rk, step + 1, stages)
    joins[#joins + 1] = rid
  end
  redis.call('LPOP', KEYS[3])
end
local msg = cjson.encode({op = 'step', epoch = tonumber(ARGV[1]), step = step,
                          v = verdicts, join = joins})
for _, w in ipairs(parts) do redis.call('RPUSH', ARGV[4] .. w, msg) end
redis.call('DEL', KEYS[4])
return {'GO', tostring(arrived)}
