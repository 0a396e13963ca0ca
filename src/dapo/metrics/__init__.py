"""Run metrics: the sinks a run logs to (``logger``), the dashboard plot (``dashboard``) and
the transcripts of rollouts a person reads (``transcripts``)."""

from dapo.metrics.dashboard import plot_dashboard
from dapo.metrics.logger import PG_LOSS_NOTE, MetricsLogger, read_metrics
from dapo.metrics.transcripts import (
    TRANSCRIPTS_FILE,
    TranscriptWriter,
    format_transcript,
    read_transcripts,
    transcript_records,
)

__all__ = [
    "PG_LOSS_NOTE",
    "TRANSCRIPTS_FILE",
    "MetricsLogger",
    "TranscriptWriter",
    "format_transcript",
    "plot_dashboard",
    "read_metrics",
    "read_transcripts",
    "transcript_records",
]
