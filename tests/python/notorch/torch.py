"""Put first on PYTHONPATH, this makes `import torch` fail as on a machine
without torch (make check-notorch): every Python test must then skip or
pass, never crash."""
raise ImportError("torch is hidden by tests/python/notorch (make check-notorch)")
