"""W1's character-level tokenizer, built with ``tokenizers`` and wrapped as a
transformers :class:`PreTrainedTokenizerFast`.

Vocabulary (fixed ids, :data:`W1_VOCAB_SIZE` = 17)::

    <pad>=0  <bos>=1  <eos>=2  '0'..'9'=3..12  '+'=13  '-'=14  '='=15  ' '=16

``extra_chars`` appends further single characters after id 16, in order.

Behaviour:

* ``tok(text, add_special_tokens=False)["input_ids"]`` is one id per character
  (spaces included); ``tok(text)`` (special tokens on) prepends ``<bos>``, as
  W1 prompts are fed to the model. ``<eos>`` is never added by encoding.
* ``tok.decode(ids, skip_special_tokens=True)`` returns the exact text: tokens
  are concatenated, no spaces are inserted or cleaned up.
* Unknown characters: the tokenizer has **no unk token**. Calling ``tok`` on
  text with a character outside the vocabulary makes the ``tokenizers``
  library raise its generic ``Exception("WordLevel error: Missing [UNK] token
  ...")``; :func:`encode_text` checks first and raises a ``ValueError`` naming
  the offending characters. Prefer :func:`encode_text` for task text.
* ``tok.save_pretrained(d)`` / ``AutoTokenizer.from_pretrained(d)`` round-trip
  (the reloaded object is the same fast-tokenizer class under transformers 5).
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
W1_CHARS = "0123456789+-= "
W1_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(W1_CHARS)  # 17
MODEL_MAX_LENGTH = 512  # W1 models' max positions


def build_char_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """The W1 character tokenizer, plus ``extra_chars`` at ids 17, 18, ..."""
    chars = W1_CHARS + extra_chars
    dupes = sorted({c for c in chars if chars.count(c) > 1})
    if dupes:
        raise ValueError(
            f"extra_chars {extra_chars!r} repeats characters already in the vocabulary: {dupes}"
        )
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab[c] = len(vocab)

    backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
    # Every character (newline included: (?m) makes '.' match it in Oniguruma) is its own token.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate, no separator
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        # saved as null: reloaded next to a Qwen2 config it would otherwise gain Qwen2's default unk
        unk_token=None,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def encode_text(
    tokenizer: PreTrainedTokenizerFast, text: str, *, add_bos: bool = False, add_eos: bool = False
) -> list[int]:
    """Ids of ``text`` under a character tokenizer, one per character.

    Raises ``ValueError`` listing any character not in the vocabulary (the
    tokenizer has no unk token). Special-token strings such as ``"<eos>"`` in
    ``text`` are not recognised: add them with ``add_bos`` / ``add_eos``.
    """
    vocab = tokenizer.get_vocab()
    unknown = sorted({c for c in text if c not in vocab})
    if unknown:
        raise ValueError(
            f"characters {unknown} of {text!r} are not in the tokenizer's vocabulary "
            f"(pass them as extra_chars to build_char_tokenizer)"
        )
    ids = [vocab[c] for c in text]
    if add_bos:
        ids.insert(0, tokenizer.bos_token_id)
    if add_eos:
        ids.append(tokenizer.eos_token_id)
    return ids
