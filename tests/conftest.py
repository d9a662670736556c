import os

import pytest

# Inductor compiles C++ kernels in a pool of worker processes, one per core by default; the tests'
# ranks already keep both cores busy, so the pool only adds processes: the inductor compile checks
# took 146 s of CPU with it and 122 s without (2026-11-24). Every launched rank inherits this.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Read before any test module imports torch: Inductor writes its default into the environment
# the first time it looks the folder up.
INDUCTOR_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture(scope="session", autouse=True)
def shared_cache_dir(tmp_path_factory):
    """One tokenizer/corpus cache for the whole session, so the default tokenizer trains once."""
    path = os.environ.get("TESSERA_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("tessera_cache"))
    os.environ["TESSERA_CACHE_DIR"] = path
    return path


@pytest.fixture(scope="session", autouse=True)
def session_inductor_cache(tmp_path_factory):
    """One Inductor cache per run of the suite, shared by its workers: without it every run adds to
    /tmp/torchinductor_$USER, and a machine that ran the suite before compiles from a warm cache,
    so the suite's time there says nothing of a fresh CI machine's."""
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent  # the workers' folders sit side by side in the run's folder
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = INDUCTOR_CACHE_DIR or str(run_dir / "inductor_cache")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with slow tests first, each file's tests together and in their order: run_tests.sh
    hands the files to its two workers in this order, so the many short files come last and fill
    in whichever worker finishes its long launches first."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    first_index = {}
    for index, item in enumerate(items):
        first_index.setdefault(item.path, index)
    items.sort(key=lambda item: (item.path not in slow_files, first_index[item.path]))
