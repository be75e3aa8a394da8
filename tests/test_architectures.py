"""The one table of target architectures per stage, and its one-line refusals."""

from types import SimpleNamespace

import pytest

from eagle_train.architectures import ARCHITECTURES, check_supported, supported
from eagle_train.draft_config import DraftConfig


def target(model_type: str):
    return SimpleNamespace(model_type=model_type)


def test_training_takes_every_listed_type_and_the_runtime_the_dense_rope_ones():
    assert supported("training") == sorted(ARCHITECTURES)
    assert supported("runtime") == ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_a_head_trains_for_a_moe_target_and_the_runtime_refuses_it_in_one_line_with_the_reason(model_type):
    check_supported(target(model_type), "training")
    with pytest.raises(ValueError, match=r"runtime does not take .*mixture-of-experts.*--engine vllm") as err:
        check_supported(target(model_type), "runtime")
    assert "\n" not in str(err.value)


def test_an_unknown_type_is_refused_by_training_naming_the_known_ones():
    config = SimpleNamespace(text_config=target("gemma3"))
    with pytest.raises(ValueError, match=r"training a draft head does not take target model_type 'gemma3'.*llama"):
        check_supported(config, "training")
    with pytest.raises(ValueError, match="does not take target model_type 'gemma3'"):
        DraftConfig.from_target_config(config)
