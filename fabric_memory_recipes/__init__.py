"""Fabric memory recipes: the shared parts of the numbered recipes, by layer.

- ``config``, ``console``, ``faults``, ``paths``: a run's configuration, its one-line messages, what
  stops it, and where it may write (a user's runs under runs/; results/published/ only on purpose);
- ``measurement``: what a run records (results JSON, memory peaks, step times) and the report;
- ``training``: flags, data, models, the one training loop and its fast path;
- ``planning``: the memory estimate of a configuration and the planner (``--fit``);
- ``tools``: command-line tools (comparison with the article's scripts, equivalence, convergence, ...).

Each layer imports only the layers listed above it.
"""

# console first: importing it makes an unhandled Ctrl-C one line and exit 130 (console.one_line_ctrl_c)
from fabric_memory_recipes import console  # noqa: F401
from fabric_memory_recipes.config import RunConfig

__all__ = ["RunConfig"]
