"""MNIST from the four original IDX gz files.

`load(data_dir)` reads them from `data_dir`, or downloads them (SHA-256 verified, cached by
`keras.utils.get_file`) when `data_dir` is ''. Every file is validated: magic number (2051 for
images, 2049 for labels), dimensions (28x28 images), byte size against the header, and equal
image and label counts; a bad file raises DataError naming it.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib

import numpy as np

from trainer.errors import DataError

MIRROR = 'https://ossci-datasets.s3.amazonaws.com/mnist/'
FILES = {  # name: (sha256, magic, expected shape; None = any count)
  'train-images-idx3-ubyte.gz': (
    '440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609',
    2051,
    (None, 28, 28),
  ),
  'train-labels-idx1-ubyte.gz': (
    '3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c',
    2049,
    (None,),
  ),
  't10k-images-idx3-ubyte.gz': (
    '8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6',
    2051,
    (None, 28, 28),
  ),
  't10k-labels-idx1-ubyte.gz': (
    'f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6',
    2049,
    (None,),
  ),
}


def read_idx(path: str, magic: int, shape: tuple[int | None, ...]) -> np.ndarray:
  """Reads one gzipped IDX file of unsigned bytes and checks it against `magic` and `shape`."""
  name = os.path.basename(path)
  try:
    with gzip.open(path, 'rb') as f:
      data = f.read()
  except FileNotFoundError:
    raise DataError(f'MNIST file missing: {path}') from None
  except (OSError, EOFError, zlib.error) as e:
    raise DataError(
      f'{path}: not a readable gzip file ({e}); delete it and download again'
    ) from None
  ndim = len(shape)
  header = 4 + 4 * ndim
  if len(data) < header:
    raise DataError(f'{path}: truncated IDX header ({len(data)} bytes)')
  (found,) = struct.unpack('>i', data[:4])
  if found != magic:
    raise DataError(
      f'{path}: magic number {found}, expected {magic} for {name}; is this the right file?'
    )
  dims = struct.unpack(f'>{ndim}i', data[4:header])
  if any(want is not None and got != want for got, want in zip(dims, shape)):
    raise DataError(f'{path}: header says shape {dims}, expected {shape}')
  size = int(np.prod(dims))
  if len(data) - header != size:
    raise DataError(
      f'{path}: truncated or padded: {len(data) - header} data bytes, '
      f'expected {size}; delete it and download again'
    )
  return np.frombuffer(data, np.uint8, offset=header).reshape(dims)


def download(name: str, sha256: str, *, mirror: str = MIRROR, cache_dir: str | None = None):
  """Downloads one file (once; cached under ~/.keras/datasets/mnist-idx), verifying SHA-256."""
  import keras  # only needed to download

  try:
    return keras.utils.get_file(
      name,
      origin=mirror + name,
      file_hash=sha256,
      cache_dir=cache_dir,
      cache_subdir='datasets/mnist-idx',
    )
  except Exception as e:  # urllib's errors, or keras's ValueError for a bad checksum
    raise DataError(
      f'could not download {mirror + name} ({e}); download the four MNIST IDX '
      'files yourself and set config.data.dir to their folder'
    ) from None


def load(data_dir: str = '', **download_args):
  """((x_train, y_train), (x_test, y_test)) as uint8 arrays [N, 28, 28] and [N].

  `download_args` (mirror, cache_dir) go to `download` when `data_dir` is ''.
  """
  if data_dir and not os.path.isdir(data_dir):
    raise DataError(
      f'config.data.dir={data_dir!r} is not a folder; point it at the folder '
      "holding the four MNIST IDX .gz files, or set it to '' to download them"
    )
  arrays, paths = {}, {}
  for name, (sha256, magic, shape) in FILES.items():
    path = os.path.join(data_dir, name) if data_dir else download(name, sha256, **download_args)
    arrays[name], paths[name] = read_idx(path, magic, shape), path
  splits = []
  for prefix in ('train', 't10k'):
    images = arrays[f'{prefix}-images-idx3-ubyte.gz']
    labels = arrays[f'{prefix}-labels-idx1-ubyte.gz']
    if len(images) != len(labels):
      raise DataError(f'{prefix}: {len(images)} images but {len(labels)} labels')
    if not len(images):
      raise DataError(
        f'{paths[f"{prefix}-images-idx3-ubyte.gz"]} holds 0 images; delete it and download again'
      )
    if labels.max() > 9:
      raise DataError(f'{prefix}-labels-idx1-ubyte.gz: label {labels.max()} is not a digit')
    splits.append((images, labels))
  return tuple(splits)
