from torchbay.testing.pytest_fixtures import clean_torchbay_env  # noqa: F401 (autouse: a clean torchbay environment per test)
