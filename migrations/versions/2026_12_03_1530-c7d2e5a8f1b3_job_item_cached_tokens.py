"""job items: the prompt tokens the engine's prefix cache held, summed over their requests

A batch's usage (``input_tokens_details.cached_tokens``) sums them, as the rollups do.

Revision ID: c7d2e5a8f1b3
Revises: b4e1c7a9d3f2
Create Date: 2026-12-03 15:30:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'c7d2e5a8f1b3'
down_revision = 'b4e1c7a9d3f2'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default: Postgres adds the column without rewriting the table.
    op.add_column('job_items', sa.Column('cached_tokens', sa.Integer(), server_default='0', nullable=False))


def downgrade() -> None:
    op.drop_column('job_items', 'cached_tokens')
