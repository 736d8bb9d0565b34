"""SQLAlchemy models and the session factory."""

from .base import Base, utcnow
from .delivery import Delivery, DeliveryStatus
from .file import Batch, File, FileChunk
from .idempotency import IdempotencyKey
from .job import ItemStatus, Job, JobItem, JobStatus
from .request import InferenceRequest, Priority, SizeClass, Status
from .reservation import Reservation
from .session import Database
from .tenant import ApiKey, Tenant, hash_key, new_key, tenant_for_key

__all__ = ["ApiKey", "Base", "Batch", "Database", "Delivery", "DeliveryStatus", "File", "FileChunk", "IdempotencyKey",
           "InferenceRequest", "ItemStatus", "Job", "JobItem", "JobStatus", "Priority", "Reservation", "SizeClass",
           "Status", "Tenant", "hash_key", "new_key", "tenant_for_key", "utcnow"]
