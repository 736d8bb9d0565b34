"""The submit pipeline: a body's schema, its plan (caps, tokens, queue), the degradation ladder,
idempotency, the answer cache and in-flight twins, and the request service that runs them."""
