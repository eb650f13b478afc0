-- Prepended to join.lua: whether a participant beats with a layout.

-- the heartbeat of participant `w` (`hb_prefix` .. w) if it beats with layout `plan`
-- (one without a plan has the plan '': workers started without one), else nil
local function beat_of(hb_prefix, w, plan)
  local raw = redis.call('GET', hb_prefix .. w)
  if not raw then return nil end
  local ok, info = pcall(cjson.decode, raw)
  if not ok or type(info) ~= 'table' or (info['plan'] or '') ~= plan then return nil end
  return info
end
