"""every choice of an answer, with its log probabilities

Revision ID: c8d1e5f7a293
Revises: f3a9d27c5b16
Create Date: 2026-12-03 09:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = 'c8d1e5f7a293'
down_revision = 'f3a9d27c5b16'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # n > 1 and logprobs: what output_text (the first choice's text) cannot hold. Nullable, no
    # default: adding it rewrites nothing.
    op.add_column('requests', sa.Column('choices', postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column('requests', 'choices')
