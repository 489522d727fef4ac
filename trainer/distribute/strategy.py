"""The tf.distribute strategy from `config.distribute`, and who writes files under it.

  default       one device (TF's default strategy)
  mirrored      MirroredStrategy over every local GPU, or the devices in `distribute.devices`
                ('GPU:0,GPU:1', 'CPU:0,CPU:1', ...)
  multi_worker  MultiWorkerMirroredStrategy; the cluster and this process's task come from the
                TF_CONFIG environment variable (see docs/guides/distribution.md)
  tpu           TPUStrategy via TPUClusterResolver(distribute.tpu): a TPU name, a
                'grpc://host:port' address, or '' / 'local' for a TPU attached to this host

Build the strategy before anything else touches TensorFlow devices: MultiWorkerMirroredStrategy
and the TPU system must be set up at program start.

Rules checked here (each a ConfigError or UserError naming the key and what to do):
  * the global batch `train.batch_size` must divide evenly among the replicas;
  * on a TPU only float32 and mixed_bfloat16 are allowed and loss scaling is off
    (`precision.loss_scale` 'auto' or 'none');
  * no TPU reachable, a missing TF_CONFIG, or a device that does not exist is an error.

Under multi_worker only the chief (task 'chief', or 'worker' 0 when the cluster has no chief)
writes checkpoints, summaries and config.json into the workdir. Every worker must still call
`save` (saving takes part in collective ops), so the others save into a temporary folder that is
removed right after (`scratch_dir`, `remove_scratch`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
import urllib.parse
from typing import Any

import ml_collections
import tensorflow as tf
from absl import logging

from trainer import config
from trainer.distribute import tf_config
from trainer.errors import ConfigError, UserError

STRATEGIES = config.STRATEGIES


def check_precision(config: ml_collections.ConfigDict) -> None:
  """ConfigError unless the precision settings suit the strategy (TPU: no float16, no scale)."""
  if config.distribute.strategy != 'tpu':
    return
  if config.precision.policy == 'mixed_float16':
    raise ConfigError(
      "config.precision.policy='mixed_float16' is not supported on a TPU "
      "(config.distribute.strategy='tpu'); use 'mixed_bfloat16', 'float32' or "
      "'auto'."
    )
  if config.precision.loss_scale not in ('auto', 'none'):
    raise ConfigError(
      f'config.precision.loss_scale={config.precision.loss_scale!r}: loss '
      "scaling is off on a TPU (bfloat16 has float32's range); set it to "
      "'auto' or 'none'."
    )


def set_threads(config: ml_collections.ConfigDict) -> None:
  """TensorFlow's op thread pools from `train.intra_op_threads` and `train.inter_op_threads`
  (0 = TensorFlow's choice, one thread per core for each pool). The pools are made when the
  runtime starts (the first op or device query), so this must run before: launch.py's Trainer
  does; in a process that already ran TensorFlow a changed value is a ConfigError."""
  for key in ('intra_op_threads', 'inter_op_threads'):
    pool = key.replace('threads', 'parallelism_threads')  # tf.config.threading's name
    get, set_ = (getattr(tf.config.threading, f'{verb}_{pool}') for verb in ('get', 'set'))
    wanted = int(config.train.get(key, 0))
    if wanted == 0 or get() == wanted:
      continue
    try:
      set_(wanted)
    except RuntimeError:
      raise ConfigError(
        f'config.train.{key}={wanted}: TensorFlow already started in this process with '
        f'{get() or "its default"} (the pools are fixed when the first op runs); build the '
        'Trainer before running any TensorFlow op, or leave the key at 0'
      ) from None
    logging.info('TensorFlow %s: %d threads', key.replace('_threads', ''), wanted)


def build(config: ml_collections.ConfigDict) -> tf.distribute.Strategy:
  """The strategy named by `config.distribute.strategy` (config already validated)."""
  check_precision(config)
  kind = config.distribute.strategy
  if config.distribute.devices and kind != 'mirrored':  # not an error: a resume may switch
    logging.warning(
      'config.distribute.devices=%r is ignored: only the mirrored strategy reads '
      "it, and config.distribute.strategy is %r (set it to 'mirrored', or clear "
      'devices)',
      config.distribute.devices,
      kind,
    )
  if kind == 'default':
    return tf.distribute.get_strategy()
  if kind == 'mirrored':
    return _mirrored(config.distribute.devices)
  if kind == 'multi_worker':
    return _multi_worker()
  if kind == 'tpu':
    return _tpu(config.distribute.tpu)
  raise ConfigError(f'config.distribute.strategy={kind!r} must be one of {", ".join(STRATEGIES)}.')


def _mirrored(devices: str) -> tf.distribute.MirroredStrategy:
  names = [d.strip() for d in devices.split(',') if d.strip()]
  if not names:
    gpus = tf.config.list_logical_devices('GPU')
    if not gpus:
      logging.warning(
        "config.distribute.strategy='mirrored' found no GPU: one replica on the "
        'CPU. Set config.distribute.devices to choose devices (CPU:0,CPU:1 splits '
        'the CPU into two replicas, to test multi-replica code).'
      )
    return tf.distribute.MirroredStrategy()
  _split_cpu(names, devices)
  known = {_short(d.name): d.name for d in tf.config.list_logical_devices()}
  chosen = []
  for name in names:
    if _short(name) not in known:
      raise ConfigError(
        f'config.distribute.devices={devices!r}: no device {name!r} here; '
        f'available: {", ".join(sorted(known))}.'
      )
    chosen.append(known[_short(name)])
  if len(set(chosen)) != len(chosen):
    raise ConfigError(f'config.distribute.devices={devices!r} names a device twice.')
  return tf.distribute.MirroredStrategy(chosen)


def _split_cpu(names: list[str], devices: str) -> None:
  """Devices CPU:1 and up name logical CPUs: the one physical CPU is split into that many
  (they share its cores: for testing several replicas, not for speed). TensorFlow allows this
  only before its runtime starts, which building the Trainer first ensures."""
  indices = [
    int(short[4:])
    for short in map(_short, names)
    if short.startswith('CPU:') and short[4:].isdigit()
  ]
  count = max(indices, default=0) + 1
  if count == 1:
    return
  cpu = tf.config.list_physical_devices('CPU')[0]
  if len(tf.config.get_logical_device_configuration(cpu) or []) >= count:
    return  # split already (by this process, before)
  try:
    tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
    )
  except RuntimeError:
    raise ConfigError(
      f'config.distribute.devices={devices!r}: splitting the CPU into {count} '
      'logical devices needs TensorFlow not to have started yet in this '
      'process; build the Trainer before running any TensorFlow op.'
    ) from None
  logging.info(
    'config.distribute.devices=%r: the CPU is split into %d logical devices', devices, count
  )


def _short(name: str) -> str:
  """'/job:localhost/replica:0/task:0/device:GPU:1', '/gpu:1', 'gpu:1' -> 'GPU:1'."""
  kind, _, index = name.rsplit('/', 1)[-1].replace('device:', '').rpartition(':')
  return f'{kind.upper()}:{index}'


def _multi_worker() -> tf.distribute.MultiWorkerMirroredStrategy:
  task = tf_config.read()
  if task is None:
    raise UserError(
      "config.distribute.strategy='multi_worker' needs the TF_CONFIG environment "
      'variable (cluster and task of this process); see docs/guides/distribution.md.'
    )
  logging.info(
    'multi_worker: %d tasks in the collective, this task %s (place %d)',
    len(task.addresses),
    task.name,
    task.position,
  )
  try:
    return tf.distribute.MultiWorkerMirroredStrategy()
  except tf.errors.UnknownError as e:  # its gRPC server's bind, a 25-line traceback
    if 'Could not start gRPC server' not in str(e):
      raise
    address = task.addresses[task.position]
    raise UserError(
      f'TF_CONFIG task {task.name}: TensorFlow could not listen on {address} (port '
      f'{address.rpartition(":")[2]} taken by another process since the launcher checked it?); '
      'free the port, or give this task another one'
    ) from None


def _tpu(tpu: str) -> tf.distribute.TPUStrategy:
  address = tpu or 'local'
  if address.startswith('grpc://'):
    _check_reachable(address)
  try:
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
    if address != 'local':
      tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
  except Exception as e:  # resolver, connection and init raise many types; all mean "no TPU"
    text = str(e).strip()
    first = text.splitlines()[0].split('. ')[0] if text else type(e).__name__  # one sentence
    raise UserError(
      f'config.distribute.tpu={tpu!r}: no TPU reachable ({first}). Give the TPU '
      "name or 'grpc://host:port' address, or run on a TPU VM with ''."
    ) from None
  return tf.distribute.TPUStrategy(resolver)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
  parsed = urllib.parse.urlparse(address)
  try:
    with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout):
      pass
  except (OSError, ValueError, TypeError) as e:
    raise UserError(
      f'config.distribute.tpu={address!r}: no TPU reachable ({e}). Check the '
      'address and that the TPU is up.'
    ) from None


def state_variable(
  value: Any, dtype: tf.DType, name: str, shape: tf.TensorShape | None = None
) -> tf.Variable:
  """A non-trainable variable of the step's own state (loss scale, counters, step), created
  under the strategy's scope and written once per step in cross-replica context: every replica
  holds the same value, and on save/restore the first replica's stands for all. `shape`: a
  less specific shape than the value's, for state whose size is set later."""
  return tf.Variable(
    value,
    dtype=dtype,
    trainable=False,
    name=name,
    shape=shape,
    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
  )


# ---- who writes ------------------------------------------------------------------------------
def task(strategy: tf.distribute.Strategy) -> tuple[str | None, int | None]:
  """(task type, task index) of this process under multi_worker, else (None, None)."""
  resolver = getattr(strategy, 'cluster_resolver', None)
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
    return None, None
  return resolver.task_type, resolver.task_id


def all_agree(strategy: tf.distribute.Strategy, flag: bool) -> bool:
  """True when `flag` is True on every worker: a collective under multi_worker (every worker
  calls it at the same point), `flag` itself otherwise."""
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return flag

  @tf.function
  def total(value):  # ReduceOp has SUM and MEAN only: the workers that disagree are counted
    per_replica = strategy.run(lambda: tf.identity(value))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

  return float(total(tf.constant(0.0 if flag else 1.0)).numpy()) == 0


def is_chief(strategy: tf.distribute.Strategy) -> bool:
  """True for the one process that writes the workdir (always, without multi_worker)."""
  return bool(strategy.extended.should_checkpoint)


_SCRATCH: set[str] = set()  # this process's scratch folders, removed at exit if still there


def scratch_dir(strategy: tf.distribute.Strategy) -> str:
  """A new temporary folder for a non-chief worker's checkpoints; remove it after each save."""
  task_type, task_id = task(strategy)
  # The pid: a launcher removes the folder of a worker killed with it inside (SCRATCH_GLOB).
  path = tempfile.mkdtemp(prefix=f'mpt-{task_type}{task_id}-{os.getpid()}-')
  if not _SCRATCH:
    atexit.register(remove_all_scratch)
  _SCRATCH.add(path)
  return path


def remove_scratch(path: str) -> None:
  shutil.rmtree(path, ignore_errors=True)


def remove_all_scratch() -> None:
  """Every scratch folder this process made (an exit before its first save left one)."""
  for path in list(_SCRATCH):
    remove_scratch(path)
    _SCRATCH.discard(path)
