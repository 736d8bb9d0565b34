"""The domain both doors share: the submit pipeline, admission, jobs, delivery, tenants, and the
services container. Imports `models` only; `web/` and `workers/` import it. Importing starts nothing."""
