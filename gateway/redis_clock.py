"""Redis's own clock, for the gateway's Lua scripts that keep time (rate limits, stored responses' expiry): every
gateway replica runs them against one Redis, and the replicas' clocks differ."""

# Lua that sets `now`: Redis's time in seconds, to the microsecond
REDIS_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
"""
