-- Prepended to join.lua: the heartbeats of a layout's participants, and the KV pools
-- they report, which join.lua saves when an epoch starts (Synchroniser.kv_pool reads
-- them while a participant does not beat).

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
