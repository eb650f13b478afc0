"""The synchroniser: request state and step order in Redis, moved by Lua scripts."""
