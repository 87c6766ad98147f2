"""data.py's CLIP tokenizer against open_clip's SimpleTokenizer (issue 15 item 1).

The expected ids are in tests/fixtures/clip_token_ids.json, made once with open_clip 3.3.0 and
ftfy 6.3.1 by `python tests/fixtures/make_clip_token_ids.py` (its docstring has the install
command); OpenAI's BPE merges (`bpe_simple_vocab_16e6.txt.gz`, MIT, as shipped in open_clip) are
committed beside it, so CI checks the ids without open_clip installed."""
import html
import json
import os

import pytest

import data

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
VOCAB = os.path.join(FIXTURES, "bpe_simple_vocab_16e6.txt.gz")
SOT, EOT = 49406, 49407

# open_clip's own special-token spellings are matched inside caption text, so there a caption
# gets an SOT/EOT id mid-sequence (and argmax pooling stops at it); data.py never reads a special
# token from text. These are the only fixture strings whose ids differ, by design.
SPECIAL_TOKEN_TEXT = {"<end_of_text>", "a <start_of_text> b"}


@pytest.fixture(scope="module")
def cases():
    with open(os.path.join(FIXTURES, "clip_token_ids.json"), encoding="utf-8") as f:
        return json.load(f)["cases"]


@pytest.fixture(scope="module")
def tokenizer():
    return data.clip_bpe_tokenizer(VOCAB)


def _ids(tokenizer, texts) -> list:
    rows = []
    for row in tokenizer(texts).tolist():
        while row[-1] == 0:     # padding; id 0 is also "!", so only the trailing run is cut
            row.pop()
        rows.append(row)
    return rows


def _differing(tokenizer, cases) -> set:
    got = _ids(tokenizer, [c["text"] for c in cases])
    return {c["text"] for c, ids in zip(cases, got) if ids != c["ids"]}


def test_fixture_covers_the_tricky_kinds(cases):
    texts = [c["text"] for c in cases]
    assert len(texts) >= 100
    for needle in ["&amp;", "&#233;", "’", "ﬁ", "Ａ", "Ã©", "\x07", "ΟΔΟΣ", "🐱", "<|endoftext|>"]:
        assert any(needle in t for t in texts), needle
    assert "" in texts and max(len(c["ids"]) for c in cases) == 77


def test_ids_equal_open_clip(tokenizer, cases):
    assert _differing(tokenizer, cases) == SPECIAL_TOKEN_TEXT


def test_special_token_text_is_plain_text(tokenizer):
    for text in sorted(SPECIAL_TOKEN_TEXT) + ["<|endoftext|>", "x<|startoftext|>y"]:
        ids = _ids(tokenizer, [text])[0]
        assert ids[0] == SOT and ids[-1] == EOT and SOT not in ids[1:] and EOT not in ids[:-1], text


def test_truncation_keeps_eot_and_empty_text(tokenizer):
    long_ids, empty_ids = _ids(tokenizer, ["word " * 200, ""])
    assert len(long_ids) == 77 and long_ids[-1] == EOT
    assert empty_ids == [SOT, EOT]


# OpenAI's basic_clean + whitespace_clean (open_clip's simple_tokenizer.py), the reference
def reference_clean(text):
    import ftfy
    return " ".join(html.unescape(html.unescape(ftfy.fix_text(text))).strip().split()).lower()


@pytest.mark.parametrize("raw, clean", [
    ("Fish &amp;amp; Chips", "fish & chips"),          # ftfy unescapes once, OpenAI twice more
    ("It’s “OK”", "it's \"ok\""),
    ("ﬁne ＦＵＬＬ　ｗｉｄｔｈ", "fine full width"),
    ("cafÃ© itâ€™s", "café it's"),
    ("Ã©tÃ© Ã  Paris", "été à paris"),
    ("ðŸ˜€ smile", "😀 smile"),
    ("ΟΔΟΣ ΣΑΣ", "οδος σας"),                           # final sigma, as Python's str.lower
    ("a\x00b\x07c\x1b[31md\u2028e\r\nf", "abcd e f"),
    ("cafe\u0301", "caf\u00e9"),                        # NFC
    ("<b>&amp;</b>", "<b>&</b>"),                       # ftfy leaves entities next to '<'
])
def test_clip_clean_is_openai_basic_clean(raw, clean):
    assert data.clip_clean(raw) == clean == reference_clean(raw)


