"""trainer/data/ready.py: a ready Datasets from NumPy arrays (the real MNIST files), a folder of
PNGs per class written here, and a TensorFlow Datasets builder prepared here (no download)."""

import gc
import os
import types
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from tiny import tiny_config
from trainer import Datasets, Trainer
from trainer.data import checks, mnist, ready
from trainer.errors import DataError


def labels_of(dataset, batches):
  return np.concatenate([y.numpy() for _, y in dataset.take(batches)])


def test_from_arrays_on_mnist(mnist_dir):
  (x, y), (xt, yt) = mnist.load(mnist_dir)
  x, y, xt, yt = x[:1000], y[:1000], xt[:300], yt[:300].reshape(-1, 1)  # a [N, 1] column too
  config = tiny_config(**{'train.batch_size': 64})
  data = ready.from_arrays(config, train=(x, y), eval=(xt, yt))
  assert data.train_examples == 1000
  images, labels = next(iter(data.train))
  assert images.shape == (64, 28, 28) and images.dtype == tf.float32
  assert labels.shape == (64,) and labels.dtype == tf.int32
  assert 0.0 <= float(tf.reduce_min(images)) and float(tf.reduce_max(images)) <= 1.0
  # Eval: every example once, remainder kept (300 = 4 x 64 + 44), in order.
  sizes = [int(b[1].shape[0]) for b in data.eval]
  assert sizes == [64, 64, 64, 64, 44]
  np.testing.assert_array_equal(labels_of(data.eval, 5), yt.reshape(-1))
  # Shuffled with the seed: the same order for the same seed, another for another seed; all
  # examples in each epoch (15 batches of 64 = 960 of the 1000).
  # (Fresh datasets: each new iterator over one dataset is a new epoch, in a new order.)
  first, again = (ready.from_arrays(config, train=(x, y), eval=(xt, yt)) for _ in range(2))
  epoch = labels_of(first.train, 15)
  np.testing.assert_array_equal(epoch, labels_of(again.train, 15))
  assert np.bincount(epoch, minlength=10).tolist() != np.bincount(
    y[:960], minlength=10
  ).tolist() or not np.array_equal(epoch, y[:960])  # not the file order
  other = ready.from_arrays(
    tiny_config(**{'train.batch_size': 64, 'seed': 1}), train=(x, y), eval=(xt, yt)
  )
  assert not np.array_equal(epoch, labels_of(other.train, 15))
  assert (
    data.train.options().experimental_distribute.auto_shard_policy
    == tf.data.experimental.AutoShardPolicy.DATA
  )
  with pytest.raises(DataError, match='from_arrays: train has 1000 examples but 999 labels'):
    ready.from_arrays(config, train=(x, y[:999]), eval=(xt, yt))


def write_pngs(root, classes=('cat', 'dog', 'frog'), per_class=8, size=(10, 12)):
  rng = np.random.default_rng(0)
  for c, name in enumerate(classes):
    os.makedirs(root / name)
    for i in range(per_class):
      pixels = np.full(size + (3,), 80 * c, np.uint8) + rng.integers(
        0, 20, size + (3,), dtype=np.uint8
      )
      (root / name / f'{i}.png').write_bytes(tf.io.encode_png(pixels).numpy())


class FolderTrainer(Trainer):
  """A typical model whose build_datasets is one call."""

  def build_datasets(self):
    return ready.from_image_folder(
      self.config,
      self.config.data.dir,
      image_size=(10, 12),
      eval_fraction=0.25,
      color_mode='grayscale',
    )

  def build_model(self):
    return keras.Sequential(
      [
        keras.Input((10, 12, 1)),
        keras.layers.Conv2D(4, 3),
        keras.layers.Flatten(),
        keras.layers.Dense(3, dtype='float32'),
      ]
    )

  def compute_loss(self, batch, *, training):
    images, labels = batch
    logits = tf.cast(self.model(images, training=training), tf.float32)
    loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    return loss, {
      'accuracy': tf.cast(tf.argmax(logits, -1, output_type=tf.int32) == labels, tf.float32)
    }


