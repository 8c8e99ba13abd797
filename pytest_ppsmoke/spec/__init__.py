"""The spec's claims as tests, shipped with the plugin so that users can run them against their
own deployment: ``pytest --pyargs pytest_ppsmoke.spec -m local`` (or ``-m vastai``)."""
