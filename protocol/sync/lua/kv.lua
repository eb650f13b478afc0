-- Prepended to start.lua and join.lua: a request's KV worst case and the pools the
-- workers report, for start.lua's refusals (FULL, TOOBIG) and the pools join.lua saves
-- when an epoch starts.  A request's worst case on each stage is
-- protocol/scheduling/kv_blocks.py request_blocks (tests/test_sync.py checks the two
-- agree), priced at the stage count of the pipeline as it is now and held to the pools
-- its workers report now (kv_limit, as protocol/scheduling/kv_blocks.py kv_limit).  Which
-- requests join the batch is the scheduler's (the draft service's) decision.
local KV_BLOCK = 16  -- protocol/scheduling/kv_blocks.py DEFAULT_BLOCK_SIZE

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

-- a heartbeat's fixed KV pool in blocks (stages/runtime/kv_pool.py kv_use), 0 for a
-- pool that grows, none, or a report that is no whole number of blocks; as the
-- gateway reads it (protocol/scheduling/kv_blocks.py fixed_blocks)
local function kv_fixed(kv)
  if type(kv) ~= 'table' then return 0 end
  local fixed, n = kv['fixed'], kv['blocks']
  if not (fixed == true or (type(fixed) == 'number' and fixed ~= 0)) then return 0 end
  if type(n) ~= 'number' or n ~= math.floor(n) or n < 1 or n >= 2 ^ 53 then return 0 end
  return n
end

-- the heartbeat of participant `w` (`hb_prefix` .. w) if it beats with layout `plan`
-- (one without a plan has the plan '': workers started without one), else nil; join.lua
-- counts a plan's live participants by it too
local function beat_of(hb_prefix, w, plan)
  local raw = redis.call('GET', hb_prefix .. w)
  if not raw then return nil end
  local ok, info = pcall(cjson.decode, raw)
  if not ok or type(info) ~= 'table' or (info['plan'] or '') ~= plan then return nil end
  return info
end

-- the smallest fixed KV pool in blocks the participants `parts` of layout `plan` report
-- in their live heartbeats (`hb_prefix` .. name): the pools as they are now, which
-- after a re-plan are the new plan's, not those a request was admitted against; 0 when
-- none is fixed (no pool to hold the requests to).  While a participant does not beat
-- with this plan (a restarting stage, or the old plan's worker of that name on its
-- way out), the pools the plan's epoch started with (the hash `saved`, written by
-- join.lua), or nil if it has none
local function kv_pool(parts, hb_prefix, plan, saved)
  local pool = 0
  for _, w in ipairs(parts) do
    local info = beat_of(hb_prefix, w, plan)
    if not info then
      local f = redis.call('HMGET', saved, 'plan', 'blocks')
      if f[1] == plan then return tonumber(f[2]) end
      return nil
    end
    local n = kv_fixed(info['kv'])
    if n > 0 and (pool == 0 or n < pool) then pool = n end
  end
  return pool
end

-- the budget in blocks (0: none) of a request whose gateway read `stored` when it
-- admitted it and caps it at `cap` (its own --kv-tokens, 0: none; nil from a gateway of
-- an earlier version: `stored` stands for it): the pools now (`pool`, kv_pool) within
-- the cap; with no fixed pool now, the cap, or else `stored` (a gateway without
-- --kv-tokens read it from pools that were fixed); while the pools are unknown,
-- `stored`
local function kv_limit(stored, cap, pool)
  if pool == nil then return stored end
  cap = cap or stored
  if pool == 0 then return cap > 0 and cap or stored end
  if cap > 0 and cap < pool then return cap end
  return pool
end
