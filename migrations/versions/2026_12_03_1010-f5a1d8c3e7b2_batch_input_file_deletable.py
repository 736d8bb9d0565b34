"""a batch's input file may be deleted: the batch keeps its id

Revision ID: f5a1d8c3e7b2
Revises: e2b7c4a9d1f6
Create Date: 2026-12-03 10:10:00+00:00
"""
from alembic import op

revision = 'f5a1d8c3e7b2'
down_revision = 'e2b7c4a9d1f6'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # DELETE /v1/files/<id> of a batch's input deleted the batch with it (ON DELETE CASCADE). The
    # batch's lines were read into its job when it was made: it needs the file no more, only its id.
    op.drop_constraint('fk_batches_input_file_id_files', 'batches', type_='foreignkey')


def downgrade() -> None:
    op.execute("DELETE FROM batches WHERE input_file_id NOT IN (SELECT id FROM files)")
    op.create_foreign_key('fk_batches_input_file_id_files', 'batches', 'files', ['input_file_id'], ['id'],
                          ondelete='CASCADE')
