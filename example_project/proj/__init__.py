"""A small Celery project that uses celery_lease on the embedded default (SQLite, no servers)."""
