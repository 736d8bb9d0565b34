"""service tiers and windows: the tier on each request, job and usage rollup; what `auto` means per
tenant; a job's estimated finish

A request's tier (priority, default, flex, batch; docs/tiers.md) is kept on its row and is a
dimension of both rollups, so usage, budgets and the CSV can say what each tier cost. Rows and
rollups from before are of their class's plain tier: default for realtime, batch for batch.

Revision ID: f7c2a9e4b1d6
Revises: e6f1b8c4a7d3
Create Date: 2026-12-06 06:00:00+00:00
"""
import sqlalchemy as sa
from alembic import op

revision = 'f7c2a9e4b1d6'
down_revision = 'e6f1b8c4a7d3'
branch_labels = None
depends_on = None

PLAIN_TIER = "CASE WHEN priority = 'batch' THEN 'batch' ELSE 'default' END"
ROLLUPS = (('usage_hourly', ('hour', 'tenant_id', 'api_key_id', 'model', 'priority', 'source')),
           ('usage_outcomes', ('day', 'tenant_id', 'api_key_id', 'model', 'priority', 'source', 'kind', 'code')))

# The rollup trigger's functions (first written by b4e1c7a9d3f2), with the tier among the dimensions.
STATUSES = ('succeeded', 'failed', 'timed_out', 'cancelled', 'expired')
NO_KEY = "'00000000-0000-0000-0000-000000000000'::uuid"


def _rollup_sql(tier: bool) -> tuple[str, str, str]:
    """The ended rows' select and the two upserts, with or without the tier dimension."""
    extra = ", service_tier" if tier else ""
    dims = f"hour, tenant_id, api_key_id, model, priority{extra}, source"
    day_dims = f"day, tenant_id, api_key_id, model, priority{extra}, source"
    ended = f"""
    SELECT (date_trunc('hour', n.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC') AS hour,
           (date_trunc('day', n.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC') AS day, n.tenant_id,
           coalesce(n.api_key_id, {NO_KEY}) AS api_key_id, coalesce(n.model_routed, n.model_requested) AS model,
           n.priority,{' n.service_tier,' if tier else ''} n.source, n.status, n.error_code, n.cache_hit, n.cost,
           CASE WHEN n.output_tokens IS NULL THEN 0 ELSE n.input_tokens END AS input_tokens,
           CASE WHEN n.output_tokens IS NULL THEN 0 ELSE coalesce(n.cached_tokens, 0) END AS cached_tokens,
           coalesce(n.output_tokens, 0) AS output_tokens,
           CASE WHEN n.output_tokens IS NULL OR n.cache_hit THEN 0
                ELSE n.input_tokens + n.output_tokens END AS billed_tokens
    FROM {{source}}
    WHERE n.status NOT IN ('queued', 'running'){{moved}}"""
    hourly = f"""
    INSERT INTO usage_hourly AS u ({dims}, requests, cache_hits, input_tokens, cached_tokens, output_tokens,
                                   billed_tokens, cost, {', '.join(STATUSES)})
    SELECT {dims}, count(*), count(*) FILTER (WHERE cache_hit), sum(input_tokens), sum(cached_tokens),
           sum(output_tokens), sum(billed_tokens), sum(cost),
           {', '.join(f"count(*) FILTER (WHERE status = '{s}')" for s in STATUSES)}
    FROM ended GROUP BY {dims} ORDER BY {dims}
    ON CONFLICT ({dims}) DO UPDATE SET
        requests = u.requests + excluded.requests, cache_hits = u.cache_hits + excluded.cache_hits,
        input_tokens = u.input_tokens + excluded.input_tokens,
        cached_tokens = u.cached_tokens + excluded.cached_tokens,
        output_tokens = u.output_tokens + excluded.output_tokens,
        billed_tokens = u.billed_tokens + excluded.billed_tokens, cost = u.cost + excluded.cost,
        {', '.join(f"{s} = u.{s} + excluded.{s}" for s in STATUSES)}"""
    outcomes = f"""
    INSERT INTO usage_outcomes AS u ({day_dims}, kind, code, count)
    SELECT {day_dims}, 'error', error_code, count(*) FROM ended WHERE error_code IS NOT NULL
    GROUP BY {day_dims}, error_code ORDER BY {day_dims}, error_code
    ON CONFLICT ({day_dims}, kind, code) DO UPDATE SET count = u.count + excluded.count"""
    return ended, hourly, outcomes


