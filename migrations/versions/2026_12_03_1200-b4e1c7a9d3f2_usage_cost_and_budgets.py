"""usage, cost and budgets: prices and cost on the row, hourly rollups kept by a trigger, budgets, keys for people

Revision ID: b4e1c7a9d3f2
Revises: a9c3e6f2b4d8
Create Date: 2026-12-03 12:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'b4e1c7a9d3f2'
down_revision = 'a9c3e6f2b4d8'
branch_labels = None
depends_on = None

# A request's cost: its prices (per million tokens, fixed on the row at admission) times the tokens
# the engine reported; nothing for an answer no engine computed for it (a cache hit, a twin) or
# for one that never ran. numeric throughout: sums are exact to the last decimal.
COST = ("CASE WHEN cache_hit OR output_tokens IS NULL THEN 0 ELSE round(("
        "greatest(input_tokens - coalesce(cached_tokens, 0), 0) * price_input"
        " + coalesce(cached_tokens, 0) * price_cached + output_tokens * price_output) / 1000000, 10) END")

DIMENSIONS = "hour, tenant_id, api_key_id, model, priority, source"
# Error codes and refusals are kept per day: a month of them stays a few thousand rows to read.
DAY_DIMENSIONS = "day, tenant_id, api_key_id, model, priority, source"
NO_KEY = "'00000000-0000-0000-0000-000000000000'::uuid"

# The rows of a statement that reached a terminal status, with their rollup dimensions, from the
# transition tables the trigger defines: the statement's new rows (new_rows), joined to their old ones
# for an UPDATE (a move from queued or running), alone for an INSERT (a row born ended).
ENDED = f"""
    SELECT (date_trunc('hour', n.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC') AS hour,
           (date_trunc('day', n.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC') AS day, n.tenant_id,
           coalesce(n.api_key_id, {NO_KEY}) AS api_key_id, coalesce(n.model_routed, n.model_requested) AS model,
           n.priority, n.source, n.status, n.error_code, n.cache_hit, n.cost,
           CASE WHEN n.output_tokens IS NULL THEN 0 ELSE n.input_tokens END AS input_tokens,
           CASE WHEN n.output_tokens IS NULL THEN 0 ELSE coalesce(n.cached_tokens, 0) END AS cached_tokens,
           coalesce(n.output_tokens, 0) AS output_tokens,
           CASE WHEN n.output_tokens IS NULL OR n.cache_hit THEN 0
                ELSE n.input_tokens + n.output_tokens END AS billed_tokens
    FROM {{source}}
    WHERE n.status NOT IN ('queued', 'running'){{moved}}"""

# Upserts in the dimensions' order: two statements ending rows of the same rollups lock them in
# one order, so they queue behind each other instead of deadlocking.
STATUSES = ('succeeded', 'failed', 'timed_out', 'cancelled', 'expired')
ROLLUP = f"""
    INSERT INTO usage_hourly AS u ({DIMENSIONS}, requests, cache_hits, input_tokens, cached_tokens, output_tokens,
                                   billed_tokens, cost, {', '.join(STATUSES)})
    SELECT {DIMENSIONS}, count(*), count(*) FILTER (WHERE cache_hit), sum(input_tokens), sum(cached_tokens),
           sum(output_tokens), sum(billed_tokens), sum(cost),
           {', '.join(f"count(*) FILTER (WHERE status = '{s}')" for s in STATUSES)}
    FROM ended GROUP BY {DIMENSIONS} ORDER BY {DIMENSIONS}
    ON CONFLICT ({DIMENSIONS}) DO UPDATE SET
        requests = u.requests + excluded.requests, cache_hits = u.cache_hits + excluded.cache_hits,
        input_tokens = u.input_tokens + excluded.input_tokens,
        cached_tokens = u.cached_tokens + excluded.cached_tokens,
        output_tokens = u.output_tokens + excluded.output_tokens,
        billed_tokens = u.billed_tokens + excluded.billed_tokens, cost = u.cost + excluded.cost,
        {', '.join(f"{s} = u.{s} + excluded.{s}" for s in STATUSES)};
    INSERT INTO usage_outcomes AS u ({DAY_DIMENSIONS}, kind, code, count)
    SELECT {DAY_DIMENSIONS}, 'error', error_code, count(*) FROM ended WHERE error_code IS NOT NULL
    GROUP BY {DAY_DIMENSIONS}, error_code ORDER BY {DAY_DIMENSIONS}, error_code
    ON CONFLICT ({DAY_DIMENSIONS}, kind, code) DO UPDATE SET count = u.count + excluded.count;"""


def _function(name: str, source: str, moved: str) -> str:
    ended = ENDED.format(source=source, moved=moved)
    return f"""
CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Most statements on requests end nothing (an insert, a claim, a stamp): one look, and out.
    IF NOT EXISTS (SELECT 1 FROM new_rows WHERE status NOT IN ('queued', 'running')) THEN
        RETURN NULL;
    END IF;
    WITH ended AS MATERIALIZED ({ended})
    {ROLLUP.split(';')[0]};
    WITH ended AS MATERIALIZED ({ended})
    {ROLLUP.split(';')[1]};
    RETURN NULL;
END $$;"""


def upgrade() -> None:
    op.add_column('api_keys', sa.Column('name', sa.String(100), nullable=True))
    op.add_column('api_keys', sa.Column('owner', sa.String(200), nullable=True))
    op.add_column('api_keys', sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('jobs', sa.Column('api_key_id', sa.Uuid(), nullable=True))
    op.create_foreign_key(op.f('fk_jobs_api_key_id_api_keys'), 'jobs', 'api_keys', ['api_key_id'], ['id'],
                          ondelete='SET NULL')

    op.add_column('requests', sa.Column('api_key_id', sa.Uuid(), nullable=True))
    op.create_foreign_key(op.f('fk_requests_api_key_id_api_keys'), 'requests', 'api_keys', ['api_key_id'],
                          ['id'], ondelete='SET NULL')
    op.add_column('requests', sa.Column('source', sa.String(16), server_default='api', nullable=False))
    op.create_check_constraint(op.f('ck_requests_source'), 'requests', "source IN ('api', 'openai', 'job')")
    for column in ('price_input', 'price_cached', 'price_output'):
        op.add_column('requests', sa.Column(column, sa.Numeric(12, 4), server_default='0', nullable=False))
    op.add_column('requests', sa.Column('cost', sa.Numeric(24, 10), sa.Computed(COST, persisted=True),
                                        nullable=False))

    def dimensions(time: str) -> list[sa.Column]:
        return [sa.Column(time, sa.DateTime(timezone=True), nullable=False),
                sa.Column('tenant_id', sa.Uuid(), nullable=False),
                sa.Column('api_key_id', sa.Uuid(), nullable=False),
                sa.Column('model', sa.String(128), nullable=False),
                sa.Column('priority', sa.String(16), nullable=False),
                sa.Column('source', sa.String(16), nullable=False)]
    op.create_table(
        'usage_hourly', *dimensions('hour'),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_usage_hourly_tenant_id_tenants'),
                                ondelete='CASCADE'),
        *(sa.Column(c, sa.BigInteger(), nullable=False) for c in
          ('requests', 'cache_hits', 'input_tokens', 'cached_tokens', 'output_tokens', 'billed_tokens')),
        sa.Column('cost', sa.Numeric(24, 10), nullable=False),
        *(sa.Column(c, sa.BigInteger(), server_default='0', nullable=False) for c in STATUSES),
        sa.PrimaryKeyConstraint('hour', 'tenant_id', 'api_key_id', 'model', 'priority', 'source',
                                name=op.f('pk_usage_hourly')))
    op.create_index('ix_usage_hourly_tenant_id_hour', 'usage_hourly', ['tenant_id', 'hour'])
    op.create_table(
        'usage_outcomes', *dimensions('day'),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_usage_outcomes_tenant_id_tenants'),
                                ondelete='CASCADE'),
        sa.Column('kind', sa.String(16), nullable=False),  # error | refusal
        sa.Column('code', sa.String(64), nullable=False),
        sa.Column('count', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('day', 'tenant_id', 'api_key_id', 'model', 'priority', 'source', 'kind', 'code',
                                name=op.f('pk_usage_outcomes')))
    op.create_index('ix_usage_outcomes_tenant_id_day', 'usage_outcomes', ['tenant_id', 'day'])

    op.create_table(
        'budgets',
        sa.Column('id', sa.Uuid(), nullable=False),
        sa.Column('tenant_id', sa.Uuid(), nullable=False),
        sa.Column('api_key_id', sa.Uuid(), nullable=True),
        sa.Column('unit', sa.String(8), nullable=False),
        sa.Column('amount', sa.Numeric(24, 10), nullable=False),
        sa.Column('period', sa.String(8), nullable=False),
        sa.Column('starts_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('ends_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('hard', sa.Boolean(), nullable=False),
        sa.Column('webhook_url', sa.Text(), nullable=True),
        sa.Column('notified_window', sa.DateTime(timezone=True), nullable=True),
        sa.Column('notified_percent', sa.Integer(), server_default='0', nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_budgets')),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_budgets_tenant_id_tenants'),
                                ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], name=op.f('fk_budgets_api_key_id_api_keys'),
                                ondelete='CASCADE'),
        sa.CheckConstraint("unit IN ('tokens', 'usd')", name=op.f('ck_budgets_unit')),
        sa.CheckConstraint("period IN ('day', 'week', 'month', 'fixed')", name=op.f('ck_budgets_period')),
        sa.CheckConstraint('amount > 0', name=op.f('ck_budgets_amount_positive')),
        sa.CheckConstraint("(period = 'fixed') = (starts_at IS NOT NULL AND ends_at IS NOT NULL AND ends_at > starts_at)",
                           name=op.f('ck_budgets_fixed_window')))
    op.create_index('ix_budgets_tenant_id', 'budgets', ['tenant_id'])

    # A budget's threshold webhooks are deliveries of neither a request nor a job.
    op.add_column('webhook_deliveries', sa.Column('budget_id', sa.Uuid(), nullable=True))
    op.create_foreign_key(op.f('fk_webhook_deliveries_budget_id_budgets'), 'webhook_deliveries', 'budgets',
                          ['budget_id'], ['id'], ondelete='CASCADE')
    op.drop_constraint(op.f('ck_webhook_deliveries_one_subject'), 'webhook_deliveries', type_='check')
    op.create_check_constraint(op.f('ck_webhook_deliveries_one_subject'), 'webhook_deliveries',
                               'num_nonnulls(request_id, job_id, budget_id) = 1')

    op.execute(_function('usage_rollup_ended', 'new_rows n JOIN old_rows o USING (id)',
                         " AND o.status IN ('queued', 'running')"))
    op.execute(_function('usage_rollup_born', 'new_rows n', ''))
    op.execute("CREATE TRIGGER usage_rollup_ended AFTER UPDATE ON requests REFERENCING OLD TABLE AS old_rows "
               "NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION usage_rollup_ended()")
    op.execute("CREATE TRIGGER usage_rollup_born AFTER INSERT ON requests REFERENCING NEW TABLE AS new_rows "
               "FOR EACH STATEMENT EXECUTE FUNCTION usage_rollup_born()")
    # Rows that ended before this revision: their rollups at the prices they had (none: zero cost).
    op.execute(f"""
        WITH ended AS MATERIALIZED ({ENDED.format(source='requests n', moved='')})
        {ROLLUP.split(';')[0]}""")
    op.execute(f"""
        WITH ended AS MATERIALIZED ({ENDED.format(source='requests n', moved='')})
        {ROLLUP.split(';')[1]}""")


def downgrade() -> None:
    op.execute("DROP TRIGGER usage_rollup_born ON requests")
    op.execute("DROP TRIGGER usage_rollup_ended ON requests")
    op.execute("DROP FUNCTION usage_rollup_born()")
    op.execute("DROP FUNCTION usage_rollup_ended()")
    op.execute('DELETE FROM webhook_deliveries WHERE budget_id IS NOT NULL')
    op.drop_constraint(op.f('ck_webhook_deliveries_one_subject'), 'webhook_deliveries', type_='check')
    op.create_check_constraint(op.f('ck_webhook_deliveries_one_subject'), 'webhook_deliveries',
                               'num_nonnulls(request_id, job_id) = 1')
    op.drop_constraint(op.f('fk_webhook_deliveries_budget_id_budgets'), 'webhook_deliveries', type_='foreignkey')
    op.drop_column('webhook_deliveries', 'budget_id')
    op.drop_table('budgets')
    op.drop_table('usage_outcomes')
    op.drop_table('usage_hourly')
    op.drop_column('requests', 'cost')
    for column in ('price_output', 'price_cached', 'price_input'):
        op.drop_column('requests', column)
    op.drop_constraint(op.f('ck_requests_source'), 'requests', type_='check')
    op.drop_column('requests', 'source')
    op.drop_constraint(op.f('fk_requests_api_key_id_api_keys'), 'requests', type_='foreignkey')
    op.drop_column('requests', 'api_key_id')
    op.drop_constraint(op.f('fk_jobs_api_key_id_api_keys'), 'jobs', type_='foreignkey')
    op.drop_column('jobs', 'api_key_id')
    for column in ('expires_at', 'owner', 'name'):
        op.drop_column('api_keys', column)
