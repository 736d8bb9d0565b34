"""SQLAlchemy models and the session factory."""

from models.base import Base, utcnow
from models.delivery import Delivery, DeliveryStatus
from models.file import Batch, File, FileChunk
from models.idempotency import IdempotencyKey
from models.job import ItemStatus, Job, JobItem, JobStatus
from models.request import InferenceRequest, Priority, ServiceTier, SizeClass, Source, Status
from models.reservation import Reservation
from models.response import StoredResponse
from models.session import Database
from models.tenant import ApiKey, KeyScope, Tenant, hash_key, new_key, tenant_for_key
from models.usage import Budget, UsageHourly, UsageOutcome

__all__ = ["ApiKey", "Base", "Batch", "Budget", "Database", "Delivery", "DeliveryStatus", "File", "FileChunk",
           "IdempotencyKey", "InferenceRequest", "ItemStatus", "Job", "JobItem", "JobStatus", "KeyScope", "Priority",
           "Reservation", "ServiceTier", "SizeClass", "Source", "Status", "StoredResponse", "Tenant", "UsageHourly",
           "UsageOutcome", "hash_key", "new_key", "tenant_for_key", "utcnow"]
