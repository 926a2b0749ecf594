"""A Django project as django-celery-beat's documentation sets one up, for the row-source tests."""
