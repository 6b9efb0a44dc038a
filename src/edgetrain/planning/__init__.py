"""What ``prepare()`` does between capturing a model and building its step: profile, plan, validate.

:class:`~.analysis.Analysis` holds prepare's decisions and runs the loop (in forked children where it
can); :class:`~.planner.Planner` plans with the pure solvers of :mod:`edgetrain.planners`, validates each
candidate by running it once (:mod:`.runs`), corrects the cost model with what it measured and, when
nothing is predicted to fit (:mod:`.smallest`), runs the smallest candidates or names the smallest feasible
budget; :mod:`.loss` works out how the loss is normalised, so micro-batches weigh it exactly, and
:mod:`.mixing` whether the forward keeps samples apart; :mod:`.guards` refuses changes to the model after
prepare. Nothing here is called by users.
"""

__all__: list[str] = []
