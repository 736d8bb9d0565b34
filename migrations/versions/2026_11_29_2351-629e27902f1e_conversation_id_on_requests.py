"""conversation id on requests

Revision ID: 629e27902f1e
Revises: 4e0212d69095
Create Date: 2026-11-29 23:51:56.261264+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = '629e27902f1e'
down_revision = '4e0212d69095'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('requests', sa.Column('conversation_id', sa.String(length=128), nullable=True))


def downgrade() -> None:
    op.drop_column('requests', 'conversation_id')