def test_ids_equal_live_open_clip(tokenizer, cases):
    from conftest import import_open_clip
    import_open_clip()          # skips when absent; installs the torchvision import hook
    from open_clip.tokenizer import SimpleTokenizer
    texts = [c["text"] for c in cases if c["text"] not in SPECIAL_TOKEN_TEXT]
    assert tokenizer(texts).tolist() == SimpleTokenizer(VOCAB)(texts).tolist()


def test_clip_clean_shortcut_for_plain_ascii_changes_nothing(cases):
    """Printable ASCII without '&' skips fix_text and unescaping: the full path gives the same."""
    texts = [c["text"] for c in cases] + ["A Dog < a Cat > 3", "x;y 'quoted' \"double\"", "~!@#$%^*()_+`"]
    assert [data.clip_clean(t) for t in texts] == [reference_clean(t) for t in texts]


def test_tokenizer_files_saved_before_get_the_same_ids(tokenizer, cases, tmp_path):
    """A tokenizer.json written before the cleaning (NFC + Rust lower-case normalizer, a word
    regex and added tokens that matched "<|endoftext|>" in text) loads with today's pipeline."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    old = data._special_tokens_not_in_text(tokenizer.backend)      # a copy to age
    old = type(old).from_str(old.to_str())
    old.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Strip(), normalizers.Lowercase()])
    pattern = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
    old.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="removed", invert=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    old.add_special_tokens([data.SOT_TOKEN, data.EOT_TOKEN])
    assert old.encode("a <|endoftext|>", add_special_tokens=False).ids[-1] == EOT      # the old behaviour
    (tmp_path / "tokenizer.json").write_text(json.dumps({"kind": "clip_bpe", "context_length": 77,
                                                         "tokenizer": json.loads(old.to_str())}))
    loaded = data.Tokenizer.load(str(tmp_path))
    assert _differing(loaded, cases) == SPECIAL_TOKEN_TEXT


def test_trained_bpe_reads_special_token_text_as_text():
    tok = data.trained_bpe_tokenizer(data.shapes_captions(200), vocab_size=300, context_length=40)
    ids = tok(["a red <|endoftext|> circle <pad> <|startoftext|>"])[0].tolist()
    n = ids.index(tok.eot_id) + 1
    assert ids[0] == tok.sot_id and tok.sot_id not in ids[1:n] and n > 10 and 0 not in ids[:n]
    assert all(i == 0 for i in ids[n:])


def test_surrogates_are_replaced_never_raised(tokenizer):
    got = _ids(tokenizer, ["a\ud800b", "x\ud83d\ude00y", "\udfff"])
    assert got == _ids(tokenizer, ["a\ufffdb", "x😀y", "\ufffd"])


def test_contractions_are_case_insensitive_as_open_clip():
    """open_clip compiles its word pattern with re.IGNORECASE, so "'ſ" (long s) is one piece, as
    "'s". Against Python's `regex` module with IGNORECASE (open_clip's), over every character
    after an apostrophe: the case-insensitive contractions remove exactly the long-s mismatch;
    the few left are letters the two engines' Unicode tables differ on (U+0558, U+0C5C, ...)."""
    pre = data._clip_normalizer_and_pretokenizer()[1]
    assert [w for w, _ in pre.pre_tokenize_str("king'ſ")][:2] == ["king", "'Å¿"]     # byte-level 'ſ
    regex = pytest.importorskip("regex")
    from tokenizers import Regex, pre_tokenizers
    words = r"""[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
    reference = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d|""" + words, regex.IGNORECASE)

    def mismatches(contractions):
        split = pre_tokenizers.Split(Regex(contractions + "|" + words), behavior="removed", invert=True)
        texts = {c: f"a'{chr(c).lower()}e'{chr(c).lower() * 2}" for c in range(0x20, 0x3000) if chr(c).isprintable()}
        return {c for c, t in texts.items() if [w for w, _ in split.pre_tokenize_str(t)] != reference.findall(t)}
    before = mismatches(r"""'s|'t|'re|'ve|'m|'ll|'d""")
    assert 0x17F in before and mismatches(r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)""") == before - {0x17F}


def test_own_strings_equal_live_open_clip(tokenizer):
    from conftest import import_open_clip
    import_open_clip()
    from open_clip.tokenizer import SimpleTokenizer
    texts = ["CAFÉ… OUVERT", "« café\u00a0»", "Ã©tÃ© â€” CAFÃ‰â€¦", "Ð¿Ñ€Ð¸Ð²ÐµÑ‚",
             "king'ſ", "IT'S", "a\ud800b",
             "x\ud83d\ude00y"]
    assert tokenizer(texts).tolist() == SimpleTokenizer(VOCAB)(texts).tolist()
