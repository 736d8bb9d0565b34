"""bulk jobs

Revision ID: a7b3c9e1d2f4
Revises: e4a7c2d9b815
Create Date: 2026-11-30 21:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = 'a7b3c9e1d2f4'
down_revision = 'e4a7c2d9b815'
branch_labels = None
depends_on = None

JOB_STATUSES = ('validating', 'in_progress', 'finalizing', 'completed', 'failed', 'cancelling', 'cancelled',
                'expired')
ITEM_STATUSES = ('pending', 'running', 'succeeded', 'failed', 'cancelled', 'expired', 'invalid')
LIVE = "status IN ('validating', 'in_progress', 'finalizing', 'cancelling')"


def upgrade() -> None:
    op.add_column('tenants', sa.Column('batch_weight', sa.Float(), server_default='1', nullable=False))
    op.create_check_constraint(op.f('ck_tenants_batch_weight_positive'), 'tenants', 'batch_weight > 0')
    op.create_table(
        'jobs',
        sa.Column('id', sa.Uuid(), nullable=False),
        sa.Column('tenant_id', sa.Uuid(), nullable=False),
        sa.Column('status', sa.Enum(*JOB_STATUSES, name='job_status', native_enum=False, create_constraint=True,
                                    length=16), nullable=False),
        sa.Column('model', sa.String(length=128), nullable=False),
        sa.Column('priority', sa.String(length=16), nullable=False),
        sa.Column('instruction', sa.Text(), nullable=False),
        sa.Column('summary_tokens', sa.Integer(), nullable=False),
        sa.Column('completion_window_s', sa.Integer(), nullable=False),
        sa.Column('metadata', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column('total_items', sa.Integer(), nullable=False),
        sa.Column('invalid_lines', sa.Integer(), nullable=False),
        sa.Column('input_bytes', sa.BigInteger(), nullable=False),
        sa.Column('estimated_tokens', sa.BigInteger(), nullable=False),
        sa.Column('error_code', sa.String(length=64), nullable=True),
        sa.Column('error_message', sa.String(length=500), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('cancel_requested_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('redacted_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_jobs_tenant_id_tenants'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs')),
    )
    op.create_index('ix_jobs_tenant_id_created_at', 'jobs', ['tenant_id', 'created_at'], unique=False)
    op.create_index('ix_jobs_live', 'jobs', ['status'], unique=False, postgresql_where=sa.text(LIVE))
    op.create_table(
        'job_items',
        sa.Column('job_id', sa.Uuid(), nullable=False),
        sa.Column('line', sa.Integer(), nullable=False),
        sa.Column('custom_id', sa.Text(), nullable=True),
        sa.Column('status', sa.Enum(*ITEM_STATUSES, name='item_status', native_enum=False, create_constraint=True,
                                    length=16), nullable=False),
        sa.Column('text', sa.Text(), nullable=True),
        sa.Column('body', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column('estimated_tokens', sa.Integer(), nullable=False),
        sa.Column('chunks', sa.Integer(), nullable=False),
        sa.Column('depth', sa.Integer(), nullable=False),
        sa.Column('final', sa.Boolean(), nullable=False),
        sa.Column('requests', postgresql.ARRAY(sa.UUID()), nullable=False),
        sa.Column('request_count', sa.Integer(), nullable=False),
        sa.Column('input_tokens', sa.Integer(), nullable=False),
        sa.Column('output_tokens', sa.Integer(), nullable=False),
        sa.Column('result', sa.Text(), nullable=True),
        sa.Column('finish_reason', sa.String(length=16), nullable=True),
        sa.Column('error_code', sa.String(length=64), nullable=True),
        sa.Column('error_message', sa.String(length=500), nullable=True),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_items_job_id_jobs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id', 'line', name=op.f('pk_job_items')),
    )
    op.create_index('ix_job_items_pending', 'job_items', ['job_id', 'line'], unique=False,
                    postgresql_where=sa.text("status = 'pending'"))
    op.create_index('ix_job_items_running', 'job_items', ['job_id'], unique=False,
                    postgresql_where=sa.text("status = 'running'"))
    # Documents are written in bulk: lz4 compresses them several times faster than the default
    # pglz (a 256 MB upload spends most of its time there). A server built without lz4 keeps pglz.
    op.execute("""
        DO $$ BEGIN
            ALTER TABLE job_items ALTER COLUMN text SET COMPRESSION lz4;
        EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN NULL;
        END $$""")


def downgrade() -> None:
    op.drop_index('ix_job_items_running', table_name='job_items', postgresql_where=sa.text("status = 'running'"))
    op.drop_index('ix_job_items_pending', table_name='job_items', postgresql_where=sa.text("status = 'pending'"))
    op.drop_table('job_items')
    op.drop_index('ix_jobs_live', table_name='jobs', postgresql_where=sa.text(LIVE))
    op.drop_index('ix_jobs_tenant_id_created_at', table_name='jobs')
    op.drop_table('jobs')
    op.drop_constraint(op.f('ck_tenants_batch_weight_positive'), 'tenants', type_='check')
    op.drop_column('tenants', 'batch_weight')
