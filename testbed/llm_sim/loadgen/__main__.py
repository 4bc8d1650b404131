"""`python -m llm_sim.loadgen TRACE --url URL ...`: replay a trace in this process.

The benchmark starts this in its own process (`run_replay_in_subprocess`) so that the load
generator's event loop and the simulated pods' do not delay each other.
"""

from __future__ import annotations

import sys

from llm_sim.loadgen.process import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
