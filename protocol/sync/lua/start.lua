-- Store an admitted request and put it in the joining line (Synchroniser.admit: KEYS/ARGV).
-- All or nothing: Redis keeps the writes of a script that errors, so every check comes
-- before the first write; a bad argument returns BAD and leaves Redis as it was.  admit
-- checks params, max_new, the kv numbers and the participant list (WATCHed) before this.

local function whole(x, lo)
  return type(x) == 'number' and x == x and x ~= math.huge and x == math.floor(x) and x >= lo
end

-- a JSON list whose items are token ids (cjson decodes [] and {} alike: look at the text)
local function tokens(raw)
  if not string.match(raw, '^%s*%[') then return nil end
  local t = json_table(raw)
  if not t then return nil end
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
  if not tokens(ARGV[5]) then return 'stop must be a JSON list of token ids' end
  -- digits only: the workers parse these with int()
  for i, what in pairs({[7] = 'now_ms', [9] = 'ttl_s', [10] = 'chunk'}) do
    if not string.match(ARGV[i], '^%d+$') then return what .. ' must be an integer >= 0' end
  end
  if tonumber(ARGV[9]) < 1 then return 'ttl_s must be an integer >= 1' end
  return nil
end

local bad = check()
if bad then return {'BAD', bad} end

-- A retry of a submit whose reply was lost (runner.py resubmits the same id after a
-- dropped connection) gets its admission back and writes nothing: admitting it again
-- would delete the tokens it committed and queue it to join a batch it is already in.
if redis.call('HGET', KEYS[1], 'status') == 'running' then
  if redis.call('HGET', KEYS[1], 'prompt') ~= ARGV[2] then
    return {'BAD', 'request id ' .. ARGV[1] .. ' is already running another prompt'}
  end
  return {'OK', redis.call('HGET', KEYS[1], 'epoch') or '0'}
end
local workers = cjson.decode(redis.call('GET', KEYS[4]))
local epoch = tonumber(redis.call('GET', KEYS[3]) or '0')
if not whole(epoch, 0) then
  return {'BAD', 'the stored epoch is not an integer; restart the pipeline'}
end
local kv_tokens = #prompt + ARGV[4]  -- (a max_new that is no number errs before any write)

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
           'joined', -1, 'kv_tokens', kv_tokens, 'kv_w', ARGV[11],
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
