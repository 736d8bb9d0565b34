"""The web tier's part of waits: telling that a client closed its connection.

What waiting means (holding a request until it ends, abandonment, idle pollers) is
``core/delivery/waits.py``; this module only looks at the socket gunicorn hands the app.
"""

from __future__ import annotations

import select
import socket
import uuid

from flask import request

from core.delivery.waits import abandon, polled, remember_poller
from core.delivery.waits import until_ended as _until_ended
from core.services import Services
from models import InferenceRequest

__all__ = ["abandon", "client_gone", "polled", "remember_poller", "until_ended"]


def client_gone() -> bool:
    """True when the client closed the connection this request came on.

    gunicorn hands the socket to the app (``gunicorn.socket``). A client waiting for an answer
    sends nothing more, so a readable socket that yields no byte has been closed by the peer.
    Without a socket (the Flask test client, another server) nobody can tell: False."""
    sock = request.environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def until_ended(svc: Services, tenant_id: uuid.UUID, row: InferenceRequest, wait_s: float) -> InferenceRequest:
    """``core.delivery.waits.until_ended`` for the client of the current HTTP call."""
    return _until_ended(svc, tenant_id, row, wait_s, gone=client_gone)
