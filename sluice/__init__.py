"""The shared kernel: settings, Redis keys, the model registry, tiers, the admission limiter,
load levels, logging and tenant management.

Every tier (``web``, ``workers``, ``launcher``) imports from here; nothing here imports a tier.
"""
