"""The incremental detokenizer against a whole-output decode, one token at a time: multi-byte characters split over
tokens, spaces, and stop strings that span tokens or start the output."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from omnirun.assets.default_model import default_model_dir
from omnirun.engine.detokenizer import IncrementalDetokenizer, window_decoder

TEXTS = ["Hello world, café — naïve 日本語 ok", "  two  spaces and\nnew lines\n", "🙂 emoji 🙂🙂 end"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_decoding_the_whole(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces), "half a character was emitted"


STOPS = [("Hello world, café", "ld, c", "Hello wor"), ("日本語 ok", "日", "")]


@pytest.mark.parametrize(("text", "stop", "kept"), STOPS)
def test_a_stop_string_is_found_across_tokens_and_at_the_start(tokenizer, text, stop, kept):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, stop=[stop, "never"])
    for token in ids:
        cut = detok.find_stop(len(detok.add([token])))
        if cut >= 0:
            break
    assert detok.text[:cut] == kept


def test_text_that_could_still_begin_a_stop_string_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["abcd"])
    detok.add(tokenizer("Hello world", add_special_tokens=False).input_ids)
    assert detok.stable_length() == len("Hello world") - 3


def test_spaces_that_only_show_between_tokens_survive():
    """SentencePiece-style tokenizers drop the leading space of a decode ('▁world' alone is 'world'): each step must
    decode its new tokens together with the ones before them, or the words run together."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}
    metaspace = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    metaspace.pre_tokenizer, metaspace.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=metaspace, unk_token="<unk>")
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add([t]) for t in (1, 2, 3)) + detok.flush() == "Hello world again"


def test_the_fast_window_decoder_equals_the_tokenizers_decode(tokenizer):
    """Windows are decoded by the Rust backend (transformers' decode costs three times as much per call): on random
    ids, special tokens among them, it must give exactly `decode(ids, skip_special_tokens=True)`."""
    rng = random.Random(0)
    decode = window_decoder(tokenizer)
    assert decode.func == tokenizer.backend_tokenizer.decode  # the fast path is the one under test
    for _ in range(500):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))] + [tokenizer.eos_token_id]
        rng.shuffle(ids)
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode():
    """With clean_up_tokenization_spaces the backend's text is not the tokenizer's ("hello , world" where decode
    gives "hello, world"): such tokenizers decode through transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, ",": 2, "world": 3}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer, wordpiece.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=wordpiece, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add([t]) for t in (1, 2, 3)) + detok.flush()
    assert text == tokenizer.decode([1, 2, 3], skip_special_tokens=True) == "hello, world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_stay_in_the_text_only_when_asked(tokenizer, skip):
    """skip_special_tokens False (a Mistral tool call parser's [TOOL_CALLS] is one) keeps them, as a whole decode
    with the same flag does."""
    ids = tokenizer("a b", add_special_tokens=False).input_ids + [tokenizer.eos_token_id] + tokenizer("c").input_ids
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert (tokenizer.eos_token in text) is (not skip)


def test_llm_texts_follow_skip_special_tokens():
    from omnirun.engine import LLM
    from omnirun.sampling import SamplingParams

    with LLM(device="cpu", dtype="float32", max_total_tokens=4096, progress=False) as llm:
        eos = llm.tokenizer.eos_token_id
        # The EOS token made likely, and not a stop: it lands in the output, and in the text only when kept.
        params = dict(max_new_tokens=6, temperature=0, ignore_eos=True, logit_bias={eos: 100.0})
        kept, skipped = (
            llm.generate(["x"], SamplingParams(**params, skip_special_tokens=s), use_tqdm=False)[0]
            for s in (False, True)
        )
    assert eos in kept.token_ids and llm.tokenizer.eos_token in kept.text
    assert llm.tokenizer.eos_token not in skipped.text
