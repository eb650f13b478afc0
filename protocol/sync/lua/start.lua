-- Admit a request: record its state and put it in the line to join the batch; the
-- scheduler (the draft service) lets it join at a step barrier (arrive.lua).  On an
-- idle pipeline a new epoch starts with no request and this one first in line, so the
-- scheduler decides at the epoch's first barrier.
-- KEYS: req, batch (set), epoch, participants, log, events, plan, joining (list),
--       epoch plan, pending, kv pool (join.lua)
-- ARGV: rid, prompt (json), params (json), max_new, stop ids (json), ctl prefix,
--       now_ms, req key prefix, ttl_s, slots (requests running at most),
--       chunk (prompt rows per prefill step; 0: the whole prompt in one step),
--       kv width (the tree width a stage's worst case counts, kv.lua), kv budget
--       (blocks in each stage's pool as the gateway read them; 0: no budget), kv cap
--       (the gateway's own budget in blocks; 0: none), heartbeat prefix
-- Returns {'OK', epoch} (also, writing nothing, to a retry of a running request's
-- admission), {'BUSY', a running rid},
-- {'FULL', 'blocks the running hold/blocks this one needs/the budget'},
-- {'TOOBIG', 'blocks this one needs/the budget/stages'} (it would not fit even alone),
-- {'NOPIPE', ''} or {'BAD', why}.
--
-- All or nothing: Redis keeps the writes a script made before it errors, so every
-- argument (and the stored state the writes depend on) is checked before the first
-- write; a bad one returns BAD and leaves Redis as it was.

local function finite(x)
  return type(x) == 'number' and x == x and x ~= math.huge and x ~= -math.huge
end

local function whole(x, lo)
  return finite(x) and x == math.floor(x) and x >= lo
end

-- a JSON list whose items pass `ok` (cjson decodes [] and {} alike: look at the text)
local function list_of(raw, ok)
  if not string.match(raw, '^%s*%[') then return nil end
  local good, t = pcall(cjson.decode, raw)
  if not good or type(t) ~= 'table' then return nil end
  local n = 0
  for k, v in pairs(t) do
    if type(k) ~= 'number' or not ok(v) then return nil end
    n = n + 1
  end
  if n ~= #t then return nil end
  return t
end

local function token(v) return whole(v, 0) end
local function name(v) return type(v) == 'string' and v ~= '' end

-- the sampling fields the stages read (stages/runtime/worker.py sampling_from), with
-- the bounds of SamplingParams (stages/model/sampling.py)
local SAMPLING = {
  temperature = function(v) return finite(v) and v >= 0 and v <= 100 end,
  top_p = function(v) return finite(v) and v > 0 and v <= 1 end,
  top_k = function(v) return whole(v, 0) and v < 2147483648 end,
  -- <=: a double rounds the largest uint64 seeds up to 2^64 (Python checks exactly)
  seed = function(v) return whole(v, 0) and v <= 18446744073709551616 end,
}

local prompt  -- the decoded prompt, once check() passed

local function check()
  if #ARGV ~= 15 or #KEYS ~= 11 then
    return 'start takes 11 keys and 15 arguments, got ' .. #KEYS .. ' and ' .. #ARGV
  end
  local rid = ARGV[1]
  if not string.match(rid, '^[%w_.-]+$') or #rid > 128 then
    return 'request id must be 1-128 letters, digits, _ . or -'
  end
  -- the keys must be this request's, or the writes would land on another one
  if KEYS[1] ~= ARGV[8] .. rid or KEYS[5] ~= KEYS[1] .. ':log'
      or KEYS[6] ~= KEYS[1] .. ':ev' then
    return 'keys do not match the request id and prefix'
  end
  prompt = list_of(ARGV[2], token)
  if not prompt or #prompt == 0 then
    return 'prompt must be a non-empty JSON list of token ids'
  end
  local good, params = pcall(cjson.decode, ARGV[3])
  if not good or type(params) ~= 'table' or not string.match(ARGV[3], '^%s*{') then
    return 'params must be a JSON object'
  end
  for k, v in pairs(params) do
    if type(k) ~= 'string' then return 'params must be a JSON object' end
    if SAMPLING[k] and not SAMPLING[k](v) then
      return 'params.' .. k .. ' is out of range: ' .. tostring(v)
    end
  end
  -- digits only: the workers parse these with int()
  if not string.match(ARGV[4], '^%d+$') or tonumber(ARGV[4]) < 1 then
    return 'max_new must be an integer >= 1'
  end
  if not list_of(ARGV[5], token) then return 'stop must be a JSON list of token ids' end
  if ARGV[6] == '' or ARGV[8] == '' then return 'empty key prefix' end
  if not string.match(ARGV[7], '^%d+$') then return 'now_ms must be an integer' end
  if not string.match(ARGV[9], '^%d+$') or tonumber(ARGV[9]) < 1 then
    return 'ttl_s must be an integer >= 1'
  end
  if not string.match(ARGV[10], '^%d+$') or tonumber(ARGV[10]) < 1 then
    return 'slots must be an integer >= 1'
  end
  if not string.match(ARGV[11], '^%d+$') then
    return 'chunk must be an integer >= 0 (0: the whole prompt in one step)'
  end
  if not string.match(ARGV[12], '^%d+$') then return 'kv width must be an integer >= 0' end
  if not string.match(ARGV[13], '^%d+$') then
    return 'kv budget must be an integer >= 0 (0: no budget)'
  end
  if not string.match(ARGV[14], '^%d+$') then
    return 'kv cap must be an integer >= 0 (0: none)'
  end
  if ARGV[15] == '' then return 'empty heartbeat prefix' end
  return nil
end

local bad = check()
if bad then return {'BAD', bad} end

-- A retry of a submit whose reply was lost (runner.py resubmits the same id after a
-- dropped connection) finds the request admitted already: it gets that admission back
-- and nothing is written.  Admitting it again would delete its log and events (tokens
-- already committed), reset its hash and queue it to join a batch it is already in.
if redis.call('HGET', KEYS[1], 'status') == 'running' then
  if redis.call('HGET', KEYS[1], 'prompt') ~= ARGV[2] then
    return {'BAD', 'request id ' .. ARGV[1] .. ' is already running another prompt'}
  end
  return {'OK', redis.call('HGET', KEYS[1], 'epoch') or '0'}
end

-- the requests still running: members of the batch and those waiting to join it (a
-- cancelled or finished one leaves at the next barrier but holds no slot any more)
local members = redis.call('SMEMBERS', KEYS[2])
local queued = redis.call('LRANGE', KEYS[8], 0, -1)
local live = {}  -- their ids, read once for the slots and the KV blocks they hold
for _, list in ipairs({members, queued}) do
  for _, r in ipairs(list) do
    if redis.call('HGET', ARGV[8] .. r, 'status') == 'running' then live[#live + 1] = r end
  end
end
if #live >= tonumber(ARGV[10]) then return {'BUSY', live[1]} end
local parts = redis.call('GET', KEYS[4])
if not parts then return {'NOPIPE', ''} end
local workers = list_of(parts, name)
if not workers or #workers == 0 then
  return {'BAD', 'the stored participant list is not a JSON list of names; restart the pipeline'}
end
-- the KV blocks the running requests' worst cases hold on each stage, and this one's, at
-- the stage count now (the stages free a finished one's blocks at the barrier this one
-- joins at, before its first chunk)
local stages = math.max(#workers - 1, 1)
local need = kv_worst(#prompt + tonumber(ARGV[4]), stages, tonumber(ARGV[12]))
-- in the pools as they are now (kv_limit, as for the running requests)
local plan = redis.call('GET', KEYS[7]) or ''
local budget = kv_limit(tonumber(ARGV[13]), tonumber(ARGV[14]),
                        kv_pool(workers, ARGV[15], plan, KEYS[11]))
if budget > 0 then
  -- one that does not fit even alone (its gateway read larger pools, or priced it at
  -- fewer stages before a re-plan) is refused: it would run a pool out of blocks
  if need > budget then return {'TOOBIG', need .. '/' .. budget .. '/' .. stages} end
  local held = 0
  for _, r in ipairs(live) do held = held + kv_need(ARGV[8] .. r, stages) end
  if held + need > budget then return {'FULL', held .. '/' .. need .. '/' .. budget} end
end
local epoch = tonumber(redis.call('GET', KEYS[3]) or '0')
if not whole(epoch, 0) then
  return {'BAD', 'the stored epoch is not an integer; restart the pipeline'}
end

-- every check passed: from here on nothing can fail half-way
local idle = #members == 0 and #queued == 0
if idle then
  -- no batch is stepping: a new epoch starts with this request (nothing of an earlier
  -- batch can commit in it)
  epoch = redis.call('INCR', KEYS[3])
  redis.call('SET', KEYS[9], plan)
  redis.call('DEL', KEYS[10])
end
redis.call('DEL', KEYS[1], KEYS[5], KEYS[6])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'prompt', ARGV[2], 'params', ARGV[3],
           'max_new', ARGV[4], 'stop', ARGV[5], 'status', 'running', 'epoch', epoch,
           'created_ms', ARGV[7], 'plan', plan, 'rows', #prompt, 'chunk', ARGV[11],
           'joined', -1, 'kv_tokens', #prompt + tonumber(ARGV[4]), 'kv_w', ARGV[12],
           'kv_budget', ARGV[13], 'kv_cap', ARGV[14], 'kv_blocks', need)  -- kv_blocks: for an earlier version
redis.call('XADD', KEYS[6], '*', 'start', epoch, 't', ARGV[7])
-- the log (KEYS[5]) does not exist yet: arrive.lua sets its expiry when it creates it
for _, k in ipairs({KEYS[1], KEYS[6]}) do redis.call('EXPIRE', k, ARGV[9]) end
redis.call('RPUSH', KEYS[8], ARGV[1])
if idle then
  local msg = cjson.encode({op = 'start', epoch = epoch, reqs = {}, more = true})
  for _, w in ipairs(workers) do redis.call('RPUSH', ARGV[6] .. w, msg) end
end
return {'OK', tostring(epoch)}
