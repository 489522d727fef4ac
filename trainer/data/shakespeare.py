"""Tiny Shakespeare (1,115,394 characters, 65 distinct) for character-level language models.

`load(data_dir)` reads `input.txt` from `data_dir`, or downloads it (SHA-256 verified, cached by
`keras.utils.get_file`) when `data_dir` is ''. `Corpus.from_text` maps characters to ids (the
sorted set of characters of the whole text) and splits the ids: the last `val_fraction` of the
characters is the validation split.
"""

from __future__ import annotations

import hashlib
import os
from typing import NamedTuple

import numpy as np
from absl import logging

from trainer.errors import DataError

URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
SHA256 = '86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed'
FILE = 'input.txt'


def _path(data_dir: str) -> str:
  if data_dir:
    if not os.path.isdir(data_dir):
      raise DataError(
        f'config.data.dir={data_dir!r} is not a folder; point it at the folder '
        f"holding Tiny Shakespeare's {FILE}, or set it to '' to download it"
      )
    return os.path.join(data_dir, FILE)
  import keras  # only needed to download

  return keras.utils.get_file(
    'tinyshakespeare.txt', origin=URL, file_hash=SHA256, cache_subdir='datasets'
  )


def load(data_dir: str = '') -> str:
  """The text. A local file with another checksum is accepted (your own corpus) with a warning."""
  path = _path(data_dir)
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except FileNotFoundError:
    raise DataError(f'Tiny Shakespeare file missing: {path}') from None
  try:
    text = raw.decode('utf-8')
  except UnicodeDecodeError as e:
    raise DataError(f'{path}: not UTF-8 text ({e})') from None
  if len(text) < 1000:
    raise DataError(f'{path}: only {len(text)} characters; a language model needs more text')
  if hashlib.sha256(raw).hexdigest() != SHA256:
    logging.warning(
      '%s is not the original Tiny Shakespeare (SHA-256 differs); training on it anyway', path
    )
  return text


class Corpus(NamedTuple):
  vocab: str  # the characters, sorted; id i is vocab[i]
  train: np.ndarray  # int32 ids, the first (1 - val_fraction) of the text
  val: np.ndarray  # int32 ids, the last val_fraction of the text

  @classmethod
  def from_text(cls, text: str, val_fraction: float = 0.1) -> Corpus:
    if not 0 < val_fraction < 1:
      raise ValueError(f'val_fraction must be in (0, 1), got {val_fraction}')
    vocab = ''.join(sorted(set(text)))
    lookup = np.zeros(max(map(ord, vocab)) + 1, np.int32)
    lookup[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)
    ids = lookup[np.frombuffer(text.encode('utf-32-le'), np.uint32)]
    split = len(ids) - int(round(len(ids) * val_fraction))
    return cls(vocab=vocab, train=ids[:split], val=ids[split:])

  def encode(self, text: str) -> np.ndarray:
    unknown = sorted(set(text) - set(self.vocab))
    if unknown:
      raise DataError(f'characters {"".join(unknown)!r} are not in the vocabulary')
    index = {c: i for i, c in enumerate(self.vocab)}
    return np.array([index[c] for c in text], np.int32)

  def decode(self, ids) -> str:
    return ''.join(self.vocab[int(i)] for i in ids)
