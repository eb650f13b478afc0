-- Prepended to start.lua, join.lua and arrive.lua: the KV admission rule.  A request's
-- worst case on each stage is stages/model/kv_blocks.py request_blocks (its committed
-- rows plus the m + 1 tree levels of w nodes a stage can hold at once; tests/test_sync.py
-- checks the two agree), priced at the stage count of the pipeline as it is now, so a
-- re-plan to more stages re-prices every running request at once.  A request that would
-- not fit beside the others' waits to (re)join, first in line, instead of running a
-- stage's pool out of blocks.
local KV_BLOCK = 16  -- stages/model/kv_blocks.py DEFAULT_BLOCK_SIZE

local function kv_worst(tokens, stages, width)
  return math.ceil((tokens + (stages + 1) * width + 1) / KV_BLOCK) + 1
end

-- the blocks request `rk` holds on a stage at most, at `stages` stages (a request an
-- earlier version admitted stored only its blocks, 'kv_blocks': a rolling upgrade has
-- both for a while)
local function kv_need(rk, stages)
  local f = redis.call('HMGET', rk, 'kv_tokens', 'kv_w', 'kv_blocks')
  local tokens, width = tonumber(f[1] or ''), tonumber(f[2] or '')
  if not tokens or not width then return tonumber(f[3] or '') or 0 end
  return kv_worst(tokens, stages, width)
end

-- the blocks the running requests among `rids` hold at most, at `stages` stages
local function kv_held(prefix, rids, stages)
  local held = 0
  for _, r in ipairs(rids) do
    if redis.call('HGET', prefix .. r, 'status') == 'running' then
      held = held + kv_need(prefix .. r, stages)
    end
  end
  return held
end

-- whether request `rk` fits beside `held` blocks in the budget it was admitted against
-- (always without one, and alone: one that a re-plan to more stages priced above the
-- whole pool runs by itself rather than wait for ever, holding up the line behind it)
local function kv_fits(rk, held, stages)
  local budget = tonumber(redis.call('HGET', rk, 'kv_budget') or '') or 0
  return budget <= 0 or held == 0 or held + kv_need(rk, stages) <= budget
end

