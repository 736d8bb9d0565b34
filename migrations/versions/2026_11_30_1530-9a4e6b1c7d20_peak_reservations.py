"""peak reservations

Revision ID: 9a4e6b1c7d20
Revises: 3c5f0a9d2b71
Create Date: 2026-11-30 15:30:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = '9a4e6b1c7d20'
down_revision = '3c5f0a9d2b71'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'reservations',
        sa.Column('id', sa.Uuid(), nullable=False),
        sa.Column('starts_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('ends_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('role', sa.String(length=32), nullable=True),
        sa.Column('note', sa.String(length=200), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('cancelled_at', sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint('ends_at > starts_at', name=op.f('ck_reservations_window_not_empty')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_reservations')),
    )
    op.create_index(op.f('ix_reservations_ends_at'), 'reservations', ['ends_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_reservations_ends_at'), table_name='reservations')
    op.drop_table('reservations')
