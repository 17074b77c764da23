"""What the router and both worker pools share: worker messages and typed vocabulary (roles, heartbeat load), the
worker base (engine + loop + prefix-index publishing), the Redis key schema, the Redis client and request-id logs.

Imports `engine` and `kv_transfer` only; the pools and the router import it; `pdcluster` (the application) sits on top.
"""
