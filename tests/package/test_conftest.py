"""tests/conftest.py's autouse fixtures: what one test switches for the process, the next test of
the same worker does not inherit."""

pytest_plugins = ['pytester']


def test_op_determinism_switched_on_by_a_test_is_off_in_the_next(pytester):
  """Two tests in one process (pytester runs them inside this one, TensorFlow loaded once): the
  first switches op determinism on, as a run with config.train.deterministic does."""
  pytester.makepyfile(
    """
    from tensorflow.python.framework import config as tf_config

    from conftest import _restore_op_determinism  # noqa: F401 (autouse in this module)


    def test_switches_it_on():
      tf_config.enable_op_determinism()
      assert tf_config.is_op_determinism_enabled()


    def test_finds_it_off():
      assert not tf_config.is_op_determinism_enabled()
    """
  )
  pytester.runpytest_inprocess('-p', 'no:cacheprovider', '-p', 'no:xdist').assert_outcomes(passed=2)
