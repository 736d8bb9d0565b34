"""tenant tiers and limits, idempotency keys

Revision ID: 0de3b850ab0f
Revises: 629e27902f1e
Create Date: 2026-11-29 23:53:27.208455+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = '0de3b850ab0f'
down_revision = '629e27902f1e'
branch_labels = None
depends_on = None

LIMIT_COLUMNS = ('tokens_per_minute', 'requests_per_minute', 'max_concurrent', 'max_request_tokens')


def upgrade() -> None:
    op.create_table('idempotency_keys',
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('request_id', sa.Uuid(), nullable=False),
    sa.Column('body_sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['request_id'], ['requests.id'], name=op.f('fk_idempotency_keys_request_id_requests'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_idempotency_keys_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('tenant_id', 'key', name=op.f('pk_idempotency_keys'))
    )
    op.create_index(op.f('ix_idempotency_keys_created_at'), 'idempotency_keys', ['created_at'], unique=False)
    op.create_index(op.f('ix_idempotency_keys_request_id'), 'idempotency_keys', ['request_id'], unique=False)
    op.add_column('tenants', sa.Column('tier', sa.String(length=32), nullable=True))
    for column in LIMIT_COLUMNS:
        op.add_column('tenants', sa.Column(column, sa.Integer(), nullable=True))
        op.create_check_constraint(op.f(f'ck_tenants_{column}_positive'), 'tenants', f'{column} > 0')


def downgrade() -> None:
    for column in reversed(LIMIT_COLUMNS):
        op.drop_constraint(op.f(f'ck_tenants_{column}_positive'), 'tenants', type_='check')
        op.drop_column('tenants', column)
    op.drop_column('tenants', 'tier')
    op.drop_index(op.f('ix_idempotency_keys_request_id'), table_name='idempotency_keys')
    op.drop_index(op.f('ix_idempotency_keys_created_at'), table_name='idempotency_keys')
    op.drop_table('idempotency_keys')
