"""a tenant's reserved share: the fraction of each class's engine time it gets whenever it has work

Fair lines (core/broker/fair.py) weigh a tenant with a reservation so that it gets at least that
share beside the tenants with work; the promise never refuses it for others' work while it stays
inside its share. NULL: no reservation, an equal turn.

Revision ID: a3d8f2c6e9b4
Revises: f7c2a9e4b1d6
Create Date: 2026-12-06 16:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'a3d8f2c6e9b4'
down_revision = 'f7c2a9e4b1d6'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('tenants', sa.Column('reserved_share', sa.Float(), nullable=True))
    op.create_check_constraint(op.f('ck_tenants_reserved_share'), 'tenants',
                               'reserved_share > 0 AND reserved_share < 1')


def downgrade() -> None:
    op.drop_constraint(op.f('ck_tenants_reserved_share'), 'tenants', type_='check')
    op.drop_column('tenants', 'reserved_share')
