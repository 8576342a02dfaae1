"""Autotuning schedule knobs (Slapo's ``slapo.autotune``): spaces of :class:`Symbol` s, a runner that
measures training steps, results cached in a :class:`Database`, exhaustive or cost-model-guided
search (:mod:`.search`), and the ``schedlang tune`` command (:mod:`.tune`)."""

from .database import Database
from .search import TuneResult, grid_search, model_guided_search, plot_best_so_far, transformer_cost_model
from .space import Space, Symbol, must_fix

__all__ = ["Symbol", "Space", "Database", "must_fix", "TuneResult", "grid_search", "model_guided_search",
           "transformer_cost_model", "plot_best_so_far"]
