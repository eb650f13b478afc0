-- Prepended to start.lua, join.lua and arrive.lua: how many steps a request's prefill
-- takes when it (re)joins the batch.  Its committed sequence (the prompt, and on a
-- resume every logged token but the last) goes in chunks of at most `chunk` rows.  One
-- chunk crosses every stage in one step; more are pipelined, stage i computing chunk j
-- in step j + i, so they take chunks + stages - 1 steps.  The last step is the
-- request's step 0 (field 'joined').  RequestState.prefill_steps in
-- protocol/sync/synchroniser.py is the workers' side of the same rule.
local function prefill_steps(rk, stages)
  local f = redis.call('HMGET', rk, 'rows', 'chunk')
  local rows, chunk = tonumber(f[1] or ''), tonumber(f[2] or '')
  if not rows or not chunk or chunk < 1 then return 1 end
  rows = rows + math.max(redis.call('LLEN', rk .. ':log') - 1, 0)
  local chunks = math.max(math.ceil(rows / chunk), 1)
  if chunks == 1 then return 1 end
  return chunks + math.max(stages, 1) - 1  -- as RequestState.prefill_steps
end

