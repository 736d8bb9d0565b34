"""The OpenAI-compatible front door: chat and completions, Files and Batches routes, their
OpenAPI descriptions. What they mean lives in `core/openai/`."""
