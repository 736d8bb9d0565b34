"""key revocation and disabled tenants

Revision ID: 5d2f8a1c3e47
Revises: 9a4e6b1c7d20
Create Date: 2026-11-30 18:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = '5d2f8a1c3e47'
down_revision = '9a4e6b1c7d20'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('api_keys', sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('tenants', sa.Column('disabled_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column('tenants', 'disabled_at')
    op.drop_column('api_keys', 'last_used_at')
