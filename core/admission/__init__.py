"""Admission: the token-priced gates (global promise → tenant → request), the Redis limiter and its
Lua, the load counters and levels the gates read, and the local floor when Redis is away."""
