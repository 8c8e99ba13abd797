"""The one run driver: settings, the report, the inference run, ``pp-smoke-run`` and the pytest session."""
