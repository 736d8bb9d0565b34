"""Tenants: their management, tiers and limits, and the keys that authenticated a moment ago."""
