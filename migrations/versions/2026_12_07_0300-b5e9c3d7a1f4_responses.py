"""responses: what OpenAI's Responses API names of a request and a request row does not

A response is a request row; this row adds the response it continues (previous_response_id), where
its own input begins among the request's messages and which one its instructions are, whether it
runs in the background, the body's fields the Response object repeats, and when it was deleted.

Revision ID: b5e9c3d7a1f4
Revises: a3d8f2c6e9b4
Create Date: 2026-12-07 03:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = 'b5e9c3d7a1f4'
down_revision = 'a3d8f2c6e9b4'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'responses',
        sa.Column('request_id', sa.Uuid(), nullable=False),
        sa.Column('previous_id', sa.Uuid(), nullable=True),
        sa.Column('turn_from', sa.Integer(), nullable=False),
        sa.Column('instructions_at', sa.Integer(), nullable=True),
        sa.Column('background', sa.Boolean(), nullable=False),
        sa.Column('fields', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['request_id'], ['requests.id'], name=op.f('fk_responses_request_id_requests'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('request_id', name=op.f('pk_responses')),
    )


def downgrade() -> None:
    op.drop_table('responses')
