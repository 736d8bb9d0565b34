"""What a model's tokens cost: USD per million input, cached input and output tokens.

Prices come from the registry (``SLUICE_MODELS``: ``"prices": {"input": 0.15, "cached": 0.075,
"output": 0.6}``) or ``SLUICE_PRICES`` (``model=input/cached/output,…``, which wins), and may be
an internal chargeback rate as well as a list price. A model with none costs nothing. Each service
tier pays a multiple of them (docs/tiers.md): ``SLUICE_SERVICE_TIER_PRICES``
(``priority=2,default=1,flex=0.5``; batch pays ``1 − SLUICE_BATCH_DISCOUNT`` unless it is named
there), which a model's ``service_tiers`` in the registry overrides tier by tier.

A request's prices are fixed on its row when it is admitted (``Plan.row``); Postgres works out
its cost from them when its tokens are written (``models/request.py COST_SQL``), so changing a
price never rewrites a past cost.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import NamedTuple

# The row keeps prices to 4 decimals (numeric(12, 4)): a hundredth of a cent per million tokens.
QUANTUM = Decimal("0.0001")
MAX_PRICE = Decimal("99999999")


class Price(NamedTuple):
    """USD per million tokens."""

    input: Decimal
    cached: Decimal
    output: Decimal

    def times(self, multiplier: Decimal) -> Price:
        return Price(*((p * multiplier).quantize(QUANTUM, ROUND_HALF_UP) for p in self))

    def cost(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> Decimal:
        """The cost of these tokens, as ``COST_SQL`` works it out for a row."""
        uncached = max(input_tokens - cached_tokens, 0)
        return ((uncached * self.input + cached_tokens * self.cached + output_tokens * self.output)
                / 1_000_000).quantize(Decimal("1e-10"), ROUND_HALF_UP)


FREE = Price(Decimal(0), Decimal(0), Decimal(0))


def _number(value: object, what: str, most: Decimal, kind: str) -> Decimal:
    """A number from 0 to ``most`` from configuration (``kind`` says what of); ValueError otherwise."""
    try:
        number = Decimal(str(value))
    except InvalidOperation:
        raise ValueError(f"{what} must be a number{kind}, got {value!r}") from None
    if isinstance(value, bool) or not number.is_finite() or not 0 <= number <= most:
        raise ValueError(f"{what} must be a number from 0 to {most}, got {value!r}")
    return number


def _entries(spec: str):
    """A comma-separated setting's ``name=value`` entries: (the entry, its name, its value), stripped."""
    for entry in (e.strip() for e in spec.split(",")):
        if entry:
            name, _, value = entry.partition("=")
            yield entry, name.strip(), value.strip()


def price(value: object, what: str) -> Decimal:
    """One price from configuration: a number ≥ 0 with at most 4 decimals; ValueError otherwise."""
    number = _number(value, what, MAX_PRICE, " of USD per million tokens")
    if number != number.quantize(QUANTUM):
        raise ValueError(f"{what} has more than 4 decimals: {value!r}")
    return number


def parse_prices(spec: str) -> dict[str, Price]:
    """``SLUICE_PRICES``: ``model=input/cached/output`` entries, comma-separated."""
    prices = {}
    for entry, name, values in _entries(spec):
        parts = values.split("/")
        if not name or len(parts) != 3:
            raise ValueError(f"{entry!r} is not model=input/cached/output")
        prices[name] = Price(*(price(p.strip(), f"{name}'s {kind} price")
                               for p, kind in zip(parts, ("input", "cached", "output"), strict=True)))
    return prices


TIERS = ("priority", "default", "flex", "batch")
MAX_MULTIPLIER = Decimal(100)


def multiplier(value: object, what: str) -> Decimal:
    """A tier's price multiplier from configuration: a number from 0 to 100; ValueError otherwise."""
    return _number(value, what, MAX_MULTIPLIER, " (a multiple of the model's prices)")


def parse_tier_multipliers(spec: str) -> dict[str, Decimal]:
    """``SLUICE_SERVICE_TIER_PRICES``: ``tier=multiplier`` entries, comma-separated."""
    found = {}
    for entry, tier, value in _entries(spec):
        if tier not in TIERS or not value:
            raise ValueError(f"{entry!r} is not tier=multiplier with a tier among {', '.join(TIERS)}")
        found[tier] = multiplier(value, f"the {tier} tier's multiplier")
    return found


def price_for(prices: dict[str, Price], multipliers: dict[str, Decimal], model: str, tier: str) -> Price:
    """The prices a request to ``model`` served at ``tier`` is charged: its model's prices times the
    tier's multiplier (``multipliers``: the model's own, else the platform's)."""
    found = prices.get(model, FREE)
    times = multipliers.get(tier, Decimal(1))
    return found if times == 1 else found.times(times)
