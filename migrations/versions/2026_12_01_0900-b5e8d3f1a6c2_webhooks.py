"""webhooks: webhook fields on requests and jobs, tenants' signing secrets, deliveries

Revision ID: b5e8d3f1a6c2
Revises: a7b3c9e1d2f4
Create Date: 2026-12-01 09:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = 'b5e8d3f1a6c2'
down_revision = 'a7b3c9e1d2f4'
branch_labels = None
depends_on = None

STATUSES = ('pending', 'succeeded', 'failed')


def upgrade() -> None:
    for table in ('requests', 'jobs'):
        op.add_column(table, sa.Column('webhook_url', sa.Text(), nullable=True))
        op.add_column(table, sa.Column('webhook_events', postgresql.ARRAY(sa.String(length=16)), nullable=True))
    op.add_column('tenants', sa.Column('webhook_secret', sa.String(length=64), nullable=True))
    op.add_column('tenants', sa.Column('webhook_previous_secret', sa.String(length=64), nullable=True))
    op.add_column('tenants', sa.Column('webhook_previous_until', sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        'webhook_deliveries',
        sa.Column('id', sa.Uuid(), nullable=False),
        sa.Column('tenant_id', sa.Uuid(), nullable=False),
        sa.Column('request_id', sa.Uuid(), nullable=True),
        sa.Column('job_id', sa.Uuid(), nullable=True),
        sa.Column('event', sa.String(length=32), nullable=False),
        sa.Column('url', sa.Text(), nullable=False),
        sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column('status', sa.Enum(*STATUSES, name='delivery_status', native_enum=False, create_constraint=True,
                                    length=16), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('last_status_code', sa.Integer(), nullable=True),
        sa.Column('last_error', sa.String(length=500), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('next_attempt_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('retry_until', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint('num_nonnulls(request_id, job_id) = 1', name=op.f('ck_webhook_deliveries_one_subject')),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_webhook_deliveries_tenant_id_tenants'),
                                ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['request_id'], ['requests.id'],
                                name=op.f('fk_webhook_deliveries_request_id_requests'), ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_webhook_deliveries_job_id_jobs'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_deliveries')),
    )
    op.create_index('ix_webhook_deliveries_tenant_id_created_at', 'webhook_deliveries', ['tenant_id', 'created_at'])
    op.create_index('ix_webhook_deliveries_pending', 'webhook_deliveries', ['next_attempt_at'],
                    postgresql_where=sa.text("status = 'pending'"))
    op.create_index('uq_webhook_deliveries_request_id_event', 'webhook_deliveries', ['request_id', 'event'],
                    unique=True, postgresql_where=sa.text('request_id IS NOT NULL'))
    op.create_index('uq_webhook_deliveries_job_id_event', 'webhook_deliveries', ['job_id', 'event'], unique=True,
                    postgresql_where=sa.text("job_id IS NOT NULL AND event <> 'job.progress'"))
    op.create_index('ix_webhook_deliveries_job_id_created_at', 'webhook_deliveries', ['job_id', 'created_at'],
                    postgresql_where=sa.text('job_id IS NOT NULL'))


def downgrade() -> None:
    op.drop_table('webhook_deliveries')
    op.drop_column('tenants', 'webhook_previous_until')
    op.drop_column('tenants', 'webhook_previous_secret')
    op.drop_column('tenants', 'webhook_secret')
    for table in ('jobs', 'requests'):
        op.drop_column(table, 'webhook_events')
        op.drop_column(table, 'webhook_url')
