"""Usage, cost and budgets: prices (``prices.py``), the usage report (``report.py``), refusals
counted without a row (``refusals.py``), budgets charged at admission and warned of
(``budgets.py``). The rollup tables themselves are kept by Postgres (``models/usage.py``)."""
