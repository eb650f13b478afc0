-- Store an admitted request and put it in the joining line (Synchroniser.admit: KEYS/ARGV).
-- All or nothing: Redis keeps the writes of a script that errors, so every check comes
-- before the first write; a bad argument returns BAD and leaves Redis as it was.

local function whole(x, lo)
  return type(x) == 'number' and x == x and x ~= math.huge and x == math.floor(x) and x >= lo
end

-- a JSON list whose items are token ids (cjson decodes [] and {} alike: look at the text)
local function tokens(raw)
  if not string.match(raw, '^%s*%[') then return nil end
  local good, t = pcall(cjson.decode, raw)
  if not good or type(t) ~= 'table' then return nil end
  local n = 0
  for k, v in pairs(t) do
    if type(k) ~= 'number' or not whole(v, 0) then return nil end
    n = n + 1
  end
  if n ~= #t then return nil end
  return t
end

local prompt  -- the decoded prompt, once check() passed

local function check()
  if #ARGV ~= 14 or #KEYS ~= 10 then
    return 'start takes 10 keys and 14 arguments, got ' .. #KEYS .. ' and ' .. #ARGV
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
  prompt = tokens(ARGV[2])
  if not prompt or #prompt == 0 then
    return 'prompt must be a non-empty JSON list of token ids'
  end
  if not string.match(ARGV[3], '^%s*{') or not pcall(cjson.decode, ARGV[3]) then
    return 'params must be a JSON object'
  end
  if not tokens(ARGV[5]) then return 'stop must be a JSON list of token ids' end
  if ARGV[6] == '' or ARGV[8] == '' then return 'empty key prefix' end
  -- digits only: the workers parse these with int()
  local digits = {[4] = 'max_new', [7] = 'now_ms', [9] = 'ttl_s', [10] = 'chunk',
                  [11] = 'kv width', [12] = 'kv budget', [13] = 'kv cap', [14] = 'kv blocks'}
  for i, what in pairs(digits) do
    if not string.match(ARGV[i], '^%d+$') then return what .. ' must be an integer >= 0' end
  end
  if tonumber(ARGV[4]) < 1 then return 'max_new must be an integer >= 1' end
  if tonumber(ARGV[9]) < 1 then return 'ttl_s must be an integer >= 1' end
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
local parts = redis.call('GET', KEYS[4])
if not parts then return {'NOPIPE', ''} end
local good, workers = pcall(cjson.decode, parts)
if not good or type(workers) ~= 'table' or #workers == 0 then
  return {'BAD', 'the stored participant list is not a JSON list of names; restart the pipeline'}
end
local epoch = tonumber(redis.call('GET', KEYS[3]) or '0')
if not whole(epoch, 0) then
  return {'BAD', 'the stored epoch is not an integer; restart the pipeline'}
end

-- every check passed: from here on nothing can fail half-way
local idle = redis.call('SCARD', KEYS[2]) == 0 and redis.call('LLEN', KEYS[8]) == 0
local plan = redis.call('GET', KEYS[7]) or ''
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
           'created_ms', ARGV[7], 'plan', plan, 'rows', #prompt, 'chunk', ARGV[10],
           'joined', -1, 'kv_tokens', #prompt + tonumber(ARGV[4]), 'kv_w', ARGV[11],
           'kv_budget', ARGV[12], 'kv_cap', ARGV[13], 'kv_blocks', ARGV[14])
redis.call('XADD', KEYS[6], '*', 'start', epoch, 't', ARGV[7])
-- the log (KEYS[5]) does not exist yet: arrive.lua sets its expiry when it creates it
for _, k in ipairs({KEYS[1], KEYS[6]}) do redis.call('EXPIRE', k, ARGV[9]) end
redis.call('RPUSH', KEYS[8], ARGV[1])
if idle then
  local msg = cjson.encode({op = 'start', epoch = epoch, reqs = {}, more = true})
  for _, w in ipairs(workers) do redis.call('RPUSH', ARGV[6] .. w, msg) end
end
return {'OK', tostring(epoch)}
