-- Prepended to arrive.lua, join.lua and start.lua (synchroniser.py _with_prelude).
-- what JSON text `raw` decodes to if that is a list or an object, else nil
local function json_table(raw)
  local ok, v = pcall(cjson.decode, raw)
  if ok and type(v) == 'table' then return v end
end
-- request key `rk`'s end event if it was cancelled in the batch ('ending', cancel.lua):
-- it follows the token its last step committed
local function end_if_ending(rk, t)
  local why = redis.call('HMGET', rk, 'ending', 'reason')
  if why[1] then
    redis.call('HDEL', rk, 'ending')
    redis.call('XADD', rk .. ':ev', '*', 'end', 'cancelled', 'reason', why[2] or '', 't', t)
  end
end
