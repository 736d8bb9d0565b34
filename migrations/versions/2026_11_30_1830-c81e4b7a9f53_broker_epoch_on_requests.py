"""broker epoch on requests

Revision ID: c81e4b7a9f53
Revises: 5d2f8a1c3e47
Create Date: 2026-11-30 18:30:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'c81e4b7a9f53'
down_revision = '5d2f8a1c3e47'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL on rows published before this column: the sweep treats them as an older epoch and
    # publishes the queued ones once more, which is harmless.
    op.add_column('requests', sa.Column('broker_epoch', sa.String(length=32), nullable=True))


def downgrade() -> None:
    op.drop_column('requests', 'broker_epoch')
