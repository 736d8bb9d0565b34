"""openai files and batches: uploaded files in compressed chunks, and the batch side of a job

Revision ID: d2c6f4a8b913
Revises: b5e8d3f1a6c2
Create Date: 2026-12-01 10:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'd2c6f4a8b913'
down_revision = 'b5e8d3f1a6c2'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'files',
        sa.Column('id', sa.Uuid(), nullable=False),
        sa.Column('tenant_id', sa.Uuid(), nullable=False),
        sa.Column('purpose', sa.String(length=32), nullable=False),
        sa.Column('filename', sa.Text(), nullable=False),
        sa.Column('bytes', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_files_tenant_id_tenants'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_files')),
    )
    op.create_index('ix_files_tenant_id_created_at', 'files', ['tenant_id', 'created_at'])
    op.create_table(
        'file_chunks',
        sa.Column('file_id', sa.Uuid(), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=False),
        sa.Column('data', sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(['file_id'], ['files.id'], name=op.f('fk_file_chunks_file_id_files'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('file_id', 'seq', name=op.f('pk_file_chunks')),
    )
    # zlib already compressed each chunk: Postgres need not try again.
    op.execute('ALTER TABLE file_chunks ALTER COLUMN data SET STORAGE EXTERNAL')
    op.create_table(
        'batches',
        sa.Column('job_id', sa.Uuid(), nullable=False),
        sa.Column('input_file_id', sa.Uuid(), nullable=False),
        sa.Column('endpoint', sa.String(length=32), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_batches_job_id_jobs'), ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['input_file_id'], ['files.id'], name=op.f('fk_batches_input_file_id_files'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id', name=op.f('pk_batches')),
    )
    op.create_index(op.f('ix_batches_input_file_id'), 'batches', ['input_file_id'])


def downgrade() -> None:
    op.drop_index(op.f('ix_batches_input_file_id'), table_name='batches')
    op.drop_table('batches')
    op.drop_table('file_chunks')
    op.drop_index('ix_files_tenant_id_created_at', table_name='files')
    op.drop_table('files')
