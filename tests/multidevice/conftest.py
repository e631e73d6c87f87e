"""Eight virtual CPU devices for the tests here (tensor parallelism), set before JAX
starts its backend. `make test` runs this directory in a pytest session of its own:
with eight devices every single-device test elsewhere runs ~30% slower on XLA:CPU
(measured: tests/engine/test_engine.py + tests/test_api.py 105 s -> 138 s), so the
rest of the suite keeps one. A plain `pytest` collects both and still passes, with
eight devices throughout."""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)
