"""Run metrics: the sinks a run logs to (``logger``) and the dashboard plot (``dashboard``)."""

from dapo.metrics.dashboard import plot_dashboard
from dapo.metrics.logger import PG_LOSS_NOTE, MetricsLogger, read_metrics

__all__ = ["PG_LOSS_NOTE", "MetricsLogger", "plot_dashboard", "read_metrics"]
