"""The multi-worker launcher (workers on this host, a cluster of hosts, a Kubernetes Job) and
the start-up of a launch (quiet TensorFlow import, fast exit)."""