def _functions(tier: bool) -> None:
    ended, hourly, outcomes = _rollup_sql(tier)
    for name, source, moved in (('usage_rollup_ended', 'new_rows n JOIN old_rows o USING (id)',
                                 " AND o.status IN ('queued', 'running')"),
                                ('usage_rollup_born', 'new_rows n', '')):
        rows = ended.format(source=source, moved=moved)
        op.execute(f"""
CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Most statements on requests end nothing (an insert, a claim, a stamp): one look, and out.
    IF NOT EXISTS (SELECT 1 FROM new_rows WHERE status NOT IN ('queued', 'running')) THEN
        RETURN NULL;
    END IF;
    WITH ended AS MATERIALIZED ({rows})
    {hourly};
    WITH ended AS MATERIALIZED ({rows})
    {outcomes};
    RETURN NULL;
END $$;""")


def upgrade() -> None:
    op.add_column('requests', sa.Column('service_tier', sa.String(16), server_default='default', nullable=False))
    op.execute(f"UPDATE requests SET service_tier = {PLAIN_TIER} WHERE priority = 'batch'")
    op.create_check_constraint(op.f('ck_requests_service_tier'), 'requests',
                               "service_tier IN ('priority', 'default', 'flex', 'batch')")
    op.add_column('jobs', sa.Column('service_tier', sa.String(16), server_default='batch', nullable=False))
    op.execute("UPDATE jobs SET service_tier = 'default' WHERE priority = 'realtime'")
    op.add_column('jobs', sa.Column('estimated_finish_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('tenants', sa.Column('auto_service_tier', sa.String(16), server_default='default', nullable=False))
    op.create_check_constraint(op.f('ck_tenants_auto_service_tier'), 'tenants',
                               "auto_service_tier IN ('default', 'priority')")
    for table, key in ROLLUPS:
        op.add_column(table, sa.Column('service_tier', sa.String(16), server_default='default', nullable=False))
        op.execute(f"UPDATE {table} SET service_tier = {PLAIN_TIER} WHERE priority = 'batch'")
        op.alter_column(table, 'service_tier', server_default=None)
        op.drop_constraint(f'pk_{table}', table, type_='primary')
        op.create_primary_key(f'pk_{table}', table, [*key[:5], 'service_tier', *key[5:]])
    _functions(tier=True)


def downgrade() -> None:
    _functions(tier=False)
    for table, key in reversed(ROLLUPS):
        # Rows that differ only by tier become one: summed back into their class's row.
        if table == 'usage_hourly':
            sums = ("requests, cache_hits, input_tokens, cached_tokens, output_tokens, billed_tokens, cost, "
                    + ", ".join(STATUSES))
        else:
            sums = "count"
        op.execute(f"""
            CREATE TEMP TABLE folded ON COMMIT DROP AS
            SELECT {', '.join(key)}, {', '.join(f'sum({c}) AS {c}' for c in sums.split(', '))}
            FROM {table} GROUP BY {', '.join(key)}""")
        op.execute(f"DELETE FROM {table}")
        op.drop_constraint(f'pk_{table}', table, type_='primary')
        op.drop_column(table, 'service_tier')
        op.execute(f"INSERT INTO {table} ({', '.join(key)}, {sums}) SELECT {', '.join(key)}, {sums} FROM folded")
        op.execute("DROP TABLE folded")
        op.create_primary_key(f'pk_{table}', table, list(key))
    op.drop_constraint(op.f('ck_tenants_auto_service_tier'), 'tenants', type_='check')
    op.drop_column('tenants', 'auto_service_tier')
    op.drop_column('jobs', 'estimated_finish_at')
    op.drop_column('jobs', 'service_tier')
    op.drop_constraint(op.f('ck_requests_service_tier'), 'requests', type_='check')
    op.drop_column('requests', 'service_tier')
