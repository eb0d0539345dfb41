"""The deprecation guard of conftest.py can fail: deprecations our code triggers are caught,
others are not."""

import logging
import warnings

import pytest
from deprecations import OUR_CODE, DeprecationGuard


def deprecated_api():
    warnings.warn("old_api is deprecated", FutureWarning, stacklevel=2)


def logs_deprecation():
    logging.getLogger("transformers.fake").warning("`past_key_values` is deprecated")


def called_from_our_code(function):
    """Run ``function()`` from a frame whose file is inside genlm/backend."""
    code = compile("function()", OUR_CODE + "_caller.py", "exec")
    exec(code, {"function": function})


@pytest.fixture
def guard():
    guard = DeprecationGuard()
    guard.install()
    yield guard
    guard.uninstall()


def test_a_deprecated_call_from_our_code_is_recorded(guard):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        called_from_our_code(deprecated_api)
        called_from_our_code(logs_deprecation)
    assert guard.found == [
        "FutureWarning: old_api is deprecated",
        "transformers.fake: `past_key_values` is deprecated",
    ]


def test_deprecations_not_called_by_our_code_and_our_own_are_not_recorded(guard):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deprecated_api()
        logs_deprecation()
        called_from_our_code(lambda: warnings.warn("ours", UserWarning, stacklevel=2))
        from genlm.backend.trie import TokenCharacterTrie

        TokenCharacterTrie([b"a", b"b"]).mass_sum([0.5, 0.5])  # our own deprecation
    assert guard.found == []


@pytest.mark.slow
def test_the_real_forward_of_our_hf_backend_is_clean(guard, hf_model, smollm2_tokenizer):
    from genlm.backend.llm.hf import AsyncTransformer

    lm = AsyncTransformer(hf_model, smollm2_tokenizer)
    lm.next_token_logprobs_sync(smollm2_tokenizer.encode("Hello there"))
    lm.close()
    assert guard.found == []
