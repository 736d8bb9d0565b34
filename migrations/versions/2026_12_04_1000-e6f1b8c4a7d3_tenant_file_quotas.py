"""tenant file quota overrides

Per-tenant overrides of SLUICE_FILE_QUOTAS (core/tenants/file_quotas.py); NULL keeps the tier's.

Revision ID: e6f1b8c4a7d3
Revises: d9e3a6b2c5f1
Create Date: 2026-12-04 10:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'e6f1b8c4a7d3'
down_revision = 'd9e3a6b2c5f1'
branch_labels = None
depends_on = None

COLUMNS = (('max_stored_bytes', sa.BigInteger()), ('max_files', sa.Integer()), ('uploads_per_minute', sa.Integer()),
           ('max_concurrent_uploads', sa.Integer()))


def upgrade() -> None:
    for column, kind in COLUMNS:
        op.add_column('tenants', sa.Column(column, kind, nullable=True))
        op.create_check_constraint(op.f(f'ck_tenants_{column}_positive'), 'tenants', f'{column} > 0')


def downgrade() -> None:
    for column, _ in reversed(COLUMNS):
        op.drop_constraint(op.f(f'ck_tenants_{column}_positive'), 'tenants', type_='check')
        op.drop_column('tenants', column)
