"""The platform's processes as Redis sees them: live workers from their heartbeats, and the lease
that keeps one copy of a platform-wide loop (the monitor, the feeder) active."""
