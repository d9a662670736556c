import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def shared_cache_dir(tmp_path_factory):
    """One tokenizer/corpus cache for the whole session, so the default tokenizer trains once."""
    path = os.environ.get("TESSERA_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("tessera_cache"))
    os.environ["TESSERA_CACHE_DIR"] = path
    return path
