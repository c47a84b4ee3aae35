from tests.train.conftest import token_dir  # noqa: F401 (a fixture these tests share with tests/train)
