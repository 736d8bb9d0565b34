"""Bulk jobs: intake (a JSONL upload into job items), the feeder that moves items onto the
queues, their stages (map-reduce), settlement, and reading progress and results."""
