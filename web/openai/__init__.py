"""The OpenAI-compatible front door: chat and completions, Responses, Files and Batches routes, their
OpenAPI descriptions. What they mean lives in `core/openai/`.

Every OpenAI blueprint answers errors in OpenAI's shape: the one handler set of ``errors.py`` is
registered here, on each of them."""

from web.openai import batches_api, chat, errors, responses_api

BLUEPRINTS = (chat.bp, batches_api.bp, responses_api.bp)
errors.register(*BLUEPRINTS)
