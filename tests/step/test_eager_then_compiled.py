"""trainer/step/eager_then_compiled.py: rarely called functions run eagerly first, compiled
after a number of calls or seconds (the probe's and the checkpoint check's numbers are tested
in test_numerics.py and test_checkpoints*.py)."""

import time

import tensorflow as tf

from trainer.step.eager_then_compiled import EagerThenCompiled


def _spy():
  modes = []

  def fn(x):
    modes.append('eager' if tf.executing_eagerly() else 'graph')
    return x * 2.0

  return fn, modes


def test_the_first_calls_run_eagerly_then_one_compiled_function():
  fn, modes = _spy()
  f = EagerThenCompiled(fn, eager_calls=3, eager_seconds=60.0)
  results = [float(f(tf.constant(float(i)))) for i in range(6)]
  assert results == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
  # Three eager runs, then one trace that serves the other three calls.
  assert modes == ['eager', 'eager', 'eager', 'graph']
  assert f.compiled.experimental_get_tracing_count() == 1
  assert f.calls == 6 and not f.eager_next


def test_eager_stops_once_the_eager_calls_took_the_seconds_given():
  modes = []

  def slow(x):
    modes.append('eager' if tf.executing_eagerly() else 'graph')
    if tf.executing_eagerly():
      time.sleep(0.05)
    return x + 1.0

  f = EagerThenCompiled(slow, eager_calls=100, eager_seconds=0.01)
  for _ in range(3):
    f(tf.constant(1.0))
  assert modes == ['eager', 'graph']  # one slow eager call spent the budget


def test_with_a_tpu_every_call_is_compiled(monkeypatch):
  fn, modes = _spy()
  f = EagerThenCompiled(fn, eager_calls=3, eager_seconds=60.0)
  real = tf.config.list_logical_devices
  monkeypatch.setattr(
    tf.config, 'list_logical_devices', lambda kind=None: ['TPU:0'] if kind == 'TPU' else real(kind)
  )
  f(tf.constant(1.0))
  f(tf.constant(1.0))
  assert modes == ['graph']


def test_inside_a_traced_function_it_is_traced_there_and_not_counted():
  fn, modes = _spy()
  f = EagerThenCompiled(fn, eager_calls=3, eager_seconds=60.0)
  outer = tf.function(lambda x: f(x) + 1.0)
  assert float(outer(tf.constant(1.0))) == 3.0
  assert modes == ['graph'] and f.calls == 0


def test_a_function_that_fails_eagerly_is_compiled_from_then_on():
  """Keras's float8 layers' custom gradient fails under eager execution; the probe then runs
  compiled, as before (tests/step/test_float8.py measures through it)."""
  modes = []

  def graph_only(x):
    modes.append('eager' if tf.executing_eagerly() else 'graph')
    if tf.executing_eagerly():
      raise ValueError('graph only')
    return x * 3.0

  f = EagerThenCompiled(graph_only, eager_calls=5, eager_seconds=60.0)
  assert [float(f(tf.constant(1.0))) for _ in range(3)] == [3.0, 3.0, 3.0]
  assert modes == ['eager', 'graph'] and not f.eager_next
