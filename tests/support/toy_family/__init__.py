"""A toy model family, written as a user adding a fourth family would: copied into ``src/bigbatch/models/toy`` and
registered with one line by ``tests/integration/test_family_extension.py`` (relative imports, so it works there)."""
