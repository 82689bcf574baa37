"""Evaluation of causal LMs, dense or ours: perplexity at several context lengths (`ppl`), passkey
and multi-key and multi-value needle retrieval and variable tracking (`retrieval`), copying from
far back (`copying`), multi-query associative recall (`mqar`), next-token KL to a dense reference
(`kl`), and the table, JSON, plots and model-card section (`report`). `suite.evaluate` runs the
chosen tasks on one model; `subquadratic eval` is its command line. docs/evaluation.md defines every
measure. The held-out text (token stream, windows) is `subquadratic.data`'s.
"""

from .copying import copying
from .errors import EvaluationError
from .kl import next_token_kl
from .mqar import mqar_accuracy, mqar_batch, mqar_eval
from .ppl import perplexity
from .report import markdown_table, metric_figures, plot_results, position_table, write_card_evaluation, write_json
from .retrieval import mv_niah, niah, passkey, retrieval, variable_tracking
from .suite import DEFAULT_TASKS, TASKS, default_lengths, evaluate, evaluate_conversion, load_model, plan

__all__ = [
    "DEFAULT_TASKS", "EvaluationError", "TASKS", "copying", "default_lengths", "evaluate", "evaluate_conversion",
    "load_model", "markdown_table", "metric_figures", "mqar_accuracy", "mqar_batch", "mqar_eval", "mv_niah",
    "variable_tracking",
    "next_token_kl", "niah", "passkey", "perplexity", "plan", "plot_results", "position_table", "retrieval",
    "write_card_evaluation",
    "write_json",
]
