"""The run folder (workdir): what training writes into it, and reading it back without writing.

  <workdir>/config.json               the config the run started with (never rewritten by a resume)
  <workdir>/config-step-<N>.json      the whole config of a resume at step N that changed keys
  <workdir>/checkpoints/              tf.train.CheckpointManager's ckpt-N files and state file,
                                      healthy.json (the last healthy checkpoint), evaluated.json
                                      (the step of the last eval that completed), policy.json
                                      (the precision policy the newest checkpoints trained in)
                                      and stopped.json (a requested stop's step and reason)
  <workdir>/tensorboard/              tf.summary events (train/..., eval/...)
  <workdir>/cluster.json              the number of workers that train it (a run of one process
                                      has none unless another count trained it before)
  <workdir>/train.lock                while a training process runs (trainer/run/lock.py)

Two ways in:
  * `restore_read_only()` (eval, export, sampling, `init_from`) restores the newest readable
    checkpoint and writes nothing (no lock, config or event file): it works on a read-only
    (archived) run folder and on a run another process is training.
  * `restore_for_training(init)`: read-only checks (the workdir, `checkpoints/` and `tensorboard/`
    are folders, `config.json` parses, no config change would be silently ignored), the lock,
    the restore, and only after it succeeded the config record, the checkpoint manager and the
    summary writer: a failed restore (another model) leaves every file as it was.

A resume compares the config with the newest record (config.json or the highest
config-step-N.json; trainer/run/config_record.py). Keys in RESUMABLE (run length, bookkeeping,
diagnostics, where the data is, the distribution) may change with a warning; any other change is
a ConfigError naming the keys, unless `config.train.accept_config_change=True`, which records it
as config-step-<N>.json (N = the step resumed from; config.json stays the first run's). Eval,
export and diagnose warn when the config differs from the record in what the restored model
computes (COMPUTES), or in the policy the run trained in ('auto' resolves per machine:
policy.json). A workdir with no checkpoint has no progress to protect: a new config replaces
config.json (and drops the config-step records of the checkpoints that are gone).

The workdir's own files (config records, the lock) are never written through a symlink: created
under fresh random names with O_EXCL (which does not follow links), then renamed into place (a
rename replaces a link). checkpoints/ and tensorboard/ are written by TensorFlow, which follows a
symlinked folder: one can be put on another disk that way. Under multi_worker only the chief
writes the workdir and takes the lock; saving takes part in collective ops, so every other worker
saves too, into a temporary folder removed after each save (`distribute.scratch_dir`), and its
summaries go nowhere.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any
from collections.abc import Callable

import tensorflow as tf
from absl import logging

from trainer.run import async_copy, checkpoint_files, checkpoints, preemption
from trainer.run.config_record import (
  CONFIG,
  RESUMABLE,
  changed_keys,
  computes,
  config_records,
  describe_change,
  policy_note,
  read_config,
  saved_policy,
)
from trainer.distribute import strategy as distribute
from trainer.distribute import tf_config
from trainer.insight import files
from trainer.step.eager_then_compiled import EagerThenCompiled
from trainer.run import lock as workdir_lock
from trainer.errors import ConfigError, UserError

HEALTHY = 'healthy.json'  # in checkpoints/: the last healthy checkpoint (trainer/run/health.py)
EVALUATED = 'evaluated.json'  # in checkpoints/: the step of the last eval that completed
POLICY = 'policy.json'  # in checkpoints/: the resolved policy of the process that saved last
STOPPED = 'stopped.json'  # in checkpoints/: the step and reason of a requested stop
CHECKPOINTS = 'checkpoints'
TENSORBOARD = 'tensorboard'
# TensorBoard writes of one set of tags run eagerly this many times before one compiled call
# takes over (_ScalarWrites: compiling costs about 8 eager writes).
WRITES_BEFORE_COMPILING = 8


def local_path(path: str, flag: str = '--workdir') -> str:
  """`path` made absolute; ConfigError for a URL (gs://, s3://, hdfs://, ...). The workdir's
  guarantees (the lock, writes that never follow a symlink, atomic config records) are made with
  the local file system's calls, which an object store does not offer; a bucket mounted as a
  folder (gcsfuse, s3fs) or a shared file system (NFS) is a path like any other."""
  if '://' in str(path):
    raise ConfigError(
      f'{flag}={path}: a URL is not a workdir this framework can lock and write '
      'safely; mount the bucket as a folder (e.g. gcsfuse) or use a shared file '
      f'system, and pass {flag}=<that folder>/...'
    )
  return os.path.abspath(path)


def write_json(path: str, value: dict) -> None:
  """Writes `path` atomically without following a symlink (see the module docstring)."""
  fd, tmp = files.temporary(path)
  try:
    with os.fdopen(fd, 'w') as f:
      json.dump(value, f, indent=2, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException as e:  # disk full, quota: nothing half-written stays behind
    if os.path.lexists(tmp):
      os.remove(tmp)
    if isinstance(e, OSError):
      raise ConfigError(
        f'could not write {path} ({e.strerror}); free disk space or pass '
        '--workdir=<a folder you can write>.'
      ) from None
    raise


class Workdir:
  """A run folder: `checkpoint` (a tf.train.Checkpoint) is what it saves; `items` (default: the
  checkpoint) is what restores read, passed to `checkpoints.restore_newest_readable`."""

  def __init__(
    self,
    path: str,
    checkpoint: tf.train.Checkpoint,
    config,
    *,
    strategy: tf.distribute.Strategy,
    items=None,
    policy: str | None = None,
  ):
    self.path = local_path(path)
    self.checkpoint = checkpoint
    self.items = checkpoint if items is None else items
    self.config = config
    self.strategy = strategy
    self.policy = policy  # the resolved precision policy this process runs in (None: unknown)
    self._policy_recorded = False  # policy.json written by this process's first save
    self.is_chief = distribute.is_chief(strategy)
    self.checkpoint_dir = os.path.join(self.path, CHECKPOINTS)
    self.scratch: str | None = None  # a non-chief worker's temporary checkpoint folder
    # TensorFlow's CheckpointManager and summary writer, and the lock (untyped: Any).
    self._manager: Any = None
    self._writer: Any = None
    self._scalars: _ScalarWrites | None = None  # write_scalars' compiled writes, per writer
    self._lock: Any = None
    # A save not yet recorded: its background write may be running (sync).
    self._pending: tuple | None = None

  # ---- reading ---------------------------------------------------------------------------------
  def restore_read_only(self) -> str | None:
    """Restores the newest readable checkpoint (eval, export, sampling); writes nothing. Returns
    its path, or None when there is none. A config that differs from the run's record in what
    the restored model computes (COMPUTES) is a warning: this config is used."""
    try:
      saved = read_config(self.path) or {}
    except ConfigError:  # a damaged record: the checkpoint may still be read
      saved = {}
    changed = changed_keys(saved, json.loads(json.dumps(self.config.to_dict()))) if saved else []
    other = [k for k in changed if computes(k)]
    trained = self.trained_policy(saved)
    if trained is not None and trained == self.policy and 'precision.policy' in other:
      other.remove('precision.policy')  # another spelling ('auto') of what the run trained in
    now = self.config.precision.policy
    note = policy_note(trained, saved_policy(saved) or now, self.policy, now)
    if other:
      logging.warning(
        '%s; this config is used%s',
        describe_change(
          saved, self.config, other, f'the run in {self.path} was trained with another config'
        ),
        f': the run {note}' if note else '',
      )
    elif note:  # the same config, 'auto' resolved to another policy here
      logging.warning(
        "the run in %s %s (config.precision.policy='auto' resolves per machine); pass "
        '--config.precision.policy=%s to compute as it trained',
        self.path,
        note,
        trained,
      )
    return checkpoints.restore_newest_readable(self.items, self.checkpoint_dir, read_only=True)

  def trained_policy(self, saved: dict | None = None) -> str | None:
    """The precision policy the run's newest checkpoints trained in: policy.json's, else the
    config record's `saved` unless it is 'auto' (what it resolved to was not recorded: None)."""
    recorded = self._record_field(POLICY, 'policy', str)
    if recorded is not None:
      return recorded
    setting = saved_policy(saved)
    return None if setting in (None, 'auto') else setting

  def _record_field(self, name: str, key: str, kind: Callable):
    """`kind(value)` of `key` in checkpoints/<name> (a JSON record), None when the file is
    missing or damaged. Reads only."""
    try:
      with open(os.path.join(self.checkpoint_dir, name)) as f:
        return kind(json.load(f)[key])
    except (OSError, ValueError, KeyError, TypeError):
      return None

  # ---- training --------------------------------------------------------------------------------
  def restore_for_training(self, init: Callable[[], object] | None = None) -> str | None:
    """Checks, locks, restores (calling `init()` when there is no checkpoint, e.g. init_from),
    then opens the workdir for writing. Returns the restored checkpoint's path or None. Under
    multi_worker the other workers read the run folder only once the chief holds its lock."""
    refused = None
    if self.is_chief:
      try:
        self._check()
        self._acquire()
      except UserError as e:  # raised below, once the others know: they wait for it otherwise
        refused = e
    if not distribute.all_agree(self.strategy, refused is None):
      raise refused or UserError(
        f'worker 0 could not open the run folder {self.path} (its one line says why); this '
        'worker read nothing from it'
      )
    if not self.is_chief:
      self._check()
    try:
      restored = checkpoints.restore_newest_readable(self.items, self.checkpoint_dir)
      if restored is None and init is not None:
        init()
      if restored and self.is_chief:
        checkpoint_files.repair_state(self.checkpoint_dir, restored)
      self._open(restored is not None, checkpoint_files.step_of(restored) if restored else 0)
    except BaseException:
      self.close()
      self._remove_if_created_empty()  # a failed start leaves no trace (e.g. a bad init_from)
      raise
    return restored

  def save(self, step: int, *, healthy: bool = False, loss: float | None = None) -> str:
    """Saves the checkpoint as ckpt-<step>; returns its path (a non-chief: the chief's, as the
    same command resumes from it). Callers run their pre-save checks (Runner.save) first:
    nothing is written before this call. `healthy` (trainer/run/health.py, with the training
    `loss`): it becomes the last healthy checkpoint, which rotation never removes until a newer
    one is healthy.

    With config.train.async_checkpoint (CheckpointOptions(experimental_enable_async_checkpoint=
    True)) the variables are copied now and written by TensorFlow's background thread as a
    synchronous save writes them (temporary files renamed into place, then the state file and
    the rotation: a kill -9 mid-write leaves the previous checkpoint named); this returns once
    the copy is made. The previous background write is waited for first (`sync`), and a save's
    healthy record and log line come once its files are complete (trainer/run/async_copy.py:
    what makes TensorFlow's copy work with Keras 3 variables)."""
    self.open_for_writing(step)
    self.sync()  # the previous background write: done, recorded, or its error raised here
    keep = None if self.scratch else self.healthy_path()
    manager = self._manager
    # pylint: disable=protected-access  (CheckpointManager offers no way to keep one checkpoint)
    pending = list(manager._maybe_delete)  # oldest first; the save removes the oldest ones
    if keep in pending[: max(0, len(pending) + 1 - manager._max_to_keep)]:
      manager._maybe_delete.pop(keep)  # out of rotation (and of the state file; `find` lists it)
    asynchronous = bool(self.config.train.async_checkpoint) and not self.scratch
    if asynchronous:
      async_copy.keras_variables_copy_once()
      options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
      path = checkpoints.save(manager, step, options=options)  # returns after the copy
    else:
      path = checkpoints.save(manager, step)  # a failed write: one line, partial files gone
    if self.scratch:  # named as the chief saved it: the scratch copy is gone
      distribute.remove_scratch(self.scratch)
      return os.path.join(self.checkpoint_dir, os.path.basename(path))
    self._pending = (path, step, healthy, loss, keep, asynchronous)
    if not asynchronous:
      self.sync()
    return path

  def sync(self) -> None:
    """Waits for a background checkpoint write (async_checkpoint) and records the save: the log
    line, the healthy record. A failed background write is the same one-line UserError as a
    failed synchronous one. A no-op when no save is pending."""
    pending, self._pending = self._pending, None
    if pending is None:
      return
    path, step, healthy, loss, keep, asynchronous = pending
    if asynchronous:
      checkpoints.sync(self.checkpoint, self._manager, step)
    logging.info('saved checkpoint %s', path)
    if self.policy is not None and not self._policy_recorded:  # once: a process has one policy
      write_json(
        os.path.join(self.checkpoint_dir, POLICY),
        {'policy': self.policy, 'config': self.config.precision.policy},
      )
      self._policy_recorded = True
    if healthy:
      write_json(
        os.path.join(self.checkpoint_dir, HEALTHY),
        {'checkpoint': os.path.basename(path), 'step': step, 'loss': loss},
      )
      if keep and keep != path and keep not in self._manager.checkpoints:
        checkpoints.remove(keep)  # the previous healthy one, kept out of rotation until now

  def healthy_record(self) -> dict | None:
    """{'checkpoint': 'ckpt-N', 'step', 'loss'} of the last healthy checkpoint, None when there
    is none (or its files are gone). Reads only."""
    try:
      with open(os.path.join(self.checkpoint_dir, HEALTHY)) as f:
        record = json.load(f)
      name = str(record['checkpoint'])
    except (OSError, ValueError, KeyError, TypeError):
      return None
    if not re.fullmatch(r'ckpt-\d+', name) or not os.path.isfile(
      os.path.join(self.checkpoint_dir, name + '.index')
    ):
      return None
    return record

  def record_eval(self, step: int) -> None:
    """Records that the eval at `step` completed, its actions' state saved (the chief writes
    checkpoints/evaluated.json): the checkpoint of an eval step is written before its eval, so
    a resume from it redoes the eval unless this record is at or past its step (Runner)."""
    if not self.is_chief:
      return
    os.makedirs(self.checkpoint_dir, exist_ok=True)  # an eval before the first save
    write_json(os.path.join(self.checkpoint_dir, EVALUATED), {'step': int(step)})

  def evaluated_step(self) -> int | None:
    """The step of the last eval that completed (`record_eval`); None when none did, or the run
    folder was written before the record existed. Reads only (every worker: the chief's)."""
    return self._record_field(EVALUATED, 'step', int)

  def record_stop(self, step: int, reason: str) -> None:
    """Records a requested stop (an action's request_stop, a Keras callback's stop_training),
    saved at `step` (the chief writes checkpoints/stopped.json): a rerun of the same command
    restores that step and trains no further (Runner.train)."""
    if self.is_chief:
      write_json(os.path.join(self.checkpoint_dir, STOPPED), {'step': int(step), 'reason': reason})

  def stopped(self) -> tuple[int, str] | None:
    """(step, reason) of the recorded stop (`record_stop`), None when there is none. Reads only."""
    step = self._record_field(STOPPED, 'step', int)
    return None if step is None else (step, str(self._record_field(STOPPED, 'reason', str)))

  def healthy_path(self) -> str | None:
    record = self.healthy_record()
    return os.path.join(self.checkpoint_dir, record['checkpoint']) if record else None

  def write_scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
    self.open_for_writing(step)
    if self._scalars is None or self._scalars.writer is not self._writer:
      self._scalars = _ScalarWrites(self._writer)
    tags = tuple(f'{prefix}/{k}' for k in values)
    self._scalars.write(tags, [float(v) for v in values.values()], step)
    self._writer.flush()

  @property
  def latest_checkpoint(self) -> str | None:
    """The newest checkpoint this run saved or resumed from (None before the workdir is open)."""
    return self._manager.latest_checkpoint if self._manager is not None else None

  @property
  def newest_for_resume(self) -> str | None:
    """The newest checkpoint as the same command resumes from it: a non-chief worker's own copy
    is in a scratch folder removed after each save, so it names the chief's, of the same name."""
    newest = self.latest_checkpoint
    if newest is not None and self.scratch:
      return os.path.join(self.checkpoint_dir, os.path.basename(newest))
    return newest

  def close(self) -> None:
    """Waits for a background checkpoint write, flushes the summaries and releases the lock
    (the lock is also released at exit)."""
    if self._manager is not None:
      self.sync()
    if self._writer is not None:
      self._writer.close()
      self._writer = None
    self._manager = None
    if self._lock is not None:
      workdir_lock.release(self._lock)
      self._lock = None

  # ---- inside ----------------------------------------------------------------------------------
  def open_for_writing(self, step: int) -> None:
    """Opens the workdir for writing if `restore_for_training` has not (a custom loop that saves
    or logs without restoring first): checks, lock, config record, manager, writer."""
    if self._manager is None:
      self._check()
      self._acquire()
      self._open(bool(checkpoint_files.find(self.checkpoint_dir)), step)

  def _check(self) -> None:
    """Read-only checks before anything is written: UserError/ConfigError, one line each."""
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise ConfigError(f'workdir {self.path} is a file, not a folder; pass --workdir=<a folder>.')
    for name in (CHECKPOINTS, TENSORBOARD):
      sub = os.path.join(self.path, name)
      if os.path.lexists(sub) and not os.path.isdir(sub):
        raise UserError(
          f'{sub} is a file, not a folder; move it out of the workdir or use a new --workdir.'
        )
    state = os.path.join(self.checkpoint_dir, checkpoint_files.STATE_FILE)
    if os.path.isdir(state):  # the manager rewrites it by a rename, which a folder refuses
      raise UserError(
        f'{state} is a folder, not the checkpoint state file; move it out of the '
        'workdir (the ckpt-N files next to it are kept and resumed from).'
      )
    saved = read_config(self.path)
    if saved is None or not checkpoint_files.find(self.checkpoint_dir):
      return  # nothing to resume: the current config starts (or restarts) the run
    changed = changed_keys(saved, json.loads(json.dumps(self.config.to_dict())))
    other = [k for k in changed if k not in RESUMABLE]
    if other and not self.config.train.accept_config_change:
      raise ConfigError(
        describe_change(
          saved, self.config, other, f'workdir {self.path} holds a run trained with another config'
        )
        + '; resuming would ignore or mix the change. Use a new workdir for the new '
        'config, or set config.train.accept_config_change=True to resume this run with it.'
      )
    if changed:  # _record_config names the file once the step resumed from is known
      logging.warning('resuming %s with a changed config (%s)', self.path, ', '.join(changed))
      if {'train.steps', 'train.epochs'} & set(
        changed
      ) and self.config.optimizer.schedule == 'cosine':
        logging.warning(
          'the cosine learning-rate schedule now spans the new run length: the '
          'rate from the resumed step on follows the new curve (it rises again '
          'when the run grows)'
        )

  def _acquire(self) -> None:
    if not self.is_chief or self._lock is not None:
      return
    self._created = not os.path.lexists(self.path)
    try:
      os.makedirs(self.path, exist_ok=True)
      self._lock = workdir_lock.acquire(self.path)
    except OSError as e:
      self._remove_if_created_empty()
      raise ConfigError(
        f'workdir {self.path} is not writable ({e.strerror}); pass '
        '--workdir=<a folder you can write>.'
      ) from None

  def _remove_if_created_empty(self) -> None:
    if getattr(self, '_created', False) and os.path.isdir(self.path) and not os.listdir(self.path):
      os.rmdir(self.path)

  def _open(self, resumed: bool, step: int) -> None:
    """After a successful restore (`resumed`: of a checkpoint at `step`): the config record, the
    checkpoint manager, the summary writer."""
    if self._manager is not None:
      return
    if not self.is_chief:
      self.scratch = distribute.scratch_dir(self.strategy)
      self._manager = tf.train.CheckpointManager(self.checkpoint, self.scratch, max_to_keep=1)
      self._writer = tf.summary.create_noop_writer()
      return
    try:
      self._record_config(resumed, step)
      self._record_cluster()
    except OSError as e:
      raise ConfigError(
        f'workdir {self.path}: cannot write the config record ({e.strerror}); '
        'free some space or pass another --workdir.'
      ) from None
    # A copied or moved run's state file may name checkpoints by absolute path: rotation must
    # delete this run's files only (checkpoint_files.own_state).
    checkpoint_files.own_state(self.checkpoint_dir)
    self._manager = tf.train.CheckpointManager(
      self.checkpoint, self.checkpoint_dir, max_to_keep=self.config.train.max_to_keep
    )
    self._writer = tf.summary.create_file_writer(os.path.join(self.path, TENSORBOARD))

  def _record_cluster(self) -> None:
    """cluster.json: how many workers train this run, which the launcher checks a resume
    against (trainer/launch/cluster.py); a single process records only a change of count."""
    path, count = os.path.join(self.path, tf_config.RECORD), preemption.workers(self.strategy)
    try:
      with open(path) as f:
        recorded = json.load(f).get('workers')
    except (OSError, ValueError):
      recorded = None
    if count != (recorded or 1) or (count > 1 and recorded is None):
      task = tf_config.read() if count > 1 else None
      write_json(path, {'workers': count, 'addresses': task.addresses if task else []})

  def _record_config(self, resumed: bool, step: int) -> None:
    current = json.loads(json.dumps(self.config.to_dict()))
    if not resumed:
      for record_step, name in config_records(self.path):
        if record_step >= 0:
          os.remove(name)  # the record of checkpoints that are gone
      evaluated = os.path.join(self.checkpoint_dir, EVALUATED)
      if os.path.lexists(evaluated):  # of steps a new run has not reached: it would say done
        os.remove(evaluated)
      write_json(os.path.join(self.path, CONFIG), current)
      return
    saved = read_config(self.path)
    if saved is None:
      write_json(os.path.join(self.path, CONFIG), current)
    elif changed_keys(saved, current):
      write_json(os.path.join(self.path, f'config-step-{step}.json'), current)
      logging.warning(
        'the changed config is recorded as config-step-%d.json (config.json keeps '
        "the first run's record)",
        step,
      )


class _ScalarWrites:
  """TensorBoard scalars through one call per set of tags (a progress line's, an eval's, the
  numerics probe's), eager for its first writes and compiled after them (trainer/step/
  eager_then_compiled.py): compiled, a progress line's tags write several times faster (a visible
  share of a small model's steps between two lines), but compiling costs about 8 eager writes,
  which a set written a few times a run never earns back (docs/references.md, "Start-up: eager
  first, compiled later"). The values are written as float32, as the eager calls wrote them."""

  def __init__(self, writer):
    self.writer = writer
    self._calls: dict[tuple[str, ...], EagerThenCompiled] = {}

  def write(self, tags: tuple[str, ...], values: list[float], step: int) -> None:
    call = self._calls.get(tags)
    if call is None:
      writer = self.writer

      def write(values, step):
        with writer.as_default():
          for i, tag in enumerate(tags):
            tf.summary.scalar(tag, values[i], step=step)

      # eager_seconds: a bound on what a very large set's eager writes may cost in all; every
      # set measured writes eagerly well within it, so it is the count that decides.
      call = self._calls[tags] = EagerThenCompiled(
        write, eager_calls=WRITES_BEFORE_COMPILING, eager_seconds=2.0, autograph=False
      )
    call(tf.constant(values, tf.float32), tf.constant(step, tf.int64))
