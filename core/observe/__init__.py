"""What operators see: logging with ids on every line, Prometheus series, the diagnose verdict."""
