"""What a run writes and reads back: the run directory, the report and plots, the collapse monitor,
the detached stage-end drift jobs."""