def test_from_image_folder(tmp_path):
  write_pngs(tmp_path / 'train')
  write_pngs(tmp_path / 'test', per_class=3)
  config = tiny_config(**{'train.batch_size': 4})
  data = ready.from_image_folder(
    config, str(tmp_path / 'train'), image_size=(10, 12), eval_directory=str(tmp_path / 'test')
  )
  assert data.train_examples == 24
  images, labels = next(iter(data.train))
  assert images.shape == (4, 10, 12, 3) and images.dtype == tf.float32
  assert float(tf.reduce_max(images)) <= 1.0
  # Labels are the sorted class folders; class c's pixels are about 80 * c / 255.
  means = tf.reduce_mean(images, axis=[1, 2, 3]).numpy()
  np.testing.assert_allclose(means, 80 * labels.numpy() / 255 + 9.5 / 255, atol=0.01)
  eval_labels = labels_of(data.eval, 10)
  np.testing.assert_array_equal(np.sort(eval_labels), [0, 0, 0, 1, 1, 1, 2, 2, 2])

  # eval_fraction: 6 of the 24 images held out, and a Trainer built on it trains.
  trainer = FolderTrainer(
    tiny_config(
      **{
        'data.dir': str(tmp_path / 'train'),
        'model': 'folder',
        'train.batch_size': 4,
        'train.steps': 10,
      }
    ),
    str(tmp_path / 'work'),
  )
  assert trainer.datasets.train_examples == 18
  assert sum(int(b[1].shape[0]) for b in trainer.datasets.eval) == 6
  assert trainer.train()['loss'] > 0
  with pytest.raises(DataError, match='either eval_directory or eval_fraction'):
    ready.from_image_folder(config, str(tmp_path / 'train'), image_size=(10, 12))


def test_the_first_eval_batch_is_read_once_by_an_iterator_kept_with_the_dataset():
  """The contract check reads the eval set's first batch once, from an iterator that lives as
  long as the dataset. A dropped iterator that had read part of a `.cache()` with a prefetch
  after it could finalize the cache truncated on a loaded machine (test_from_image_folder below
  then saw 5 of its 6 eval images)."""
  ds = tf.data.Dataset.range(10).batch(4).cache().prefetch(2)
  data = Datasets(train=ds, eval=ds, train_examples=10)
  first = checks.first_eval_batch(data)
  np.testing.assert_array_equal(first, [0, 1, 2, 3])
  assert checks.first_eval_batch(data) is first  # not read again
  assert sorted(np.concatenate([b.numpy() for b in ds])) == list(range(10))
  gone = weakref.ref(ds)
  del data, ds
  gc.collect()
  assert gone() is None  # the kept batch and iterator do not keep the dataset alive


def test_an_eval_set_that_takes_no_attributes_is_read_again_each_time():
  """The first eval batch is kept as an attribute of the dataset; an eval set that takes none
  (a class with __slots__, a C extension type) still gives its first batch, read anew at each
  call instead of failing."""

  class NoAttributes:
    __slots__ = ('reads',)

    def __init__(self):
      self.reads = 0

    def __iter__(self):
      self.reads += 1
      return iter([tf.constant([self.reads]), tf.constant([-1])])

  data = types.SimpleNamespace(eval=NoAttributes())
  np.testing.assert_array_equal(checks.first_eval_batch(data), [1])
  np.testing.assert_array_equal(checks.first_eval_batch(data), [2])  # not kept: read again


def test_from_tfds_on_a_locally_built_dataset(tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  from etils import epath

  class TinyShapes(tfds.core.GeneratorBasedBuilder):
    """12 train and 5 test 8x8 grayscale images in 2 classes, generated: no download."""

    VERSION = tfds.core.Version('1.0.0')
    pkg_dir_path = epath.Path(str(tmp_path))  # its metadata folder (tests/ is no package)

    def _info(self):
      return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict(
          {
            'image': tfds.features.Image(shape=(8, 8, 1)),
            'label': tfds.features.ClassLabel(num_classes=2),
          }
        ),
        supervised_keys=('image', 'label'),
      )

    def _split_generators(self, dl_manager):
      return {'train': self._generate_examples(12), 'test': self._generate_examples(5)}

    def _generate_examples(self, n):
      for i in range(n):
        yield i, {'image': np.full((8, 8, 1), 200 * (i % 2), np.uint8), 'label': i % 2}

  data_dir = str(tmp_path / 'tfds')
  TinyShapes(data_dir=data_dir).download_and_prepare()
  config = tiny_config(**{'train.batch_size': 4})
  data = ready.from_tfds(config, 'tiny_shapes', data_dir=data_dir)
  assert data.train_examples == 12
  images, labels = next(iter(data.train))
  assert images.shape == (4, 8, 8, 1) and images.dtype == tf.float32
  np.testing.assert_allclose(
    tf.reduce_mean(images, [1, 2, 3]).numpy(), labels.numpy() * 200 / 255, rtol=1e-6
  )
  assert sorted(labels_of(data.eval, 5).tolist()) == [0, 0, 0, 1, 1]
  with pytest.raises(DataError, match="'tiny_shapes' is not prepared under"):
    ready.from_tfds(config, 'tiny_shapes', data_dir=str(tmp_path / 'empty'))
