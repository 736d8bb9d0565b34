"""api key scopes: what a key may read of its tenant's, and the key that uploaded a file

``api_keys.scope``: ``tenant`` (everything of the tenant: every existing key keeps it, the server
default), ``own`` (only what the key made) or ``submit`` (nothing). ``files.api_key_id`` records
the uploading key, as requests and jobs already do; files uploaded before have none and are seen by
``tenant`` keys only.

Revision ID: d9e3a6b2c5f1
Revises: c7d2e5a8f1b3
Create Date: 2026-12-04 09:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'd9e3a6b2c5f1'
down_revision = 'c7d2e5a8f1b3'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default: Postgres adds the column without rewriting the table.
    op.add_column('api_keys', sa.Column('scope', sa.String(length=16), server_default='tenant', nullable=False))
    op.create_check_constraint(op.f('ck_api_keys_scope'), 'api_keys', "scope IN ('tenant', 'own', 'submit')")
    op.add_column('files', sa.Column('api_key_id', sa.Uuid(), nullable=True))
    op.create_foreign_key(op.f('fk_files_api_key_id_api_keys'), 'files', 'api_keys', ['api_key_id'], ['id'],
                          ondelete='SET NULL')


def downgrade() -> None:
    op.drop_constraint(op.f('fk_files_api_key_id_api_keys'), 'files', type_='foreignkey')
    op.drop_column('files', 'api_key_id')
    op.drop_constraint(op.f('ck_api_keys_scope'), 'api_keys', type_='check')
    op.drop_column('api_keys', 'scope')
