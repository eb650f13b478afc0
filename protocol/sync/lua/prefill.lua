-- Prepended to start.lua, join.lua and arrive.lua: the prefill rule of
-- protocol/scheduling/prefill.py (read it there; tests/test_sync.py checks the two agree).
-- A (re)joining request prefills its committed sequence (the prompt, and on a resume
-- every logged token but the last) in chunks: the first takes the room stage 1 had when
-- it started (field 'head'; 0 or absent: a whole chunk), the later ones `chunk` rows
-- each.  Pipelined, stage i computes chunk j in step j + i, so they take chunks +
-- stages - 1 steps, a single chunk too.  Chunk 0 (no chunking) crosses every stage in
-- one step.  The last step is the request's step 0 (field 'joined').
local function layout(rk)
  local f = redis.call('HMGET', rk, 'rows', 'chunk', 'head')
  local rows, chunk = tonumber(f[1] or ''), tonumber(f[2] or '')
  if not rows then return nil, chunk, 0 end
  rows = rows + math.max(redis.call('LLEN', rk .. ':log') - 1, 0)
  if not chunk or chunk < 1 then return rows, chunk, rows end
  local head = tonumber(f[3] or '') or 0
  if head <= 0 or head > chunk then head = chunk end
  return rows, chunk, math.min(head, rows)  -- PrefillLayout.first
end

local function chunks_of(rows, chunk, first)
  local rest = rows - first
  if rest <= 0 then return 1 end
  return 1 + math.ceil(rest / chunk)
end

local function steps_of(rows, chunk, first, stages)
  if not rows or not chunk or chunk < 1 then return 1 end
  return chunks_of(rows, chunk, first) + math.max(stages, 1) - 1  -- PrefillLayout.steps
end

local function prefill_steps(rk, stages)
  local rows, chunk, first = layout(rk)
  return steps_of(rows, chunk, first, stages)
end

-- The rows stage 1 computes of a request's prefill in step `t`: chunk t - (its first
-- prefill step), whose first step is 'joined' - prefill_steps + 1.  (A stage's load is
-- stage 1's shifted by its index, so stage 1's bounds every stage's.)
local function stage1_rows(rk, t, stages)
  local rows, chunk, first = layout(rk)
  local joined = tonumber(redis.call('HGET', rk, 'joined') or '')
  if not rows or not joined or joined < 0 then return 0 end
  local j = t - (joined - steps_of(rows, chunk, first, stages) + 1)  -- one read per call
  if not chunk or chunk < 1 then return (j == 0 and rows) or 0 end
  if j < 0 or j >= chunks_of(rows, chunk, first) then return 0 end
  if j == 0 then return first end
  local a = first + (j - 1) * chunk
  return math.min(chunk, rows - a)
end

-- Rows a joiner may put into stage 1 beside `load` rows of earlier joiners' chunks
-- (prefill.room): the budget left, 0 when it must wait.  It starts when this is above
-- 0, and records the room as its 'head'.
local function room(rk, load)
  local chunk = tonumber(redis.call('HGET', rk, 'chunk') or '') or 0
  if chunk < 1 or load <= 0 then return math.max(chunk, 0) end
  return math.max(chunk - load, 0)
end

-- Whether a joiner can start beside `load` rows (always without a budget).
local function fits(rk, load)
  local chunk = tonumber(redis.call('HGET', rk, 'chunk') or '') or 0
  return chunk < 1 or room(rk, load) > 0
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
