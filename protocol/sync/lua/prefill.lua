-- Prepended to start.lua, join.lua and arrive.lua: how many steps a request's prefill
-- takes when it (re)joins the batch.  Its committed sequence (the prompt, and on a
-- resume every logged token but the last) goes in chunks of at most `chunk` rows,
-- pipelined: stage i computes chunk j in step j + i, so they take chunks + stages - 1
-- steps, a single chunk too.  Chunk 0 (no chunking) crosses every stage in one step.
-- The last step is the request's step 0 (field 'joined').  RequestState.prefill_steps in
-- protocol/sync/synchroniser.py is the workers' side of the same rule.
local function committed_rows(rk)
  local f = redis.call('HMGET', rk, 'rows', 'chunk')
  local rows, chunk = tonumber(f[1] or ''), tonumber(f[2] or '')
  if not rows then return nil, chunk end
  return rows + math.max(redis.call('LLEN', rk .. ':log') - 1, 0), chunk
end

local function steps_of(rows, chunk, stages)
  if not rows or not chunk or chunk < 1 then return 1 end
  local chunks = math.max(math.ceil(rows / chunk), 1)
  return chunks + math.max(stages, 1) - 1  -- as RequestState.prefill_steps
end

local function prefill_steps(rk, stages)
  local rows, chunk = committed_rows(rk)
  return steps_of(rows, chunk, stages)
end

-- The rows stage 1 computes of a request's prefill in step `t`: chunk t - (its first
-- prefill step), whose first step is 'joined' - prefill_steps + 1.  (A stage's load is
-- stage 1's shifted by its index, so stage 1's bounds every stage's.)
local function stage1_rows(rk, t, stages)
  local rows, chunk = committed_rows(rk)
  local joined = tonumber(redis.call('HGET', rk, 'joined') or '')
  if not rows or not joined or joined < 0 then return 0 end
  local j = t - (joined - steps_of(rows, chunk, stages) + 1)
  if not chunk or chunk < 1 then return (j == 0 and rows) or 0 end
  if j < 0 or j * chunk >= rows then return 0 end
  return math.min(chunk, rows - j * chunk)
end

-- The joining requests share a budget of prompt rows entering stage 1 per step: the
-- joiner's chunk (0: no budget), as in the engine's BatchRun.  A request may start its
-- prefill in a step whose stage 1 already has `load` rows of others' chunks if its first
-- chunk fits beside them, and always when there are none.  A request's load never grows
-- after its first step, so the check at the first step holds for all later ones.
local function fits(rk, load)
  local rows, chunk = committed_rows(rk)
  if load <= 0 or not rows or not chunk or chunk < 1 then return true end
  return load + math.min(chunk, rows) <= chunk
end

-- Stage 1's prefill rows in step `t` from the running requests `rids`.
local function stage1_load(prefix, rids, t, stages)
  local load = 0
  for _, r in ipairs(rids) do
    if redis.call('HGET', prefix .. r, 'status') == 'running' then
      load = load + stage1_rows(prefix .. r, t, stages)
    end
  end
  return load
end
