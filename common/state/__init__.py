"""The Redis store, by concern: the keys (`keyspace`), the job registry and the quota
(`registry`), the registered jobs a process knows, each decoded once (`admitted`), adapter
version pointers (`pointers`), flow control (`flow`), evaluation tallies (`evals`), tenants
and their keys (`tenants`), the job's audit (`audit`), de-duplication (`dedup`) and the
replicas' presence (`replicas`). `RedisStore` (`store`) holds them as attributes; each part
runs its own Lua scripts.
"""
