"""Data: tokenizers, document sources and prepared token files (see docs/data.md)."""

from farsight.data.corpora import HuggingFaceSource, JsonlSource, LocalTextSource, StdlibSource, resolve_source
from farsight.data.documents import CorpusError, Document, Source
from farsight.data.shakespeare import ShakespeareSource, download_shakespeare
from farsight.data.token_files import TokenDataError, TokenFile, load_meta, load_token_dataset, prepare_corpus
from farsight.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    tokenizer_from_spec,
    train_bpe_tokenizer,
)

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "CorpusError",
    "Document",
    "GPT2Tokenizer",
    "HuggingFaceSource",
    "JsonlSource",
    "LocalTextSource",
    "ShakespeareSource",
    "Source",
    "StdlibSource",
    "TokenDataError",
    "TokenFile",
    "Tokenizer",
    "TokenizerError",
    "download_shakespeare",
    "load_meta",
    "load_token_dataset",
    "load_tokenizer",
    "prepare_corpus",
    "resolve_source",
    "tokenizer_from_spec",
    "train_bpe_tokenizer",
]
