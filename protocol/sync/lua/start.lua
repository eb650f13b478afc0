-- Store an admitted request and queue it to join (Synchroniser.admit: KEYS/ARGV).  Redis
-- keeps a failed script's writes: every check comes first (admit's come before these).
local function whole(x, lo)
  return type(x) == 'number' and x == x and x ~= math.huge and x == math.floor(x) and x >= lo
end
-- a JSON list whose items are token ids (cjson decodes [] and {} alike: look at the text)
local function tokens(raw)
  local t = string.match(raw, '^%s*%[') and json_table(raw)
  if not t then return nil end
  local n = 0
  for k, v in pairs(t) do
    if type(k) ~= 'number' or not whole(v, 0) then return nil end
    n = n + 1
  end
  if n == #t then return t end
end
local function bad(why) return {'BAD', why} end
local rid = ARGV[1]
if not string.match(rid, '^[%w_.-]+$') or #rid > 128 then
  return bad('request id must be 1-128 letters, digits, _ . or -')
end
-- the keys must be this request's, or the writes would land on another one
if KEYS[1] ~= ARGV[8] .. rid or KEYS[5] ~= KEYS[1] .. ':log' or KEYS[6] ~= KEYS[1] .. ':ev' then
  return bad('keys do not match the request id and prefix')
end
local prompt = tokens(ARGV[2])
if not prompt or #prompt == 0 then
  return bad('prompt must be a non-empty JSON list of token ids')
end
if not tokens(ARGV[5]) then return bad('stop must be a JSON list of token ids') end
-- digits only: the workers parse these with int()
for i, what in pairs({[7] = 'now_ms', [9] = 'ttl_s', [10] = 'chunk'}) do
  if not string.match(ARGV[i], '^%d+$') then return bad(what .. ' must be an integer >= 0') end
end
if tonumber(ARGV[9]) < 1 then return bad('ttl_s must be an integer >= 1') end
-- a retry of a submit whose reply was lost (runner.py) gets its admission back, writing
-- nothing: admitting it again would drop its committed tokens and queue it twice
local was = redis.call('HMGET', KEYS[1], 'status', 'prompt', 'epoch')
if was[1] == 'running' then
  if was[2] ~= ARGV[2] then
    return bad('request id ' .. rid .. ' is already running another prompt')
  end
  return {'OK', was[3] or '0'}
end
local workers = cjson.decode(redis.call('GET', KEYS[4]))  -- admit checked it, WATCHed
local epoch = tonumber(redis.call('GET', KEYS[3]) or '0')
if not whole(epoch, 0) then
  return bad('the stored epoch is not an integer; restart the pipeline')
end
local kv_tokens = #prompt + ARGV[4]  -- (a max_new that is no number errs before any write)
-- every check passed: from here on nothing can fail half-way
local idle = redis.call('SCARD', KEYS[2]) == 0 and redis.call('LLEN', KEYS[8]) == 0
local plan = redis.call('GET', KEYS[7]) or ''
if idle then  -- a new epoch: nothing of an earlier batch can commit in this request
  epoch = redis.call('INCR', KEYS[3])
  redis.call('SET', KEYS[9], plan)
  redis.call('DEL', KEYS[10])
end
redis.call('DEL', KEYS[1], KEYS[5], KEYS[6])
redis.call('HSET', KEYS[1], 'id', rid, 'prompt', ARGV[2], 'params', ARGV[3],
           'max_new', ARGV[4], 'stop', ARGV[5], 'status', 'running', 'epoch', epoch,
           'created_ms', ARGV[7], 'plan', plan, 'rows', #prompt, 'chunk', ARGV[10],
           'joined', -1, 'kv_tokens', kv_tokens, 'kv_w', ARGV[11],
           'kv_budget', ARGV[12], 'kv_cap', ARGV[13], 'kv_blocks', ARGV[14])
redis.call('XADD', KEYS[6], '*', 'start', epoch, 't', ARGV[7])
-- the log does not exist yet: arrive.lua sets its expiry when it creates it
for _, k in ipairs({KEYS[1], KEYS[6]}) do redis.call('EXPIRE', k, ARGV[9]) end
redis.call('RPUSH', KEYS[8], rid)
if idle then
  local msg = cjson.encode({op = 'start', epoch = epoch, reqs = {}, more = true})
  for _, w in ipairs(workers) do redis.call('RPUSH', ARGV[6] .. w, msg) end
end
return {'OK', tostring(epoch)}
