"""Shared fixtures. Tests never touch the network: the hub is forced offline before anything imports it."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

SHARED_DATA = Path(os.environ.get("A5_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))
QWEN_DIR = SHARED_DATA / "qwen2.5-math-1.5b"


# Test files whose tests share a module fixture of minutes (the cpu profile's three flows: 8-12 min on 2 cores): run
# first, so that the suite never ends with one worker alone on them. `make test` passes --no-loadscope-reorder, so
# that pytest-xdist keeps this order instead of sending files with few tests, often the long ones, last.
LONG_FILES = ("tests/system/test_cpu_profile.py",)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONG_FILES)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data not found at {SHARED_DATA}; set A5_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN_DIR)


@pytest.fixture
def tiny_model():
    """A 2-layer Qwen2 with a 64-entry vocabulary, random weights, fp32, seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory, shared_data) -> Path:
    """A tiny planted Qwen2 + BPE tokenizer saved for vLLM and transformers alike (see tests/tiny_lm.py)."""
    from tiny_lm import build_tiny_lm

    return build_tiny_lm(tmp_path_factory.mktemp("tiny_lm"), shared_data / "math" / "train.jsonl")


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect API (its own database) for flow tests; started once per session, and stopped with
    this process however it ends (a test run stopped with SIGTERM runs no exit handler)."""
    from prefect.testing.utilities import prefect_test_harness

    from tasks.prefect_server import stop_temporary_server_with_this_process

    stop_temporary_server_with_this_process()

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models are fastest on one thread, two threads crawl when another process holds a core, and
    bitwise comparisons need the same thread count. Modules opt in with ``pytestmark``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def sgd_updates(monkeypatch):
    """The loops' optimizer (``OptimizerSettings.adamw``) steps plain SGD instead, so an update is lr × the
    accumulated gradient and comparing weights compares gradients. AdamW divides each gradient by its own
    magnitude: a weight whose gradient is within rounding of 0 moves by up to lr × rounding / eps, so after
    AdamW two float paths' weights differ by what they round (seen: 2.7e-6 and 7e-6 against atols of 2e-6
    and 5e-6 under other sampled tokens), whatever is compared. The gradient's scale, which AdamW would
    hide, is pinned by the tests' loss and gradient-norm comparisons."""
    from a5core.loops.settings import OptimizerSettings

    monkeypatch.setattr(OptimizerSettings, "adamw", lambda self, params: torch.optim.SGD(params, lr=self.learning_rate))


@pytest.fixture
def learning_rate_0(monkeypatch):
    """The loops' AdamW at learning rate 0, which the settings refuse: the weights never move, so a GRPO run's
    engine holds the policy's weights at every step (the engine mismatch tests)."""
    from a5core.loops.settings import OptimizerSettings

    adamw = OptimizerSettings.adamw

    def frozen(self, params):
        optimizer = adamw(self, params)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        return optimizer

    monkeypatch.setattr(OptimizerSettings, "adamw", frozen)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_lm_dir):
    """The tiny BPE tokenizer of ``tiny_lm_dir``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_lm_dir)


@pytest.fixture(scope="session")
def tokenizer(tiny_tokenizer):
    """The loops' tests' tokenizer: the tiny one (tests/tiny_loops.py builds models over its vocabulary)."""
    return tiny_tokenizer
