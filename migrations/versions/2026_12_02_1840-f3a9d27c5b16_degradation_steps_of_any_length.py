"""degradation steps of any length

Revision ID: f3a9d27c5b16
Revises: d2c6f4a8b913
Create Date: 2026-12-02 18:40:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'f3a9d27c5b16'
down_revision = 'd2c6f4a8b913'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The steps that changed a request, comma-separated: light_model,shorter_output then
    # cached_answer is 40 characters, past the 32 this column held (a DataError, a 500, on a
    # retry answered from the cache during an overload). Text: no combination can overflow it.
    op.alter_column('requests', 'degradation_step', type_=sa.Text(), existing_type=sa.String(length=32),
                    existing_nullable=True)


def downgrade() -> None:
    op.alter_column('requests', 'degradation_step', type_=sa.String(length=32), existing_type=sa.Text(),
                    existing_nullable=True, postgresql_using='left(degradation_step, 32)')
