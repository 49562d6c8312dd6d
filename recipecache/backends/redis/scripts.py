"""The Lua scripts of the Redis backend: every write and delete of an entry, and the lease primitives, each one atomic step.

Every write and delete of an entry is one script that also deletes the chunks of the
manifest it replaces or removes, so no GET-then-DEL race deletes a newer entry and no
chunks are orphaned. The scripts parse manifests themselves (the Lua twin of
:class:`.manifest.Manifest`): a damaged old value is overwritten or deleted, never an error.
Leases are ``SET NX PX`` (in a script that takes over a key there that is no lease: another
type, or no expiry) plus compare-and-renew / compare-and-delete; the release wakes the
holder's waiters in the same step.
"""

from __future__ import annotations

from .manifest import MANIFEST_PEEK, MANIFEST_V1, MAX_CHUNK_SIZE, MAX_CHUNKS, MAX_VALUE

#: what the publishing scripts answer when a chunk of the manifest they would publish is gone
CHUNKS_GONE = -1

# The Lua twin of Manifest.parse: the chunk keys a stored value names if it is a valid
# manifest (either format), else none. Shared by every script that replaces or removes an
# entry, so the chunks of what it replaces go in the same atomic step. Every such script
# gets the entry as KEYS[1] and its chunk prefix (``KeyNames.name("c", key)``, same hash slot) as KEYS[2].
_LUA_CHUNKS = f"""
local function chunk_keys(prefix, value)
  if type(value) ~= 'string' then return {{}} end
  local gen, count, total, size
  if string.sub(value, 1, 5) == 'RCM2:' then
    gen, count, total, size = string.match(value, '^RCM2:([0-9a-f]+):([0-9]+):([0-9]+):([0-9]+)$')
    if not gen or #gen ~= 16 or #count > 9 or #total > 15 or #size > 12 then return {{}} end
    count, total, size = tonumber(count), tonumber(total), tonumber(size)
    if size < 1 or size > {MAX_CHUNK_SIZE} or total < 1 or total > {MAX_VALUE}
       or count ~= math.floor((total + size - 1) / size) then return {{}} end
  elseif string.sub(value, 1, 4) == 'RCM1' and #value == {MANIFEST_V1.size + 16} then
    count, total = struct.unpack('>I4I8', string.sub(value, 5, {MANIFEST_V1.size}))
    gen = string.sub(value, {MANIFEST_V1.size + 1})
    if not string.match(gen, '^[0-9a-f]+$') or total < count or total > {MAX_VALUE} then return {{}} end
  else
    return {{}}
  end
  if count < 1 or count > {MAX_CHUNKS} then return {{}} end
  local keys = {{}}
  local base = prefix .. ':' .. gen .. ':'
  for i = 0, count - 1 do keys[#keys + 1] = base .. i end
  return keys
end
local function delete_keys(keys)
  for i = 1, #keys, 1000 do
    redis.call('del', unpack(keys, i, math.min(i + 999, #keys)))
  end
end
local function store(key, value, ttl)
  if ttl == '' then redis.call('set', key, value) else redis.call('set', key, value, 'PX', ttl) end
end
-- The chunks of a manifest about to be published take the entry's expiry (none: PERSIST),
-- all or none: false, and nothing changed, if one is gone (expired, evicted or removed).
local function adopt(keys, ttl)
  for i = 1, #keys do
    if redis.call('pttl', keys[i]) == -2 then return false end
  end
  for i = 1, #keys do
    if ttl == '' then redis.call('persist', keys[i]) else redis.call('pexpire', keys[i], ttl) end
  end
  return true
end
"""
# Publish ARGV[1] (ttl ARGV[2]); delete the chunks of the manifest it replaces. A key of
# another type gives an error reply from the pcall'd GETRANGE, and SET replaces it.
SWAP = (
    _LUA_CHUNKS
    + f"""
if not adopt(chunk_keys(KEYS[2], ARGV[1]), ARGV[2]) then return {CHUNKS_GONE} end
local old = redis.pcall('getrange', KEYS[1], 0, {MANIFEST_PEEK - 1})
store(KEYS[1], ARGV[1], ARGV[2])
delete_keys(chunk_keys(KEYS[2], old))
return 1
"""
)
DELETE = (
    _LUA_CHUNKS
    + f"""
local old = redis.pcall('getrange', KEYS[1], 0, {MANIFEST_PEEK - 1})
redis.call('del', KEYS[1])
delete_keys(chunk_keys(KEYS[2], old))
return 1
"""
)
# Apply a write only if the entry is still as the caller read it: ARGV[1] is 'absent',
# 'wrongtype' or 'value' (then ARGV[2] is the stored form: inline value or manifest);
# ARGV[3] 'set' (ARGV[4] the new stored form, ARGV[5] the ttl) or 'del'.
COMPARE_AND_WRITE = (
    _LUA_CHUNKS
    + f"""
local cur = redis.pcall('get', KEYS[1])
local state = 'value'
if cur == false then state = 'absent' elseif type(cur) == 'table' then state = 'wrongtype' end
if state ~= ARGV[1] or (state == 'value' and cur ~= ARGV[2]) then return 0 end
if ARGV[3] == 'set' then
  if not adopt(chunk_keys(KEYS[2], ARGV[4]), ARGV[5]) then return {CHUNKS_GONE} end
  store(KEYS[1], ARGV[4], ARGV[5])
else
  redis.call('del', KEYS[1])
end
delete_keys(chunk_keys(KEYS[2], cur))
return 1
"""
)
RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
# Take lease KEYS[1] for ARGV[1], expiring after ARGV[2] ms, if nobody holds it. A key there
# that is no lease is taken over as if it had expired: one of another Redis type, or a
# string without expiry (PTTL -1), which would never expire and keep every waiter waiting.
LEASE_ADD = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if type(redis.pcall('get', KEYS[1])) == 'table' or redis.call('pttl', KEYS[1]) == -1 then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# Delete the lease if ARGV[1] holds it, and wake its waiters: one element on its wake
# list KEYS[2], which expires after ARGV[2] ms (waiters rotate it, never empty it).
RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('del', KEYS[1])
  redis.call('rpush', KEYS[2], '1')
  redis.call('pexpire', KEYS[2], ARGV[2])
  return 1
end
return 0
"""
