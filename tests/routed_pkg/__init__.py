"""A stand-in for an installed third-party package whose tasks are ``@shared_task``s that
know nothing of celery_lease (``tests/integration/test_routes.py`` leases them by route)."""
