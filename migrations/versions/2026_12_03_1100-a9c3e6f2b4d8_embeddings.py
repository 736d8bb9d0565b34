"""embeddings: their own size class, and their vectors on the row

Revision ID: a9c3e6f2b4d8
Revises: f5a1d8c3e7b2
Create Date: 2026-12-03 11:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'a9c3e6f2b4d8'
down_revision = 'f5a1d8c3e7b2'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # size_class is VARCHAR + CHECK (a new value is a plain migration): embed joins small and large.
    op.drop_constraint(op.f('ck_requests_size_class'), 'requests', type_='check')
    op.create_check_constraint(op.f('ck_requests_size_class'), 'requests', "size_class IN ('small', 'large', 'embed')")
    op.add_column('requests', sa.Column('embedding', sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    op.drop_column('requests', 'embedding')
    op.execute("DELETE FROM requests WHERE size_class = 'embed'")
    op.drop_constraint(op.f('ck_requests_size_class'), 'requests', type_='check')
    op.create_check_constraint(op.f('ck_requests_size_class'), 'requests', "size_class IN ('small', 'large')")
