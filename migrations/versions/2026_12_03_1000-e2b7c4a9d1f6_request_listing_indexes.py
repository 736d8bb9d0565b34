"""indexes for listing a tenant's requests by status and by a metadata pair

Revision ID: e2b7c4a9d1f6
Revises: c8d1e5f7a293
Create Date: 2026-12-03 10:00:00+00:00
"""
from alembic import op

revision = 'e2b7c4a9d1f6'
down_revision = 'c8d1e5f7a293'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # GET /v1/requests?status=…: a tenant's rows of a status, newest first, without walking the
    # rest of its history; metadata[key]=value: containment (@>) through a GIN index.
    op.create_index('ix_requests_tenant_id_status_created_at', 'requests', ['tenant_id', 'status', 'created_at'])
    op.create_index('ix_requests_metadata', 'requests', ['metadata'], postgresql_using='gin',
                    postgresql_ops={'metadata': 'jsonb_path_ops'})


def downgrade() -> None:
    op.drop_index('ix_requests_metadata', table_name='requests')
    op.drop_index('ix_requests_tenant_id_status_created_at', table_name='requests')
