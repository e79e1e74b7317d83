"""``--device {cpu,cuda}``: where tests/test_device.py runs its models (default cpu, on gloo).

    pytest tests/test_device.py --device cuda      # on NCCL and GPUs (what make gpu-check runs)
"""

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", choices=("cpu", "cuda"), default="cpu",
                     help="device of the device-parametrised tests: cpu (gloo) or cuda (NCCL)")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory):
    """One --cache-dir for every test that trains from the command line: the built-in corpus's
    tokenizer and token files are made once per vocabulary size, not once per test file."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    """The ``--device`` asked for; a test that takes it skips when cuda is asked but absent."""
    name = request.config.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda, but torch.cuda.is_available() is False on this machine")
    return name


@pytest.fixture(scope="module")
def transformers():
    """Hugging Face transformers (the tests that need it are skipped without it)."""
    return pytest.importorskip("transformers")
