"""Settings for the whole test suite."""

import os

# Tests of the grad_exchange formats check their numbers step by step, so no exchange guard there: it would run
# reference-exchange steps among the compressed ones (pt3func/compress/guard.py). Set before pt3func is imported,
# so the gloo worlds' processes inherit it; tests/test_exchange_guard.py turns the guard back on.
os.environ["PT3FUNC_EXCHANGE_GUARD"] = "off"
