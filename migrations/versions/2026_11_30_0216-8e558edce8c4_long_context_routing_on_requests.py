"""long-context routing on requests

Revision ID: 8e558edce8c4
Revises: b7d41c2e9a10
Create Date: 2026-11-30 02:16:29+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = '8e558edce8c4'
down_revision = 'b7d41c2e9a10'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('requests', sa.Column('model_routed', sa.String(length=128), nullable=True))
    op.add_column('requests', sa.Column('route_reason', sa.String(length=32), nullable=True))


def downgrade() -> None:
    op.drop_column('requests', 'route_reason')
    op.drop_column('requests', 'model_routed')
