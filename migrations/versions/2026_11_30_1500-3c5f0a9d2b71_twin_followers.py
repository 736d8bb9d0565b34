"""twin followers: a request parked on an identical one in flight

Revision ID: 3c5f0a9d2b71
Revises: 8e558edce8c4
Create Date: 2026-11-30 15:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = '3c5f0a9d2b71'
down_revision = '8e558edce8c4'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('requests', sa.Column('follows_id', sa.Uuid(), nullable=True))
    op.create_index('ix_requests_follows_id', 'requests', ['follows_id'], unique=False,
                    postgresql_where=sa.text('follows_id IS NOT NULL'))


def downgrade() -> None:
    op.drop_index('ix_requests_follows_id', table_name='requests', postgresql_where=sa.text('follows_id IS NOT NULL'))
    op.drop_column('requests', 'follows_id')
