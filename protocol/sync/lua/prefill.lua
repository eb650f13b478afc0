-- Prepended to start.lua, join.lua and arrive.lua: how many steps a request's prefill
-- takes when it (re)joins the batch.  Its committed sequence (the prompt, and on a
-- resume every logged token but the last) crosses the stages in chunks of at most
-- `chunk` rows, one chunk per step; the last chunk's step is the request's step 0
-- (field 'joined').  RequestState.prefill_steps in protocol/sync/synchroniser.py is
-- the workers' side of the same rule.
local function prefill_steps(rk)
  local f = redis.call('HMGET', rk, 'rows', 'chunk')
  local rows, chunk = tonumber(f[1] or ''), tonumber(f[2] or '')
  if not rows or not chunk or chunk < 1 then return 1 end
  rows = rows + math.max(redis.call('LLEN', rk .. ':log') - 1, 0)
  return math.max(math.ceil(rows / chunk), 1)
end

