"""The prefix index's Lua scripts (cluster/prefix_index.py owns the key schema they follow, documented there).

Each script runs atomically in Redis; `SCRIPTS[name](client, keys, args)` runs one by EVALSHA, falling back to EVAL.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis

# KEYS: epoch, wblk. ARGV: worker, blk key prefix. Returns the new epoch.
_REGISTER = """
local epoch = redis.call('INCR', KEYS[1])
for _, h in ipairs(redis.call('SMEMBERS', KEYS[2])) do redis.call('HDEL', ARGV[2] .. h, ARGV[1]) end
redis.call('DEL', KEYS[2])
return epoch
"""

# KEYS: epoch, wblk. ARGV: worker, epoch, blk key prefix, ttl, #stored, stored hex..., removed hex...
# Returns 1 when written, 0 when the epoch is stale.
_PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
local n = tonumber(ARGV[5])
for i = 6, 5 + n do
  local k = ARGV[3] .. ARGV[i]
  redis.call('HSET', k, ARGV[1], ARGV[2])
  redis.call('EXPIRE', k, ARGV[4])
  redis.call('SADD', KEYS[2], ARGV[i])
end
for i = 6 + n, #ARGV do
  redis.call('HDEL', ARGV[3] .. ARGV[i], ARGV[1])
  redis.call('SREM', KEYS[2], ARGV[i])
end
if n > 0 then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
return 1
"""

# KEYS: epoch, wblk. ARGV: worker, blk key prefix, the caller's epoch. A new epoch (entries dropped), or 0 when a
# newer incarnation registered since (the caller is a zombie and must not take the name back).
_RENEW = """
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) > tonumber(ARGV[3]) then return 0 end
local epoch = redis.call('INCR', KEYS[1])
for _, h in ipairs(redis.call('SMEMBERS', KEYS[2])) do redis.call('HDEL', ARGV[2] .. h, ARGV[1]) end
redis.call('DEL', KEYS[2])
return epoch
"""

# KEYS: epoch, hb, workers. ARGV: worker, epoch, ttl ms, field, value, ... Returns 1 when written, 0 when `epoch`
# is not current (NOTE: a zombie must not overwrite a restarted worker's address), -1 when the epoch key is gone.
# NOTE: fields not in this beat are dropped, so the hash holds exactly what its signature covers (prefix_index.py);
# HSET first: Redis checks maxmemory only before a script's first write (a full Redis must refuse the beat).
_HEARTBEAT = """
local cur = redis.call('GET', KEYS[1])
if not cur then return -1 end
if cur ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
local fields = {}
for i = 4, #ARGV, 2 do fields[ARGV[i]] = true end
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  if not fields[f] then redis.call('HDEL', KEYS[2], f) end
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# KEYS: epoch, wblk, hb. ARGV: worker, epoch, blk key prefix. Returns 1 when purged, 0 when the epoch is stale.
_UNREGISTER = """
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
for _, h in ipairs(redis.call('SMEMBERS', KEYS[2])) do redis.call('HDEL', ARGV[3] .. h, ARGV[1]) end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('INCR', KEYS[1])
return 1
"""

# KEYS: epoch, wblk, hb. ARGV: worker, blk key prefix. Purges whatever epoch is current; returns the blocks dropped.
_PURGE = """
local blocks = redis.call('SMEMBERS', KEYS[2])
for _, h in ipairs(blocks) do redis.call('HDEL', ARGV[2] .. h, ARGV[1]) end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('INCR', KEYS[1])
return #blocks
"""

# KEYS: the blk keys in prompt order. ARGV: prefix. Returns {worker, leading blocks, ...}.
_LOOKUP = """
local p = ARGV[1]
local epochs, live, counts = {}, {}, {}
local active = nil
for i, key in ipairs(KEYS) do
  local flat = redis.call('HGETALL', key)
  local nxt, any = {}, false
  for j = 1, #flat, 2 do
    local w, e = flat[j], flat[j + 1]
    if epochs[w] == nil then
      epochs[w] = redis.call('GET', p .. ':epoch:' .. w)
      live[w] = redis.call('EXISTS', p .. ':hb:' .. w) == 1
    end
    if e ~= epochs[w] then
      redis.call('HDEL', key, w)
    elseif live[w] and (i == 1 or active[w]) then
      nxt[w] = true
      counts[w] = i
      any = true
    end
  end
  if not any then break end
  active = nxt
end
local out = {}
for w, c in pairs(counts) do out[#out + 1] = w; out[#out + 1] = c end
return out
"""


class _Script:
    """A Lua script run by EVALSHA, falling back to EVAL (which also caches it) on NOSCRIPT."""

    def __init__(self, source: str) -> None:
        self.source = source
        # NOTE: the sha is computed here rather than asked of SCRIPT LOAD: the same digest, no round trip.
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: redis.Redis, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:  # a restarted or flushed Redis
            return client.eval(self.source, len(keys), *keys, *args)


SCRIPTS = {name: _Script(src) for name, src in
            (("register", _REGISTER), ("publish", _PUBLISH), ("unregister", _UNREGISTER), ("lookup", _LOOKUP),
             ("purge", _PURGE), ("renew", _RENEW), ("heartbeat", _HEARTBEAT))}
