"""request deadline

Revision ID: b7d41c2e9a10
Revises: 0de3b850ab0f
Create Date: 2026-11-30 00:01:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'b7d41c2e9a10'
down_revision = '0de3b850ab0f'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('requests', sa.Column('deadline_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column('requests', 'deadline_at')
