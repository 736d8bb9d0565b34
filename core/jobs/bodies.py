"""The request bodies of a job item's stage: what the feeder submits for it.

A document line's stage summarises text: the document at depth 0, the joined summaries of the
stage before at depth 1, 2, …: one prompt (instruction, then the text) when it fits one request
with the instruction and the summary, else one per chunk, cut on the model's token boundaries
(``chunk_budget``), the stage then being a map whose summaries are reduced again. An OpenAI
batch line's one request is its body, mapped as the OpenAI front maps a request. Every request
must start before its job's window ends: that is its deadline.
"""

from __future__ import annotations

import uuid
from typing import Any

from core.jobs.params import chunk_budget
from core.openai.shapes import to_native_for
from core.services import Services
from core.tenants.tiers import effective_limits
from models import Tenant
from models.job import Job


class Bodies:
    """The request bodies of an item's stage, for its job and tenant."""

    def __init__(self, svc: Services, left: dict[uuid.UUID, float | None]) -> None:
        self.svc = svc
        self.settings = svc.settings
        self._left = left  # seconds left in each live job's window, refreshed by the feeder every tick

    def stage(self, job: Job, tenant: Tenant, line: int, custom_id: str | None, text_: str | None,
              body: dict[str, Any] | None, depth: int) -> tuple[bool, list[dict[str, Any]]]:
        """(final, request bodies) of an item's stage: an OpenAI line's one request as it is, or the
        summaries of ``text_`` (the document, or the joined summaries of the stage before)."""
        if body is not None:
            return True, [self._openai_body(job, body)]
        final, prompts = self._plan(job, tenant, text_ or "")
        return final, [self._document_body(job, line, custom_id, p, depth, i, len(prompts))
                       for i, p in enumerate(prompts)]

    def _plan(self, job: Job, tenant: Tenant, text_: str) -> tuple[bool, list[str]]:
        """(final, prompts) for summarising ``text_``: one prompt when it fits a request with the
        instruction and the summary, else one per chunk, cut on the model's token boundaries."""
        model = self.settings.registry.get(job.model) or self.settings.registry.default
        counter = self.svc.requests.planner.counters.for_model(model)
        instruction_tokens = counter.count({"prompt": job.instruction})
        limits = effective_limits(self.settings.tiers, self.settings.default_tier, tenant)
        budget = chunk_budget(model.context_tokens, limits.max_request_tokens, instruction_tokens, job.summary_tokens)
        if counter.count({"prompt": text_}) <= budget:
            return True, [_prompt(job, text_)]
        return False, [_prompt(job, piece) for piece in counter.split(text_, budget)]

    def _document_body(self, job: Job, line: int, custom_id: str | None, prompt: str, depth: int, index: int,
                       of: int) -> dict[str, Any]:
        return {"prompt": prompt, "max_tokens": job.summary_tokens, "priority": job.priority,
                "service_tier": job.service_tier, "model": job.model,
                "temperature": 0.0, "deadline_s": self._deadline_s(job),
                "metadata": {"job_id": str(job.id), "line": str(line), "custom_id": custom_id or "",
                             "stage": f"depth {depth}, part {index + 1} of {of}"}}

    def _openai_body(self, job: Job, body: dict[str, Any]) -> dict[str, Any]:
        asked = {name: value for name, value in body.items() if name != "url"}
        _, request = to_native_for(body["url"], asked, batch=True)  # ingest stores every line's url
        if "input" not in request:  # an embeddings line naming no model runs on the embedding model
            request.setdefault("model", job.model)
        request.update(priority=job.priority, service_tier=job.service_tier, deadline_s=self._deadline_s(job),
                       metadata={**request.get("metadata", {}), "job_id": str(job.id)})
        if "max_tokens" in request:
            request["max_tokens"] = min(request["max_tokens"], self.settings.max_output_tokens)
            if request.get("min_tokens", 0) > request["max_tokens"]:
                request["min_tokens"] = request["max_tokens"]
        return request

    def _deadline_s(self, job: Job) -> float:
        """A job's requests must start before its window ends (the request's deadline)."""
        left = self._left.get(job.id)
        return float(job.completion_window_s) if left is None else max(1.0, left)


def _prompt(job: Job, text_: str) -> str:
    return f"{job.instruction}\n\n{text_}"
