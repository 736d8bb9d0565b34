"""prompt retention

Revision ID: e4a7c2d9b815
Revises: c81e4b7a9f53
Create Date: 2026-11-30 19:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'e4a7c2d9b815'
down_revision = 'c81e4b7a9f53'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('requests', sa.Column('redacted_at', sa.DateTime(timezone=True), nullable=True))
    op.create_index('ix_requests_unredacted_finished_at', 'requests', ['finished_at'], unique=False,
                    postgresql_where=sa.text('redacted_at IS NULL AND finished_at IS NOT NULL'))


def downgrade() -> None:
    op.drop_index('ix_requests_unredacted_finished_at', table_name='requests',
                  postgresql_where=sa.text('redacted_at IS NULL AND finished_at IS NOT NULL'))
    op.drop_column('requests', 'redacted_at')
